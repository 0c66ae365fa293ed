"""The distillation loss: KL(teacher || student) on next-token distributions, plus (optionally) how far each
rewritten attention block's output is from the teacher's."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from attnkit.runtime.calibrate import OutputCapture


def kl_to_teacher(student_logits, teacher_logits):
    """Mean over positions of KL(p_teacher || p_student), in fp32. logits [B, T, V] -> scalar."""
    import torch.nn.functional as F

    s = student_logits.float().log_softmax(-1)  # [B, T, V]
    t = teacher_logits.float().log_softmax(-1)
    return F.kl_div(s, t, log_target=True, reduction="sum") / (s.shape[0] * s.shape[1])


def attention_mismatch(student: dict, teacher: dict):
    """Mean over layers of ||a_s - a_t||^2 / ||a_t||^2 for the attention outputs [B, T, d] of one forward pass
    (OutputCapture.take(): one output per layer)."""
    terms = [
        (student[k][-1].float() - teacher[k][-1].float()).pow(2).sum()
        / teacher[k][-1].float().pow(2).sum().clamp_min(1e-12)
        for k in teacher
    ]
    return sum(terms) / len(terms)


@contextlib.contextmanager
def attention_capture(pairs: dict) -> Iterator[tuple | None]:
    """(student capture, teacher capture) of the attention outputs of {name: (student module, teacher module)};
    None when pairs is empty."""
    if not pairs:
        yield None
        return
    with (
        OutputCapture({k: s for k, (s, _t) in pairs.items()}) as student,
        OutputCapture({k: t for k, (_s, t) in pairs.items()}) as teacher,
    ):
        yield student, teacher


def distill_loss(student, teacher, ids, attn_weight: float = 0.0, capture=None) -> tuple:
    """(loss, KL, attention term or None) of the student against the teacher on ids [B, T]."""
    import torch

    with torch.no_grad():
        teacher_logits = teacher(input_ids=ids, use_cache=False).logits  # [B, T, V]
    student_logits = student(input_ids=ids, use_cache=False).logits  # [B, T, V]
    kl = kl_to_teacher(student_logits, teacher_logits)
    if capture is None:
        return kl, kl, None
    s_hooks, t_hooks = capture
    attn = attention_mismatch(s_hooks.take(), t_hooks.take())
    return kl + attn_weight * attn, kl, attn
