"""The teacher's targets computed once (`heal --teacher-logits top-k`): per position its top-k log-probabilities,
their token ids and the log of the probability mass left over, cached on disk, so training steps run the student
only and the teacher leaves memory before training.

Storage per token: k ids (uint16 when the vocabulary has at most 65,536 tokens, else int32), k fp16
log-probabilities and one fp32 tail: 4k + 4 bytes (260 at k = 64) or 6k + 4. The loss is the KL between the
two distributions coarsened to those k tokens plus one bucket for the rest (a lower bound of the full KL that
ignores how the rest is spread): sum_S p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from attnkit.io.tempdirs import atomic_file
from attnkit.progress import phase

#: Top-k kept when --top-k is not given.
DEFAULT_K = 64
#: Log of a probability mass that rounds to nothing (the tail of a distribution whose top k hold it all).
FLOOR = -60.0


@dataclass
class Targets:
    """ids [N, T, k] (uint16 or int32), logp [N, T, k] fp16, tail [N, T] fp32: log of the mass outside the k."""

    ids: object
    logp: object
    tail: object

    def rows(self, index) -> Targets:
        return Targets(self.ids[index], self.logp[index], self.tail[index])

    def window_prefix(self) -> Targets:
        """The targets of the positions that predict a next token (all but each window's last)."""
        return Targets(self.ids[:, :-1], self.logp[:, :-1], self.tail[:, :-1])

    @property
    def bytes_per_token(self) -> int:
        k = self.ids.shape[-1]
        return k * (self.ids.element_size() + self.logp.element_size()) + self.tail.element_size()


def teacher_targets(teacher, windows, k: int, batch_size: int, device) -> Targets:
    """The teacher's top-k targets for windows [N, T] (every position; the last one predicts nothing and is
    never used)."""
    import torch

    ids, logp, tail = [], [], []
    vocab = None
    with torch.no_grad(), phase("teacher's top-k targets", windows.shape[0], "windows") as advance:
        for batch in windows.split(batch_size):
            logits = teacher(input_ids=batch.to(device), use_cache=False).logits.float()  # [B, T, V]
            vocab = logits.shape[-1]
            lp = logits.log_softmax(-1)
            top, idx = lp.topk(k, dim=-1)  # [B, T, k]
            kept = top.logsumexp(-1)  # [B, T]: log of the mass in the top k
            rest = torch.log(-torch.expm1(kept.clamp(max=-1e-7))).clamp_min(FLOOR)  # log(1 - that mass)
            ids.append(idx.cpu())
            logp.append(top.half().cpu())
            tail.append(rest.cpu())
            advance(batch.shape[0])
    index_type = torch.int32 if vocab > 65536 else torch.uint16
    return Targets(torch.cat(ids).to(index_type), torch.cat(logp), torch.cat(tail))


def topk_kl(student_logits, targets: Targets):
    """Mean over positions of the coarsened KL(teacher || student). student_logits [B, T, V] and targets of the
    same positions ([B, T, k], [B, T])."""
    import torch

    lq = student_logits.float().log_softmax(-1)  # [B, T, V]
    ids = targets.ids.to(lq.device).long()
    lp = targets.logp.to(lq.device).float()  # [B, T, k]
    tail = targets.tail.to(lq.device).float()  # [B, T]
    lq_top = lq.gather(-1, ids)  # [B, T, k]
    lq_rest = torch.log(-torch.expm1(lq_top.logsumexp(-1).clamp(max=-1e-7))).clamp_min(FLOOR)  # [B, T]
    kl = (lp.exp() * (lp - lq_top)).sum(-1) + tail.exp() * (tail - lq_rest)  # [B, T]
    return kl.mean()


def cache_file(root: Path, teacher_digest: str, windows, k: int) -> Path:
    """Where the targets of these windows by this teacher are kept: keyed by the teacher, the windows' tokens
    and k."""
    import torch

    digest = hashlib.sha256()
    digest.update(json.dumps({"teacher": teacher_digest, "k": k, "shape": list(windows.shape)}).encode())
    digest.update(windows.to(torch.int64).numpy().tobytes())
    return root / "teacher-topk" / f"{digest.hexdigest()[:24]}.safetensors"


def load_or_compute(path: Path, compute) -> Targets:
    """The targets at `path`, or compute() them and write them there, whole or not at all
    (attnkit.io.tempdirs.atomic_file)."""
    from safetensors.torch import load_file, save_file

    if path.is_file():
        found = load_file(str(path))
        return Targets(found["ids"], found["logp"], found["tail"])
    targets = compute()
    with atomic_file(path) as tmp:
        save_file({"ids": targets.ids, "logp": targets.logp, "tail": targets.tail}, str(tmp))
    return targets
