"""Training setup of a heal run: what trains, the teacher's cached top-k targets, the Trainer (LoRA, gradient
checkpointing, the loop's settings, a resumed state, logs), the run itself with its checkpoints and progress bar,
and what the report says of it afterwards."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from attnkit.commands.heal import resume, topk, trainable
from attnkit.commands.heal.bar import training_bar
from attnkit.commands.heal.loop import LoopConfig, LoopState, Trainer
from attnkit.commands.heal.models import release_memory
from attnkit.commands.heal.request import LOOP, HealRequest
from attnkit.io.gguf_load import cache_root
from attnkit.option_fields import tagged
from attnkit.runtime import load_model
from attnkit.scoring.perplexity import evaluate

#: The writing of OUT, in validations (a margin: it is mostly I/O).
WRITE_COST = 0.25


@dataclass
class Selection:
    """What trains: the student's tensor names, the attention module pairs --attn-loss compares, and the teacher's
    (training, validation) top-k targets with --teacher-logits top-k (None: the teacher runs live)."""

    names: list[str]
    pairs: dict
    targets: tuple | None = None


def select(run, student, teacher) -> Selection:
    """The tensors --train chooses and their attention pairs; with --teacher-logits top-k also the teacher's
    targets (the caller then lets the teacher go)."""
    names = trainable.select(student, teacher, run.req.train)
    chosen = Selection(names, trainable.attention_pairs(student, teacher, names))
    if run.req.teacher_logits == "top-k":
        chosen.targets = teacher_targets(run, teacher)
        run.report["teacher_targets"] = {"k": run.req.top_k, "bytes_per_token": chosen.targets[0].bytes_per_token}
    return chosen


def teacher_targets(run, teacher) -> tuple:
    """(training, validation) top-k targets of the teacher (attnkit.commands.heal.topk), cached on disk: the main
    process computes what is missing, every process reads the file."""
    req, acc = run.req, run.acc
    root = Path(req.sample_cache).expanduser() if req.sample_cache else cache_root()
    found = []
    for windows in (run.plan.train, run.plan.val):
        path = topk.cache_file(root, run.pair.teacher.digest, windows, req.top_k)
        if acc.is_main_process:
            if not path.is_file():
                run.log(f"teacher's top-{req.top_k} targets for {windows.numel():,} tokens, cached in {path.parent}")
            topk.load_or_compute(
                path, lambda w=windows: topk.teacher_targets(teacher, w, req.top_k, req.micro_batch_size, acc.device)
            )
        acc.wait_for_everyone()
        found.append(topk.load_or_compute(path, lambda: None))
    return found[0], found[1]


def make_trainer(run, student, teacher, chosen: Selection, before: dict | None) -> Trainer:
    """The Trainer: what trains (report["trainable"]), LoRA and gradient checkpointing, a resumed state, logs;
    a --max-time budget is a deadline run.started + max_time for the whole command. `teacher` is None with
    top-k targets; `before`: the student's "eval" block (its --eval scores are step 0 of --eval-curve)."""

    req, plan = run.req, run.plan
    names = chosen.names
    run.report["trainable"] = {
        "mode": req.train,
        "lora_rank": req.lora_rank or None,
        "tensors": len(names),
        "parameters": sum(student.get_parameter(n).numel() for n in names),
        "names": names,
    }
    run.log(
        f"training {len(names)} tensors ({run.report['trainable']['parameters']:,} parameters)"
        + (f" through LoRA rank {req.lora_rank}" if req.lora_rank else "")
    )
    if req.gradient_checkpointing:
        student.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = trainable.add_lora(student, names, req.lora_rank, req.seed) if req.lora_rank else student
    trainer = Trainer(
        run.acc,
        model,
        teacher,
        plan.train,
        plan.val,
        _loop_config(run),
        chosen.pairs,
        LoopState(**run.resumed["state"]) if run.resumed else None,
        lr_scales=trainable.lr_scales(student),
        targets=chosen.targets,
    )
    if run.resumed:
        trainer.load_state_dict(resume.load_state(req.checkpoint_folder))
        run.log(f"resumed at step {trainer.state.step} ({trainer.state.tokens:,} tokens)")
    if req.eval_curve:  # step 0 is the student as loaded: its scores are `before`
        trainer.monitor = lambda m: {
            f"eval_{k}": v
            for k, v in ((before or {}) if trainer.state.step == 0 else _eval_scores(m, teacher, plan.eval)).items()
            if k in ("perplexity", "kl_mean")
        }
    trainer.on_validation = lambda e: run.log(
        f"step {e['step']}: {e['tokens']:,} tokens, {e['seconds']:.0f}s; "
        f"validation KL {e['kl_mean']:.4f}, perplexity {e['perplexity']:.3f}"
    )
    return trainer


def _loop_config(run) -> LoopConfig:
    req = run.req
    return LoopConfig(
        **tagged(req, LOOP),
        budget_tokens=req.budget_tokens,
        deadline=None if req.max_time is None else run.started + req.max_time,
        started=run.started,
        after_training=after_training(run.plan),
    )


def _eval_scores(model, teacher, windows) -> dict:
    """--eval-curve: perplexity and KL(teacher || model) of the training model on the --eval windows, in eval
    mode (the teacher is None with top-k targets: no KL then)."""
    was_training = model.training
    model.eval()
    try:
        r = evaluate(model, windows, reference=teacher)
    finally:
        model.train(was_training)
    return {"perplexity": r.perplexity, "kl_mean": r.kl_mean}


def after_training(plan) -> float:
    """What runs after training, in units of one validation (student and teacher over the validation windows):
    the last validation, the --eval scoring of the healed student (the same per-token cost) and the write."""
    scoring = 0.0 if plan.eval is None else plan.eval.numel() / max(plan.val.numel(), 1)
    return 1.0 + scoring + WRITE_COST


def train(run, trainer: Trainer):
    """Run the loop to its end (budget, early stop, Ctrl-C): checkpoints into the checkpoint folder, a progress bar
    in the main process; returns the final LoopState."""
    req, acc = run.req, run.acc

    def save() -> None:
        state = trainer.state_dict() if acc.is_main_process or req.fsdp else None  # --fsdp: gathered by all
        if acc.is_main_process:
            resume.save(
                req.checkpoint_folder, {"fingerprint": run.fingerprint, "state": trainer.state.to_dict()}, state
            )
        acc.wait_for_everyone()

    unit = "tokens" if req.budget_tokens else "seconds"
    done = trainer.state.tokens if unit == "tokens" else trainer.state.seconds
    with training_bar(
        req.budget_tokens or req.max_time, unit, done, trainer.state.tokens, enabled=acc.is_main_process
    ) as advance:
        return trainer.run(save, advance)


def summary(run, trainer: Trainer, state) -> dict:
    """Training counters, the validation curve, per-step losses and warnings for the report."""
    acc, seconds, best = run.acc, state.seconds, state.best
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
            "teacher_logits": "live" if trainer.targets is None else f"top-{run.req.top_k}",
        },
        "validation": {"before": trainer.state.validation[0], "after": best, "curve": state.validation},
        "steps": state.steps,
        "warnings": _warnings(run.req, state),
    }


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


def trained_model(run, trainer: Trainer, trained: dict | None, names: list[str]):
    """The student with its trained tensors (LoRA adapters merged in), outside DDP; with --fsdp (`trained`: the
    gathered tensors) the student loaded again, unsharded, given the same adapters (`names`: the tensors chosen
    to train), with them."""
    req = run.req
    if trained is not None:
        trainer.model = None
        release_memory()
        model = load_model(run.pair.student, device=str(run.acc.device), dtype="float32").model
        if req.lora_rank:
            model = trainable.add_lora(model, names, req.lora_rank, req.seed)
        for name, tensor in trained.items():
            model.get_parameter(name).data.copy_(tensor)
    else:
        model = run.acc.unwrap_model(trainer.model)
    return trainable.merge_lora(model) if req.lora_rank else model
