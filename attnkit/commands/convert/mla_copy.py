"""The tensors `convert mla` copies: everything outside attention, under its name in the target, with what the
target's classes read differently from the source's (DeepseekV3: norms and embeddings of Gemma, a tied head), and
the input norm the engine route folds into the projections. Names by role from the architecture registry
(attnkit/archs/data)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from attnkit.commands.convert.mla_target import target_arch
from attnkit.errors import AttnkitError

if TYPE_CHECKING:
    from attnkit.commands.convert.mla_request import MLASource


def copy_rest(reader, src: MLASource, writer, expected: dict, fold_input_norm: bool, config) -> None:
    """Every non-attention tensor of the source to `writer` under its name in the target (`expected`: the
    target's names, `config`: its config). A family that stores a norm's weight w and applies offset + w (Gemma:
    1 + w) gets offset + w written where the target applies the weight as stored (DeepseekV3); Gemma's embeddings
    are written x sqrt(n) (its normalizer) for a target without one; a tied source head is written out whenever
    the target has one; fold_input_norm: the input norms are written as the identity scale (the engine route
    folds them into the attention projections)."""
    import torch

    arch = target_arch(config)
    attention = {n for roles in src.layer_names for n in roles.values()}
    input_norms = {src.tensor("input_norm", i) for i in range(src.spec.num_layers)}
    norms = src.arch.norm_names(src.spec.num_layers, src.prefix)
    offset = src.arch.norm_offset - arch.norm_offset  # added to a stored norm weight
    gemma = src.arch.family == "gemma"
    embed_name, head = src.tensor("embed", None), arch.head_name
    for name in reader.names():
        if name in attention:
            continue
        if name not in expected:
            raise AttnkitError(f"{src.ref}: tensor {name!r} has no place in a {config.architectures[0]} checkpoint")
        t = reader.get(name)
        if fold_input_norm and name in input_norms:
            t = torch.full_like(t, 1.0 - arch.norm_offset)
        elif offset and name in norms:
            t = (t.to(torch.float32) + offset).to(t.dtype)
        if name == embed_name and head in expected and src.arch.head_name not in reader.names():
            writer.add(head, t)  # a tied source head, written out for engines that never tie
        if gemma and name == embed_name:
            t = t * torch.tensor(src.spec.hidden_size**0.5, dtype=t.dtype)  # Gemma's normalizer, in its dtype
        writer.add(name, t)
