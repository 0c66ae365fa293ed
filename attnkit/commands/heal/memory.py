"""heal's memory plan: what one process must hold, from the checkpoints' shapes alone (nothing loaded), and the
options that would make a plan that does not fit the device fit.

Both models train in fp32 (4 bytes a value): teacher and student weights; the trained values' gradients and
AdamW's two moments; per micro-batch the student's activations kept for the backward pass (per token and layer:
what one layer of the student's own code saves, counted on the meta device by attnkit.commands.heal.activations,
or where that cannot run an estimate of 6 h + 4 i values: the norms' inputs and outputs, the rotated query, the
attention output, the MLP's four intermediates; with gradient checkpointing only each layer's input, plus one
layer's activations while it is recomputed) and the logits (LOGIT_BUFFERS x vocabulary values per token: the
teacher's, the student's and what the loss and its backward pass hold beside them); and RUNTIME for the
interpreter, torch and the data. Where the student's attention runs eager math (see `keeps_scores`) every layer
also keeps its attention probabilities, heads x T^2 values per window, plus SCORE_BUFFERS more of them in
flight in the layer being computed: the term that grows fastest with the window. With `--teacher-logits top-k`
the teacher is not in memory while the student trains (its targets are computed first, then it is freed): the
peak is the larger of training without the teacher (logits: TOPK_LOGIT_BUFFERS x vocabulary values per token)
and the teacher's pass (its weights and 2 x vocabulary values per token).
Estimates; docs/heal.md compares them with measured peaks.
"""

from __future__ import annotations

from dataclasses import dataclass

from attnkit.commands.heal.request import processes
from attnkit.runtime.loader import free_memory
from attnkit.units import human_bytes

BYTES = 4  # fp32
#: Share of the device's free memory a plan may use (allocator slack, fragmentation, the interpreter).
HEADROOM = 0.9
#: The interpreter, torch, transformers, the tokenized data and allocator slack (torch and transformers alone:
#: ~170 MiB anonymous memory on CPU).
RUNTIME = 512 << 20
#: Attention-probability-sized buffers in flight beside the kept ones in the layer running (scores, the mask made
#: additive, the softmax output and their gradients), where the kernel is not fused.
SCORE_BUFFERS = 3
#: [T, V] buffers at the loss's peak, live teacher: its logits, then the student's, both log-softmaxes, the KL's
#: terms and the gradients of the backward pass (measured: six beside the teacher's logits).
LOGIT_BUFFERS = 7
#: The same with --teacher-logits top-k: the student's logits, their log-softmax and its gradient.
TOPK_LOGIT_BUFFERS = 3
#: LoRA rank the refusal suggests.
SUGGESTED_LORA = 16


@dataclass(frozen=True)
class Shapes:
    """What the plan needs to know of the pair."""

    teacher_params: int
    student_params: int
    trainable: list[tuple[int, ...]]  # shapes of the tensors that train
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    heads: int = 1
    eager: bool = False  # soft-capped: eager math on every device
    saved_per_token: int | None = None  # bytes one layer keeps per token (activations.per_token); None: estimate


def keeps_scores(s: Shapes) -> bool:
    """Whether the student's attention materializes its probabilities [B, H, T, T] (and keeps them for the
    backward pass): eager attention (soft-capped models). SDPA is fused on every device, MLA's narrower values
    included (attnkit.runtime.padded_attention pads them on the CPU)."""
    return s.eager


def _attention_layout(spec) -> dict:
    """Shapes' attention fields from the student's AttentionSpec (None: a family outside the registry)."""
    if spec is None:
        return {}
    return {"heads": spec.num_heads, "eager": spec.attn_softcap is not None}


def shapes_of(pair, trained: list[str]) -> Shapes:
    """Shapes from the checkpoints' headers and the student's config; `trained`: the names that train."""
    from attnkit.commands.heal.activations import per_token
    from attnkit.io.reader import LazyReader

    def params(source) -> tuple[int, dict]:
        with LazyReader(source.ckpt.weight_files) as reader:
            found = {n: tuple(reader.info(n).shape) for n in reader.names()}
        return sum(_numel(s) for s in found.values()), found

    teacher, _ = params(pair.teacher)
    student, layout = params(pair.student)
    c = pair.student.config
    return Shapes(
        teacher_params=teacher,
        student_params=student,
        trainable=[layout[n] for n in trained if n in layout],
        layers=int(c.get("num_hidden_layers", 1)),
        hidden=int(c.get("hidden_size", 1)),
        intermediate=int(c.get("intermediate_size") or 4 * c.get("hidden_size", 1)),
        vocab=int(c.get("vocab_size", 1)),
        **_attention_layout(pair.student.spec),
        saved_per_token=per_token(c),
    )


def _layer_values(s: Shapes) -> int:
    """Values one layer keeps per token: counted (saved_per_token) or estimated."""
    if s.saved_per_token is not None:
        return -(-s.saved_per_token // BYTES)
    return 6 * s.hidden + 4 * s.intermediate


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def plan(
    s: Shapes,
    micro_batch: int,
    seq_len: int,
    lora_rank: int,
    checkpointing: bool,
    copies: int = 1,
    live_teacher: bool = True,
    shards: int = 1,
    scores: bool = False,
    autocast: bool = False,
) -> dict:
    """{item: bytes} and the total, for `copies` processes sharing the device's memory (one per GPU; on a CPU
    every process of the run); `live_teacher` False: --teacher-logits top-k; `shards`: --fsdp's processes (each
    holds 1/shards of the student, its gradients and optimizer state, plus one layer gathered whole); `scores`:
    the attention keeps its probabilities (keeps_scores); `autocast`: bf16 autocast, which keeps a bf16 copy of
    each trained tensor while a micro-batch runs (the counted fp32 activations stay an upper bound)."""
    if lora_rank:  # adapters on the 2-D weights (rank x (in + out)), the rest trains directly
        trained = sum(lora_rank * (s_[0] + s_[1]) if len(s_) == 2 else _numel(s_) for s_ in s.trainable)
    else:
        trained = sum(_numel(s_) for s_ in s.trainable)
    tokens = micro_batch * seq_len
    per_layer = _layer_values(s) * tokens  # values one layer keeps for the backward pass
    if checkpointing:
        activations = s.layers * s.hidden * tokens + per_layer
    else:
        activations = s.layers * per_layer
    kept_layers = 1 if checkpointing else s.layers  # layers whose probabilities wait for the backward pass
    attention = (kept_layers + SCORE_BUFFERS) * micro_batch * s.heads * seq_len * seq_len if scores else 0
    items = {
        "teacher": s.teacher_params if live_teacher else 0,
        "student": (s.student_params + (trained if lora_rank else 0)) // shards
        + (s.student_params // s.layers if shards > 1 else 0),
        "gradients": trained // shards,
        "optimizer": 2 * trained // shards,
        "autocast_copies": trained // shards // 2 if autocast else 0,  # bf16: half an fp32 value each
        "activations": activations,
        "attention": attention,
        "logits": (LOGIT_BUFFERS if live_teacher else TOPK_LOGIT_BUFFERS) * tokens * s.vocab,
    }
    items = {k: v * BYTES * copies for k, v in items.items()} | {"runtime": RUNTIME * copies}
    total = sum(items.values())
    if not live_teacher:  # the pass that computes the targets holds the teacher alone
        total = max(total, (s.teacher_params + 2 * tokens * s.vocab) * BYTES * copies + RUNTIME * copies)
    return {"items": items, "total": total, "trained_values": trained}


def memory_report(s: Shapes, req, device, autocast: bool = False) -> dict:
    """The plan for the request on `device` (`autocast`: bf16, heal.models.precision_for): items, total, what is
    free, whether it fits, and what would fit."""
    copies = processes() if device.type == "cpu" else 1
    live, shards = req.teacher_logits == "live", processes() if req.fsdp else 1
    scores = keeps_scores(s)
    chosen = plan(
        s,
        req.micro_batch_size,
        req.seq_len,
        req.lora_rank,
        req.gradient_checkpointing,
        copies,
        live,
        shards,
        scores,
        autocast,
    )
    free = free_memory(device)
    fits = free is None or chosen["total"] <= HEADROOM * free
    return {
        "device": str(device),
        **chosen,
        "available": free,
        "fits": fits,
        "fitting_options": [] if fits else _fitting(s, req, HEADROOM * free, copies, shards, scores, autocast),
        "attention_kernel": "eager (soft-capped)" if scores else "fused",
        "activations_per_token_layer": _layer_values(s) * BYTES,
        "activations_counted": "estimate" if s.saved_per_token is None else "one layer run on the meta device",
    }


def _fitting(s: Shapes, req, budget: float, copies: int, shards: int, scores: bool, autocast: bool) -> list[dict]:
    """The smallest changes of the request that fit `budget`, each with its total: one option, then pairs."""
    choices = []
    if req.micro_batch_size > 1:
        choices.append(("--micro-batch-size 1", {"micro_batch": 1}))
    if not req.gradient_checkpointing:
        choices.append(("--gradient-checkpointing", {"checkpointing": True}))
    if not req.lora_rank:
        choices.append((f"--lora-rank {SUGGESTED_LORA}", {"lora_rank": SUGGESTED_LORA}))
    if req.teacher_logits == "live":
        choices.append(("--teacher-logits top-k", {"live": False}))
    base = {
        "micro_batch": req.micro_batch_size,
        "lora_rank": req.lora_rank,
        "checkpointing": req.gradient_checkpointing,
        "live": req.teacher_logits == "live",
    }
    found = []
    for size in (1, 2, 3):
        for combo in _combinations(choices, size):
            settings = {**base}
            for _, change in combo:
                settings.update(change)
            total = plan(
                s,
                settings["micro_batch"],
                req.seq_len,
                settings["lora_rank"],
                settings["checkpointing"],
                copies,
                settings["live"],
                shards,
                scores,
                autocast,
            )
            if total["total"] <= budget:
                found.append({"options": " ".join(name for name, _ in combo), "total": total["total"]})
        if found:
            return found
    return found


def _combinations(items: list, size: int) -> list[tuple]:
    from itertools import combinations

    return list(combinations(items, size))


def refusal(report: dict) -> str:
    """The one line a plan that does not fit is refused with."""
    parts = ", ".join(f"{k} {human_bytes(v)}" for k, v in report["items"].items())
    line = (
        f"heal needs about {human_bytes(report['total'])} on {report['device']} ({parts}) and "
        f"{human_bytes(report['available'])} is free"
    )
    if report["fitting_options"]:
        options = "; ".join(f"{o['options']} (about {human_bytes(o['total'])})" for o in report["fitting_options"])
        return f"{line}: it would fit with {options}"
    return f"{line}, and no change of micro-batch, gradient checkpointing, LoRA or teacher logits makes it fit"
