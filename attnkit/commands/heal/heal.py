"""`attnkit heal STUDENT OUT --teacher SOURCE`: the orchestrator.

Flow: check options and paths -> check that the student is a rewrite of the teacher (configs, tokenizers,
copied weights) -> check OUT, the checkpoint folder and a --resume fingerprint -> read and tokenize the
data (attnkit.commands.heal.plan) -> (nothing loaded until here) load both models (models) -> teacher-written
data when no --data -> score the student against the teacher (scores) -> choose what trains and train
(training) -> merge LoRA -> write OUT, score it after, manifest, remove the checkpoint folder (finish). A
failure before the end writes nothing to OUT.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from attnkit.commands.heal import finish, models, scores, training
from attnkit.commands.heal.memory import memory_report, refusal, shapes_of
from attnkit.commands.heal.pair import check_pair, rewrite_summary
from attnkit.commands.heal.plan import plan_data, teacher_windows
from attnkit.commands.heal.request import RESUME, SETTINGS, HealRequest, check_options, check_positions, processes
from attnkit.commands.heal.resume import check_fingerprint
from attnkit.commands.heal.run import HealRun
from attnkit.commands.heal.trainable import default_lr
from attnkit.commands.report_head import report_head, timed
from attnkit.commands.rewrite import check_write
from attnkit.errors import AttnkitError, UsageError
from attnkit.option_fields import tagged
from attnkit.scoring.capability import check_capability


def heal(req: HealRequest, log: Callable[[str], None] = lambda message: None) -> dict | None:
    """Run (or with dry_run, plan) a healing run; returns the report (see docs/heal.md), or None in the
    processes other than the main one of a multi-process run."""

    started = time.perf_counter()
    check_options(req)
    device = check_write(req, inputs=[req.model, req.teacher])  # --device, resolved once
    _check_device(device, req.device)
    mixed_precision = models.precision_for(device, req.precision)
    check_capability(req.scoring.capability, [req.model, req.teacher])
    _check_checkpoint_folder(req)
    pair = check_pair(req.model, req.teacher, rewritten=req.train != "all")
    for source in (pair.student, pair.teacher):
        limit = source.arch.config_value(source.config, "max_positions") if source.arch is not None else None
        check_positions(req, None if limit is None else int(limit))
    if req.lr is None:
        req = dataclasses.replace(req, lr=default_lr(pair.student.config))
    memory = memory_report(shapes_of(pair, pair.trained), req, device, autocast=mixed_precision == "bf16")
    if not memory["fits"]:
        raise AttnkitError(refusal(memory))
    plan = plan_data(req, pair)
    fingerprint = _fingerprint(req, pair.student.digest, pair.teacher.digest, plan.digest)
    resumed = check_fingerprint(req.checkpoint_folder, fingerprint) if req.resume else None
    report = {
        **report_head(req, inputs={"student": req.model, "teacher": req.teacher}),
        "rewrite": rewrite_summary(pair.manifest),
        "data": plan.info,
        "budget": _budget(req),
        "settings": tagged(req, SETTINGS),
        "seed": req.seed,
        "checkpoint": str(req.checkpoint_folder),
        "resumed_from_step": resumed["state"]["step"] if resumed else None,
        "memory": memory,
    }
    if req.dry_run:
        return timed(report, started)
    acc = models.accelerator_for(device, mixed_precision)
    run = HealRun(
        req=req,
        pair=pair,
        plan=plan,
        report=report,
        fingerprint=fingerprint,
        resumed=resumed,
        started=started,
        acc=acc,
        log=log if acc.is_main_process else (lambda message: None),
    )
    return _train_and_write(run)


def _train_and_write(run: HealRun) -> dict | None:
    """Load both models, score the student, train, and (main process) write OUT; returns the report (None
    elsewhere)."""
    req, report = run.req, run.report
    teacher, student = models.load_models(run)
    if run.plan.train is None:
        teacher_windows(run, teacher)
    comparison = scores.comparison_for(run)
    # the check compares the written folder with the teacher: a top-k run (teacher freed) loads it again
    needs_teacher = comparison is not None or req.check.enabled
    before = None
    if comparison is not None:
        if req.scoring.capability:
            run.log("scoring teacher and student: tasks and pass keys")
        before = scores.score(comparison, run, teacher, student)
    chosen = training.select(run, student, teacher)
    if chosen.targets is not None:  # the teacher's targets are computed: it leaves memory before training
        teacher = None
        models.release_memory()
    trainer = training.make_trainer(run, student, teacher, chosen, before)
    state = training.train(run, trainer)
    report.update(training.summary(run, trainer, state))
    trained = trainer.tensors() if req.fsdp else None  # gathered from the shards by every process
    if not run.main:
        return None
    run.log(f"writing {req.out}")
    if teacher is None and needs_teacher:  # top-k: the teacher comes back to score the result
        teacher, _ = models.load_models(run, student=False)
    healed = training.trained_model(run, trainer, trained, chosen.names)
    finish.write_healed(run, healed, teacher, comparison, before)
    return timed(report, run.started)


def _check_device(device, flag: str) -> None:
    """--device takes what every command takes; cuda:N picks the GPU of a single process only."""
    if device.type == "cuda" and device.index is not None and processes() > 1:
        raise UsageError(
            f"--device {flag} names one GPU; the processes of a multi-process run take one each: use --device cuda"
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


def _fingerprint(req: HealRequest, student: str, teacher: str, data: str) -> dict:
    """What a resumed run must share with the checkpoint: the models, the data and the options tagged RESUME."""
    return {"student": student, "teacher": teacher, "data": data, **tagged(req, RESUME)}


def _budget(req: HealRequest) -> dict:
    """tokens: training tokens; max_time_seconds: the whole command's time (loading, data, training, scoring)."""
    return {"tokens": req.budget_tokens, "max_time_seconds": req.max_time}
