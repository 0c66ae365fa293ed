"""Match an architecture's tensor-name templates to a checkpoint: the name prefix and expected shapes."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from attnkit.archs import Arch
from attnkit.archs.spec import AttentionSpec
from attnkit.errors import AttnkitError


def find_prefix(arch: Arch, names: Iterable[str]) -> str:
    """The prefix that turns `arch`'s layer-0 templates into names present in `names`.

    E.g. "model." for Llama, "transformer." for a GPT2LMHeadModel, "" for the hub's gpt2,
    "bert.encoder." for a BertForMaskedLM. The prefix matching the most roles wins, so a vision
    tower that shares some names (q_proj, ...) with the language model does not confuse it.
    """
    names = set(names)
    votes: Counter[str] = Counter()
    for role in arch.tensors:
        suffix = arch.tensor_name(role, 0)
        for name in names:
            if name.endswith(suffix):
                prefix = name[: -len(suffix)]
                if prefix == "" or prefix.endswith("."):
                    votes[prefix] += 1
    if not votes:
        raise AttnkitError(
            f"no tensor matches the {arch.family} templates (e.g. {arch.tensor_name('o', 0)!r}); "
            "is this checkpoint really that architecture?"
        )
    ranked = votes.most_common()
    best = [p for p, n in ranked if n == ranked[0][1]]
    if len(best) > 1:
        raise AttnkitError(f"ambiguous {arch.family} tensor prefix: {', '.join(repr(p) for p in sorted(best))}")
    return best[0]


def role_shape(arch: Arch, spec: AttentionSpec, role: str) -> tuple[int, ...]:
    """Shape a `role` tensor must have (PyTorch Linear layout: [out, in]; GPT-2 Conv1D: [in, out])."""
    d, h, hkv, dk, dv = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
    fused = (h * dk + hkv * dk + hkv * dv)
    if spec.mla is not None:
        m = spec.mla
        q_in = m.q_lora_rank or d
        shapes = {
            "q": (h * dk, d), "q_a": (q_in, d), "q_a_bias": (q_in,), "q_a_norm": (q_in,), "q_b": (h * dk, q_in),
            "kv_a": (m.kv_lora_rank + m.qk_rope_head_dim, d), "kv_a_bias": (m.kv_lora_rank + m.qk_rope_head_dim,),
            "kv_a_norm": (m.kv_lora_rank,), "kv_b": (h * (m.qk_nope_head_dim + dv), m.kv_lora_rank),
            "o": (d, h * dv), "o_bias": (d,),
        }
    else:
        per_head_norm = spec.qk_norm == "per_head"
        shapes = {
            "q": (h * dk, d), "k": (hkv * dk, d), "v": (hkv * dv, d), "o": (d, h * dv),
            "q_bias": (h * dk,), "k_bias": (hkv * dk,), "v_bias": (hkv * dv,), "o_bias": (d,),
            "qkv": (d, fused) if arch.qkv_layout == "conv1d_concat" else (fused, d), "qkv_bias": (fused,),
            "q_norm": (dk,) if per_head_norm else (h * dk,), "k_norm": (dk,) if per_head_norm else (hkv * dk,),
            "sinks": (h,),
        }
    if role not in shapes:
        raise AttnkitError(f"tensor role {role!r} has no shape rule for {arch.family} ({arch.qkv_layout})")
    return shapes[role]
