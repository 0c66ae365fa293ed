"""What trains: the rewritten attention tensors (default) or every tensor, directly or through LoRA adapters
(peft) that are merged back into the weights at the end."""

from __future__ import annotations

from attnkit.commands.heal.pair import attention_modules, rewritten_parameters
from attnkit.errors import AttnkitError


def select(student, teacher, mode: str) -> list[str]:
    """Names of the student parameters to train; freezes every other parameter."""

    if mode == "all":
        names = [n for n, _ in student.named_parameters()]
    else:
        names = rewritten_parameters(student, teacher)
        if not names:
            raise AttnkitError(
                "the student's attention equals the teacher's: nothing was rewritten to heal "
                "(use --train all to train every tensor)"
            )
    chosen = set(names)
    for name, p in student.named_parameters():
        p.requires_grad_(name in chosen)
    return names


def attention_pairs(student, teacher, names: list[str]) -> dict:
    """{module name: (student module, teacher module)} of the attention blocks holding a trained tensor."""

    theirs = dict(teacher.named_modules())
    return {
        name: (module, theirs[name])
        for name, module in attention_modules(student).items()
        if name in theirs and any(n.startswith(name + ".") for n in names)
    }


#: Peak learning rates when --lr is not given; MLA students train at a third of the rate (why, measured:
#: docs/heal.md, "Results and how the defaults were chosen").
DEFAULT_LR, MLA_LR = 3e-4, 1e-4


def default_lr(config: dict) -> float:
    """The peak learning rate for a student with this config.json: MLA_LR with a latent KV cache, else DEFAULT_LR."""
    return MLA_LR if config.get("kv_lora_rank") else DEFAULT_LR


def lr_scales(model) -> dict[str, float]:
    """{module name: lr factor} for the latent projection of each MLA attention whose kv_a_layernorm weights are
    large by construction: convert mla's anchor latent scales its information channels by 2^-8 and the norm's
    weights (~256) undo it. Adam moves every weight by about lr per step whatever its size, so those rows would
    train ~256 times faster than everything else and push the latent out of the norm's linear regime (docs/heal.md
    shows the divergence). They train at lr / median |weight|."""
    scales = {}
    for name, module in model.named_modules():
        norm, latent = getattr(module, "kv_a_layernorm", None), getattr(module, "kv_a_proj_with_mqa", None)
        if norm is None or latent is None or getattr(norm, "weight", None) is None:
            continue
        gain = norm.weight.detach().abs().median().item()
        if gain > 2:
            scales[f"{name}.kv_a_proj_with_mqa" if name else "kv_a_proj_with_mqa"] = 1 / gain
    return scales


def add_lora(model, names: list[str], rank: int, seed: int):
    """Wrap `model` with LoRA adapters of `rank` on the Linear modules among `names` (the output head excepted);
    other chosen tensors (norms, biases of untouched modules) train directly. Returns the peft model. The
    adapters' random initialization draws from `seed`: the same in every run and on every process (--fsdp
    shards each process's own copy)."""
    import torch

    try:
        from peft import LoraConfig, get_peft_model
    except ImportError:
        raise AttnkitError("--lora-rank needs the `peft` package (pip install 'attnkit[heal]')") from None
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    linear = sorted(
        {
            n.rsplit(".", 1)[0]
            for n in names
            if isinstance(modules.get(n.rsplit(".", 1)[0]), torch.nn.Linear)
            and modules[n.rsplit(".", 1)[0]] is not head
        }
    )
    if not linear:
        raise AttnkitError("--lora-rank: none of the tensors to train belongs to a Linear module")
    direct = [model.get_parameter(n) for n in names if n.rsplit(".", 1)[0] not in linear]
    with torch.random.fork_rng():  # the caller's random streams (CPU and CUDA) left as they were
        torch.manual_seed(seed)
        wrapped = get_peft_model(
            model, LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, bias="none", target_modules=linear)
        )
    for p in direct:
        p.requires_grad_(True)
    return wrapped


def merge_lora(model):
    """The base model with the LoRA updates merged into its weights (same architecture, same names)."""
    return model.merge_and_unload()
