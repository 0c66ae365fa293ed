"""What heal trains and scores on: the data plan. With --data, training and validation windows are cut from the
files before any model loads; without it, the plan names the cache of teacher-written text, which the loaded
teacher fills (`teacher_windows`), under a --max-time budget for at most half of it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from attnkit.commands.heal.data import DataFiles, files_digest, split_windows
from attnkit.commands.heal.request import HealRequest
from attnkit.commands.heal.retrieval import mix_retrieval
from attnkit.commands.heal.samples import cache_folder, teacher_documents
from attnkit.io.gguf_load import cache_root
from attnkit.progress import phase
from attnkit.runtime import make_windows
from attnkit.runtime.loader import load_tokenizer
from attnkit.runtime.texts import text_prefix, token_windows

#: Share of a --max-time budget that writing teacher text may take before training starts.
SAMPLING_SHARE = 0.5


@dataclass
class DataPlan:
    """The teacher's tokenizer; the --eval windows [N, --eval-seq-len] (None without --eval text); training and
    validation windows [n, --seq-len] (None until the teacher has written them when no --data is given);
    `samples`: the teacher-text cache folder (None with --data); `digest` identifies the data for a --resume;
    `info` is the report's "data" entry."""

    tokenizer: object
    eval: object | None
    digest: str
    info: dict
    train: object | None = None
    val: object | None = None
    samples: Path | None = None


def plan_data(req: HealRequest, pair) -> DataPlan:
    """Tokenized --data split into training and validation windows, or the plan for teacher-written text."""

    tokenizer = load_tokenizer(pair.teacher.root)
    evaluation = req.scoring.windows(tokenizer) if req.scoring.files else None
    if req.data:
        budget = req.budget_tokens  # tokenize no more of the files than training and validation use
        limit = None if budget is None else (budget + req.val_tokens) // req.seq_len * req.seq_len + req.seq_len
        windows = make_windows(tokenizer, DataFiles(tuple(req.data)), req.seq_len, limit)
        train, val = split_windows(windows, req.val_tokens)
        train, retrieval = _with_retrieval(req, train, tokenizer)
        digest = files_digest(req.data)
        info = {
            "source": "files",
            "files": list(req.data),
            "sha256": digest,
            "train_tokens": int(train.numel()),
            "validation_tokens": int(val.numel()),
            "retrieval": retrieval,
        }
        return DataPlan(tokenizer, evaluation, digest, info, train, val)

    root = Path(req.sample_cache).expanduser() if req.sample_cache else cache_root()
    samples = cache_folder(root, pair.teacher.digest, req.seed, req.seq_len)
    info = {
        "source": "teacher samples",
        "cache": str(samples),
        "seed": req.seed,
        "tokens_requested": req.samples_needed,
    }
    return DataPlan(tokenizer, evaluation, f"{samples.name}:{req.samples_needed}", info, samples=samples)


def teacher_windows(run, teacher) -> None:
    """Training and validation windows from teacher-written text (cached; generated where missing), into the
    run's plan. `run`: attnkit.commands.heal.run.HealRun."""

    req, plan, acc = run.req, run.plan, run.acc
    need = req.samples_needed + req.val_tokens
    run.log(f"teacher-written training text: {need:,} tokens, cached in {plan.samples}")
    with phase("teacher writes its training text", need if acc.is_main_process else 0, "tokens") as advance:
        docs, info = teacher_documents(
            teacher,
            plan.tokenizer,
            need,
            req.seq_len,
            req.seed,
            plan.samples,
            rank=acc.process_index,
            world=acc.num_processes,
            barrier=acc.wait_for_everyone,
            progress=advance,
            enough=_sampling_deadline(run),
        )
    if info["cut_short"]:
        run.log(f"teacher-written text cut at {info['tokens']:,} tokens: --max-time leaves the rest to training")
    tokenizer = plan.tokenizer
    windows, _ = token_windows(
        ((doc, True) for doc in docs), text_prefix(tokenizer), tokenizer.eos_token_id, req.seq_len
    )
    train, plan.val = split_windows(windows, req.val_tokens)
    plan.train, retrieval = _with_retrieval(req, train, tokenizer)
    plan.info.update(
        info, train_tokens=int(plan.train.numel()), validation_tokens=int(plan.val.numel()), retrieval=retrieval
    )


def _with_retrieval(req: HealRequest, train, tokenizer) -> tuple:
    """(training windows with --retrieval-mix's share made retrieval tasks, the report's entry; None without it).
    Validation windows stay as the data has them: validation measures the text the model will serve."""
    if req.retrieval_mix is None:
        return train, None
    return mix_retrieval(train, tokenizer, req.retrieval_mix, req.seed)


def _sampling_deadline(run):
    """With --max-time: the `enough` test of teacher_documents. Once SAMPLING_SHARE of the budget is spent and
    the text holds the validation tokens and one global batch, no new batch is written (cached ones are still
    read); the processes agree through one all-reduce."""
    req, acc = run.req, run.acc
    if req.max_time is None:
        return None
    import torch

    minimum = req.val_tokens + req.batch_size * req.seq_len

    def enough(tokens: int, must_write: bool) -> bool:
        late = time.perf_counter() >= run.started + SAMPLING_SHARE * req.max_time
        flag = torch.tensor([float(late and must_write and tokens >= minimum)], device=acc.device)
        return bool(acc.reduce(flag, reduction="sum")[0] > 0)

    return enough
