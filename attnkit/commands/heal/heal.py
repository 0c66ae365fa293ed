"""`attnkit heal STUDENT OUT --teacher SOURCE`: the orchestrator.

Flow: check options and paths -> check that the student is a rewrite of the teacher (configs, tokenizers,
copied weights) -> check OUT, the checkpoint folder and a --resume fingerprint -> read and tokenize the
data -> (nothing loaded until here) load both models -> teacher-written data when no --data -> choose
what trains -> score --eval text before -> train -> merge LoRA -> write OUT (score it after, manifest)
-> remove the checkpoint folder. A failure before the end writes nothing to OUT.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path

from attnkit.commands.analyse.capability import before_after, check_capability, run_capability
from attnkit.commands.analyse.evaluate import evaluate
from attnkit.commands.heal import resume, topk, trainable
from attnkit.commands.heal.bar import training_bar
from attnkit.commands.heal.data import DataFiles, files_digest, split_windows
from attnkit.commands.heal.loop import LoopConfig, LoopState, Trainer
from attnkit.commands.heal.memory import memory_report, refusal, shapes_of
from attnkit.commands.heal.output import check_names, healed_tensors, stored_layout
from attnkit.commands.heal.pair import check_pair, rewrite_summary
from attnkit.commands.heal.request import HealRequest, check_options, processes
from attnkit.commands.heal.resume import check_fingerprint
from attnkit.commands.heal.samples import cache_folder, teacher_documents
from attnkit.commands.heal.trainable import default_lr
from attnkit.commands.rewrite import check_write
from attnkit.commands.write import write_checkpoint
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.gguf_load import cache_root
from attnkit.progress import phase
from attnkit.runtime import load_model, make_windows, read_texts
from attnkit.runtime.loader import LoadedModel, load_tokenizer, resolve_device
from attnkit.runtime.texts import text_prefix, token_windows


def heal(req: HealRequest, log: Callable[[str], None] = lambda message: None) -> dict | None:
    """Run (or with dry_run, plan) a healing run; returns the report (see docs/heal.md), or None in the
    processes other than the main one of a multi-process run."""

    started = time.perf_counter()
    check_options(req)
    _check_device(req.device)
    check_write(req, inputs=[req.model, req.teacher])
    check_capability(req.capability, [req.model, req.teacher])
    _check_checkpoint_folder(req)
    pair = check_pair(req.model, req.teacher, rewritten=req.train != "all")
    if req.lr is None:
        req = dataclasses.replace(req, lr=default_lr(pair.student.config))
    memory = memory_report(shapes_of(pair, pair.trained), req, resolve_device(req.device))
    if not memory["fits"]:
        raise AttnkitError(refusal(memory))
    plan = _plan_data(req, pair)
    fingerprint = _fingerprint(req, pair.student.digest, pair.teacher.digest, plan["digest"])
    run = None
    if req.resume:
        run = check_fingerprint(req.checkpoint_folder, fingerprint)
    report = {
        "student": req.model,
        "teacher": req.teacher,
        "output": str(req.out),
        "dry_run": req.dry_run,
        "rewrite": rewrite_summary(pair.manifest),
        "data": plan["info"],
        "budget": _budget(req),
        "settings": _settings(req),
        "seed": req.seed,
        "checkpoint": str(req.checkpoint_folder),
        "resumed_from_step": run["state"]["step"] if run else None,
        "memory": memory,
    }
    if req.dry_run:
        report["seconds"] = time.perf_counter() - started
        return report
    return _train_and_write(req, pair, plan, fingerprint, run, report, started, log)


def _check_device(device: str) -> None:
    """--device takes what every command takes; cuda:N picks the GPU of a single process only."""
    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is not None and processes() > 1:
        raise UsageError(
            f"--device {device} names one GPU; the processes of a multi-process run take one each: use --device cuda"
        )


def _check_checkpoint_folder(req: HealRequest) -> None:
    """The checkpoint folder is ours to use: absent, empty, or (--resume, --overwrite) an earlier run's."""
    folder = req.checkpoint_folder
    if folder.is_dir() and any(folder.iterdir()):
        if not (folder / "run.json").is_file():
            raise AttnkitError(f"{folder}: exists and is not a heal checkpoint; choose another --checkpoint-dir")
        if not req.resume and not req.overwrite:
            raise AttnkitError(
                f"{folder}: holds the checkpoint of an earlier run; pass --resume to continue it "
                "or --overwrite to start again"
            )


def _plan_data(req: HealRequest, pair) -> dict:
    """Tokenized --data split into training and validation windows, or the plan for teacher-written text."""

    tokenizer = load_tokenizer(pair.teacher.root)
    plan = {"tokenizer": tokenizer, "eval": None}
    if req.eval:
        plan["eval"] = make_windows(tokenizer, read_texts(req.eval), req.eval_seq_len, req.eval_tokens)
    if req.data:
        budget = req.budget_tokens  # tokenize no more of the files than training and validation use
        limit = None if budget is None else (budget + req.val_tokens) // req.seq_len * req.seq_len + req.seq_len
        windows = make_windows(tokenizer, DataFiles(tuple(req.data)), req.seq_len, limit)
        plan["train"], plan["val"] = split_windows(windows, req.val_tokens)
        plan["digest"] = files_digest(req.data)
        plan["info"] = {
            "source": "files",
            "files": list(req.data),
            "sha256": plan["digest"],
            "train_tokens": int(plan["train"].numel()),
            "validation_tokens": int(plan["val"].numel()),
        }
        return plan

    root = Path(req.sample_cache).expanduser() if req.sample_cache else cache_root()
    plan["samples"] = cache_folder(root, pair.teacher.digest, req.seed, req.seq_len)
    plan["digest"] = f"{plan['samples'].name}:{req.samples_needed}"
    plan["info"] = {
        "source": "teacher samples",
        "cache": str(plan["samples"]),
        "seed": req.seed,
        "tokens_requested": req.samples_needed,
    }
    return plan


def _fingerprint(req: HealRequest, student: str, teacher: str, data: str) -> dict:
    """What a resumed run must share with the checkpoint (the budget, evaluation and devices may change)."""
    return {
        "student": student,
        "teacher": teacher,
        "data": data,
        "seq_len": req.seq_len,
        "batch_size": req.batch_size,
        "train": req.train,
        "lora_rank": req.lora_rank,
        "lr": req.lr,
        "warmup_steps": req.warmup_steps,
        "min_lr_ratio": req.min_lr_ratio,
        "weight_decay": req.weight_decay,
        "max_grad_norm": req.max_grad_norm,
        "attn_loss": req.attn_loss,
        "teacher_logits": req.teacher_logits,
        "top_k": req.top_k,
        "val_tokens": req.val_tokens,
        "seed": req.seed,
    }


def _budget(req: HealRequest) -> dict:
    """tokens: training tokens; max_time_seconds: the whole command's time (loading, data, training, scoring)."""
    return {"tokens": req.budget_tokens, "max_time_seconds": req.max_time}


def _settings(req: HealRequest) -> dict:
    keys = (
        "train",
        "lora_rank",
        "lr",
        "warmup_steps",
        "min_lr_ratio",
        "weight_decay",
        "max_grad_norm",
        "batch_size",
        "micro_batch_size",
        "seq_len",
        "attn_loss",
        "teacher_logits",
        "top_k",
        "val_tokens",
        "eval_every",
        "patience",
        "checkpoint_every",
        "gradient_checkpointing",
        "fsdp",
        "eval_curve",
    )
    return {k: getattr(req, k) for k in keys}


def accelerator_for(device: str):
    """accelerate's Accelerator on --device (resolved as every command does): a CUDA GPU trains with bf16
    autocast (cuda:N chooses it), MPS and the CPU in fp32."""
    import torch
    from accelerate import Accelerator

    dev = resolve_device(device)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev.index)
    return Accelerator(cpu=dev.type == "cpu", mixed_precision="bf16" if dev.type == "cuda" else "no")


def _train_and_write(req, pair, plan, fingerprint, run, report, started, log) -> dict | None:
    """Load both models, train, and (main process) write OUT; returns the report (None elsewhere)."""
    acc = accelerator_for(req.device)
    log = log if acc.is_main_process else (lambda message: None)
    teacher, student = _load_models(acc, pair, log)
    if "train" not in plan:
        _teacher_windows(req, plan, teacher, acc, log, started)
    before = _score(student, teacher, plan["eval"]) if acc.is_main_process and plan["eval"] is not None else None
    abilities = None
    if acc.is_main_process and req.capability:
        log("scoring teacher and student: tasks and pass keys")
        abilities = {name: _capability(req, m, plan, acc) for name, m in (("teacher", teacher), ("before", student))}
    names = trainable.select(student, teacher, req.train)
    pairs = trainable.attention_pairs(student, teacher, names)
    targets = None
    if req.teacher_logits == "top-k":  # the teacher's targets once, then it leaves memory before training
        targets = _teacher_targets(req, pair, plan, teacher, acc, log)
        report["teacher_targets"] = {"k": req.top_k, "bytes_per_token": targets[0].bytes_per_token}
        teacher = None
        _free_memory()
    trainer = _trainer(req, acc, student, teacher, plan, run, report, before, log, started, (names, pairs, targets))

    def save() -> None:
        state = trainer.state_dict() if acc.is_main_process or req.fsdp else None  # --fsdp: gathered by all
        if acc.is_main_process:
            resume.save(req.checkpoint_folder, {"fingerprint": fingerprint, "state": trainer.state.to_dict()}, state)
        acc.wait_for_everyone()

    unit = "tokens" if req.budget_tokens else "seconds"
    done = trainer.state.tokens if unit == "tokens" else trainer.state.seconds
    with training_bar(
        req.budget_tokens or req.max_time, unit, done, trainer.state.tokens, enabled=acc.is_main_process
    ) as advance:
        state = trainer.run(save, advance)
    report.update(_summary(trainer, acc, state))
    report["training"]["teacher_logits"] = "live" if targets is None else f"top-{req.top_k}"
    report["warnings"] = _warnings(req, state)
    trained = trainer.tensors() if req.fsdp else None  # gathered from the shards by every process
    if not acc.is_main_process:
        return None
    log(f"writing {req.out}")
    if teacher is None and before is not None:  # top-k: the teacher comes back to score the result
        teacher, _ = _load_models(acc, pair, log, student=False)
    _write(req, pair, acc, _trained_model(trainer, req, pair, trained, names), teacher, plan, before, abilities, report)
    report["seconds"] = time.perf_counter() - started
    return report


def _load_models(acc, pair, log, student: bool = True) -> tuple:
    """(teacher, student or None) in fp32 on the process's device; the teacher frozen, the student's names
    checked."""

    log(f"loading the teacher{' and the student' if student else ''} on {acc.device} ({acc.num_processes} process(es))")
    teacher = load_model(str(pair.teacher.root), device=str(acc.device), dtype="float32").model
    for p in teacher.parameters():
        p.requires_grad_(False)
    if not student:
        return teacher, None
    model = load_model(str(pair.student.root), device=str(acc.device), dtype="float32").model
    check_names(model, stored_layout(pair.student.ckpt))
    return teacher, model


def _teacher_targets(req, pair, plan, teacher, acc, log) -> tuple:
    """(training, validation) top-k targets of the teacher (attnkit.commands.heal.topk), cached on disk: the main
    process computes what is missing, every process reads the file."""
    root = Path(req.sample_cache).expanduser() if req.sample_cache else cache_root()
    found = []
    for windows in (plan["train"], plan["val"]):
        path = topk.cache_file(root, pair.teacher.digest, windows, req.top_k)
        if acc.is_main_process:
            if not path.is_file():
                log(f"teacher's top-{req.top_k} targets for {windows.numel():,} tokens, cached in {path.parent}")
            topk.load_or_compute(
                path, lambda w=windows: topk.teacher_targets(teacher, w, req.top_k, req.micro_batch_size, acc.device)
            )
        acc.wait_for_everyone()
        found.append(topk.load_or_compute(path, lambda: None))
    return found[0], found[1]


def _free_memory() -> None:
    """Hand the teacher's memory back (the garbage collector, then the C heap)."""
    import gc

    from attnkit.runtime.streaming import trim_heap

    gc.collect()
    trim_heap()


def _trainer(req, acc, student, teacher, plan, run, report, before, log, started: float, chosen: tuple):
    """The Trainer: what trains (report["trainable"]), LoRA and gradient checkpointing, a resumed state, logs;
    a --max-time budget is a deadline `started` + max_time for the whole command. `chosen`: (the trained
    names, attention pairs, the teacher's top-k targets or None; the teacher is then None)."""

    names, pairs, targets = chosen
    report["trainable"] = {
        "mode": req.train,
        "lora_rank": req.lora_rank or None,
        "tensors": len(names),
        "parameters": sum(student.get_parameter(n).numel() for n in names),
        "names": names,
    }
    log(
        f"training {len(names)} tensors ({report['trainable']['parameters']:,} parameters)"
        + (f" through LoRA rank {req.lora_rank}" if req.lora_rank else "")
    )
    if req.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = trainable.add_lora(student, names, req.lora_rank, req.seed) if req.lora_rank else student
    cfg = LoopConfig(
        lr=req.lr,
        warmup_steps=req.warmup_steps,
        min_lr_ratio=req.min_lr_ratio,
        weight_decay=req.weight_decay,
        max_grad_norm=req.max_grad_norm,
        batch_size=req.batch_size,
        micro_batch_size=req.micro_batch_size,
        attn_loss=req.attn_loss,
        budget_tokens=req.budget_tokens,
        max_time=req.max_time,
        eval_every=req.eval_every,
        patience=req.patience,
        checkpoint_every=req.checkpoint_every,
        seed=req.seed,
        deadline=None if req.max_time is None else started + req.max_time,
        started=started,
        after_training=_after_training(plan),
        fsdp=req.fsdp,
    )
    trainer = Trainer(
        acc,
        model,
        teacher,
        plan["train"],
        plan["val"],
        cfg,
        pairs,
        LoopState(**run["state"]) if run else None,
        lr_scales=trainable.lr_scales(student),
        targets=targets,
    )
    if run:
        trainer.load_state_dict(resume.load_state(req.checkpoint_folder))
        log(f"resumed at step {trainer.state.step} ({trainer.state.tokens:,} tokens)")
    if req.eval_curve:  # step 0 is the student as loaded: its scores are `before`
        trainer.monitor = lambda m: {
            f"eval_{k}": v
            for k, v in ((before or {}) if trainer.state.step == 0 else _score(m, teacher, plan["eval"])).items()
            if k in ("perplexity", "kl_mean")
        }
    trainer.on_validation = lambda e: log(
        f"step {e['step']}: {e['tokens']:,} tokens, {e['seconds']:.0f}s; "
        f"validation KL {e['kl_mean']:.4f}, perplexity {e['perplexity']:.3f}"
    )
    return trainer


#: The writing of OUT, in validations (a margin: it is mostly I/O).
WRITE_COST = 0.25


def _after_training(plan: dict) -> float:
    """What runs after training, in units of one validation (student and teacher over the validation windows):
    the last validation, the --eval scoring of the healed student (the same per-token cost) and the write."""
    scoring = 0.0 if plan["eval"] is None else plan["eval"].numel() / max(plan["val"].numel(), 1)
    return 1.0 + scoring + WRITE_COST


def _warnings(req: HealRequest, state) -> list[str]:
    """What the user must hear about the result: no step ran, or validation never improved on the student."""
    if state.step == 0:
        return [f"no training step ran within --max-time {req.max_time:g}s: {req.out} is the student unchanged"]
    if state.best["step"] == 0:
        first = state.validation[0]["kl_mean"]
        later = min(v["kl_mean"] for v in state.validation[1:]) if len(state.validation) > 1 else first
        return [
            f"validation KL never improved on the student's ({first:.4g}; the best after a step: {later:.4g}): "
            f"{req.out} is the student unchanged; try a lower --lr or more data"
        ]
    return []


def _trained_model(trainer, req: HealRequest, pair, trained: dict | None, names: list[str]):
    """The student with its trained tensors (LoRA adapters merged in), outside DDP; with --fsdp (`trained`: the
    gathered tensors) the student loaded again, unsharded, given the same adapters (`names`: the tensors chosen
    to train), with them."""
    if trained is not None:
        trainer.model = None
        _free_memory()
        model = load_model(str(pair.student.root), device=str(trainer.acc.device), dtype="float32").model
        if req.lora_rank:
            model = trainable.add_lora(model, names, req.lora_rank, req.seed)
        for name, tensor in trained.items():
            model.get_parameter(name).data.copy_(tensor)
    else:
        model = trainer.acc.unwrap_model(trainer.model)
    return trainable.merge_lora(model) if req.lora_rank else model


def _write(req, pair, acc, model, teacher, plan, before, abilities, report) -> None:
    """Write OUT; the --eval "after" scores and capability scores come from loading the written folder, before
    it is renamed."""
    report["eval"] = None

    def score(folder: Path) -> dict:
        healed = load_model(str(folder), device=str(acc.device), dtype="float32")
        report["eval"] = dict.fromkeys(
            ("files", "tokens", "predicted", "seq_len", "teacher_perplexity", "before", "after")
        )
        if before is not None:
            after = _score(healed.model, teacher, plan["eval"])
            report["eval"].update(
                files=list(req.eval),
                tokens=after.pop("tokens"),
                predicted=after.pop("predicted"),
                seq_len=req.eval_seq_len,
                teacher_perplexity=after.pop("teacher_perplexity"),
                before={k: before[k] for k in after},
                after=after,
            )
        after_abilities = (
            run_capability(healed, req.capability, check_capability(req.capability, []), "healed")
            if abilities is not None
            else {}
        )
        report["eval"].update(before_after(abilities or {}, after_abilities))
        return {"eval": report["eval"]}

    write_checkpoint(
        req,
        pair.student,
        "heal",
        config=pair.student.root / "config.json",
        weights=lambda writer: healed_tensors(model, pair.student.ckpt, writer),
        body=lambda: _manifest(req, pair, report),
        score=score if before is not None or abilities is not None else None,
        inputs=[pair.teacher.root],
    )
    _remove_checkpoint(req.checkpoint_folder)


def _capability(req: HealRequest, model, plan: dict, acc) -> dict:
    """Task and pass-key scores of a model heal holds (an nn.Module), with the teacher's tokenizer."""
    import torch

    loaded = LoadedModel(
        model=model, tokenizer=plan["tokenizer"], checkpoint=None, device=acc.device, dtype=torch.float32
    )
    was_training = model.training
    model.eval()
    try:
        return run_capability(loaded, req.capability, check_capability(req.capability, []))
    finally:
        model.train(was_training)


#: Share of a --max-time budget that writing teacher text may take before training starts.
SAMPLING_SHARE = 0.5


def _sampling_deadline(req, acc, started: float):
    """With --max-time: the `enough` test of teacher_documents. Once SAMPLING_SHARE of the budget is spent and
    the text holds the validation tokens and one global batch, no new batch is written (cached ones are still
    read); the processes agree through one all-reduce."""
    if req.max_time is None:
        return None
    import torch

    minimum = req.val_tokens + req.batch_size * req.seq_len

    def enough(tokens: int, must_write: bool) -> bool:
        late = time.perf_counter() >= started + SAMPLING_SHARE * req.max_time
        flag = torch.tensor([float(late and must_write and tokens >= minimum)], device=acc.device)
        return bool(acc.reduce(flag, reduction="sum")[0] > 0)

    return enough


def _teacher_windows(req, plan, teacher, acc, log, started: float) -> None:
    """Training and validation windows from teacher-written text (cached; generated where missing)."""

    need = req.samples_needed + req.val_tokens
    log(f"teacher-written training text: {need:,} tokens, cached in {plan['samples']}")
    tokenizer = plan["tokenizer"]
    with phase("teacher writes its training text", need if acc.is_main_process else 0, "tokens") as advance:
        docs, info = teacher_documents(
            teacher,
            tokenizer,
            need,
            req.seq_len,
            req.seed,
            plan["samples"],
            rank=acc.process_index,
            world=acc.num_processes,
            barrier=acc.wait_for_everyone,
            progress=advance,
            enough=_sampling_deadline(req, acc, started),
        )
    if info["cut_short"]:
        log(f"teacher-written text cut at {info['tokens']:,} tokens: --max-time leaves the rest to training")
    windows, _ = token_windows(
        ((doc, True) for doc in docs), text_prefix(tokenizer), tokenizer.eos_token_id, req.seq_len
    )
    plan["train"], plan["val"] = split_windows(windows, req.val_tokens)
    plan["info"].update(info, train_tokens=int(plan["train"].numel()), validation_tokens=int(plan["val"].numel()))


def _score(student, teacher, windows) -> dict:
    """Perplexity, KL(teacher || student) and top-1 agreement of the student on evaluation windows."""

    was_training = student.training
    student.eval()
    r = evaluate(student, windows, reference=teacher)
    student.train(was_training)
    return {
        "tokens": r.tokens,
        "predicted": r.predicted,
        "perplexity": r.perplexity,
        "kl_mean": r.kl_mean,
        "kl_max": r.kl_max,
        "top1_agreement": r.top1_agreement,
        "teacher_perplexity": r.reference_perplexity,
    }


def _summary(trainer, acc, state) -> dict:
    """Training counters, the validation curve and per-step losses for the report."""
    seconds = state.seconds
    first = trainer.state.validation[0]
    best = state.best
    return {
        "training": {
            "steps": state.step,
            "tokens": state.tokens,
            "seconds": seconds,
            "tokens_per_second": state.tokens / seconds if seconds else None,
            "stopped": state.stopped,
            "best_step": best["step"],
            "processes": acc.num_processes,
            "fsdp": trainer.sharded,
            "device": str(acc.device),
            "precision": "bf16 autocast" if acc.mixed_precision == "bf16" else "fp32",
        },
        "validation": {"before": first, "after": best, "curve": state.validation},
        "steps": state.steps,
    }


def _manifest(req: HealRequest, pair, report: dict) -> dict:
    """attnkit.json entries of the healed folder (its source is the student): the teacher, the rewrite it heals,
    data, budget, settings (its parameters), training and validation."""
    keep = ("data", "budget", "seed", "trainable", "training", "validation")
    doc = {
        "parameters": report.get("settings"),
        "warnings": report.get("warnings", []),
        "teacher": pair.teacher.record(),
        "rewrite": pair.manifest,
        **{k: report.get(k) for k in keep},
    }
    doc["trainable"] = {k: v for k, v in (doc["trainable"] or {}).items() if k != "names"}
    return doc


def _remove_checkpoint(folder: Path) -> None:
    """The run finished and OUT is written: its checkpoint is no longer needed."""
    import shutil

    if (folder / "run.json").is_file():
        shutil.rmtree(folder, ignore_errors=True)
