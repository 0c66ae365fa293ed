"""The training loop: AdamW with warmup and cosine decay, gradient accumulation, a held-out check with early
stopping, checkpoints, and a stop at the token or time budget or on Ctrl-C/SIGTERM.

Devices and processes are accelerate's: the student is prepared (DDP when launched with torchrun or
`accelerate launch`), the teacher runs beside it without gradients. Step s trains on the same global
batch whatever the number of processes: rank r takes its contiguous share of the batch, split into
micro-batches whose gradients accumulate (without DDP sync until the last one). With --fsdp the student is
sharded instead (attnkit.commands.heal.sharding): gradients are reduce-scattered after every micro-batch, and
validation gives every process as many forward passes.

A time budget (--max-time) is a deadline for the whole command: the loop does not start a micro-batch that
would end (taking as long as the longest one so far) inside the reserve for the work after training, which
costs `after_training` times the first validation's duration (the last validation, scoring); a step cut
short between its micro-batches is dropped.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from attnkit.commands.heal import sharding
from attnkit.commands.heal.loss import attention_capture, distill_loss
from attnkit.commands.heal.topk import topk_kl
from attnkit.errors import AttnkitError, Terminated, UsageError
from attnkit.scoring.perplexity import evaluate


class Interrupted(AttnkitError):
    """Ctrl-C or SIGTERM: the loop stopped after a step and saved a checkpoint; exit 128 + the signal's number
    (130 for Ctrl-C, 143 for SIGTERM), as a signal that unwinds does."""

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.exit_code = 128 + signum


@dataclass
class LoopConfig:
    """Everything the loop needs from the request."""

    lr: float
    warmup_steps: int
    min_lr_ratio: float
    weight_decay: float
    max_grad_norm: float
    batch_size: int
    micro_batch_size: int
    attn_loss: float
    budget_tokens: int | None
    max_time: float | None
    eval_every: int
    patience: int
    checkpoint_every: int
    seed: int
    deadline: float | None = None  # time.perf_counter() by which the whole command must end (--max-time)
    started: float | None = None  # time.perf_counter() when the command started
    after_training: float = 1.0  # the work after training, in validations (the last one, --eval scoring)
    fsdp: bool = False  # the student sharded over the processes (attnkit.commands.heal.sharding)


@dataclass
class LoopState:
    """Counters and curves; what a checkpoint stores besides tensors."""

    step: int = 0
    tokens: int = 0
    seconds: float = 0.0
    steps: list = field(default_factory=list)  # per step: step, tokens, lr, loss, kl, attn
    validation: list = field(default_factory=list)  # per check: step, tokens, seconds, kl_mean, perplexity
    best: dict | None = None  # the best validation entry
    bad_checks: int = 0  # validations since the best one
    stopped: str | None = None  # tokens | time | early stop

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def lr_at(cfg: LoopConfig, step: int, progress: float) -> float:
    """Linear warmup over warmup_steps, then cosine from lr to lr * min_lr_ratio as progress goes 0 -> 1.

    Progress is the share of the budget spent (tokens, or seconds for --max-time), so a wall-clock budget
    gets a full cosine too; a torch LambdaLR only knows steps, whose number a time budget does not fix.
    """
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return cfg.lr * warm * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def batch_indices(n_windows: int, step: int, batch: int, seed: int):
    """Window indices [batch] of global step `step`: consecutive slices of one seeded permutation per epoch."""
    import torch

    out, start = [], step * batch
    while len(out) < batch:
        epoch, offset = divmod(start + len(out), n_windows)
        perm = torch.randperm(n_windows, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        out.extend(perm[offset : offset + batch - len(out)].tolist())
    return torch.tensor(out)


def param_groups(trainable: list, scales: dict) -> list[dict]:
    """AdamW groups by learning-rate factor: a parameter under a module named in `scales` ({module name: factor},
    also inside peft's wrappers, whose names end with it) gets that factor, every other one 1."""
    groups: dict[float, list] = {}
    for name, p in trainable:
        factor = next((f for module, f in scales.items() if f".{module}." in f".{name}"), 1.0)
        groups.setdefault(factor, []).append(p)
    return [{"params": ps, "lr_scale": factor} for factor, ps in groups.items()]


@contextlib.contextmanager
def stop_requests():
    """Within the block, SIGINT/SIGTERM set flag['stop'] (and flag['signal']) instead of raising; a second signal
    raises as it would outside (KeyboardInterrupt, or Terminated for SIGTERM)."""
    flag = {"stop": False, "signal": signal.SIGINT}
    previous = {}

    def handler(signum, frame):
        if flag["stop"]:
            raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum, signal.Signals(signum).name)
        flag["stop"], flag["signal"] = True, signum

    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            previous[sig] = signal.signal(sig, handler)
        except ValueError:  # not the main thread: leave signals alone
            pass
    try:
        yield flag
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


class Trainer:
    """One healing run: call run() once; trained tensors live in the student, curves in .state."""

    def __init__(
        self,
        accelerator,
        student,
        teacher,
        train_windows,
        val_windows,
        cfg: LoopConfig,
        attention_pairs: dict,
        state: LoopState | None = None,
        lr_scales: dict | None = None,
        targets: tuple | None = None,
    ):
        """`targets`: (training, validation) Targets of attnkit.commands.heal.topk; the teacher is then None and
        training and validation score the student against them."""
        import torch

        world = accelerator.num_processes
        if cfg.batch_size % (world * cfg.micro_batch_size):
            raise UsageError(
                f"--batch-size {cfg.batch_size} must be a multiple of {world} process(es) x "
                f"--micro-batch-size {cfg.micro_batch_size}"
            )
        self.acc, self.teacher, self.cfg = accelerator, teacher, cfg
        self.targets = targets
        self.train_windows, self.val_windows = train_windows, val_windows
        self.state = state or LoopState()
        self.sharded = cfg.fsdp
        if self.sharded:  # before the optimizer: it must hold the sharded parameters
            sharding.shard(student)
        self.trainable = [(n, p) for n, p in student.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            param_groups(self.trainable, lr_scales or {}), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        if self.sharded:
            self.model = student
        else:
            self.model, self.optimizer = accelerator.prepare(student, self.optimizer)
        self.attention_pairs = attention_pairs if cfg.attn_loss > 0 else {}
        self.best_tensors: dict | None = None
        self.reserve = 0.0  # seconds kept for the work after training; measured by the first validation
        self.micro_seconds = 0.0  # the longest micro-batch so far (forward and backward), seconds
        self.on_validation: Callable[[dict], None] | None = None
        self.monitor: Callable[[object], dict] | None = None  # extra scores per validation, never used to stop

    # -- state that checkpoints carry ---------------------------------------------------------------

    def tensors(self) -> dict:
        """{name: whole CPU copy} of the trainable tensors (with --fsdp a collective: every process calls it)."""
        return {n: sharding.full(p) for n, p in self.trainable}

    def load_tensors(self, tensors: dict) -> None:
        for n, p in self.trainable:
            if n not in tensors or tensors[n].shape != p.shape:
                raise AttnkitError(f"checkpoint does not hold the trained tensor {n!r} with shape {list(p.shape)}")
            sharding.load_full(p, tensors[n])

    def state_dict(self) -> dict:
        """Trained tensors, optimizer state and the best tensors, whole (with --fsdp gathered: every process calls
        it), so a checkpoint resumes with or without --fsdp."""
        optimizer = self.optimizer.state_dict()
        if self.sharded:
            optimizer = sharding.full_optimizer_state(optimizer)
        return {"tensors": self.tensors(), "optimizer": optimizer, "best": self.best_tensors}

    def load_state_dict(self, saved: dict) -> None:
        self.load_tensors(saved["tensors"])
        optimizer = saved["optimizer"]
        if self.sharded:
            params = [p for group in self.optimizer.param_groups for p in group["params"]]
            optimizer = sharding.shard_optimizer_state(optimizer, params)
        self.optimizer.load_state_dict(optimizer)
        self.best_tensors = saved.get("best")

    # -- the loop -----------------------------------------------------------------------------------

    def progress(self, elapsed: float) -> float:
        """Share of the budget spent: tokens, or for a time budget the share of the command's time."""
        if self.cfg.budget_tokens:
            return self.state.tokens / self.cfg.budget_tokens
        if self.cfg.deadline is not None and self.cfg.started is not None:
            return (time.perf_counter() - self.cfg.started) / max(self.cfg.deadline - self.cfg.started, 1e-9)
        return elapsed / self.cfg.max_time

    def late(self) -> bool:
        """Whether one more micro-batch would end inside the reserve before the deadline (this process's view)."""
        deadline = self.cfg.deadline
        return deadline is not None and time.perf_counter() + self.micro_seconds + self.reserve >= deadline

    def out_of_time(self) -> bool:
        """Whether training must stop now to leave the reserve before the deadline (every process agrees)."""
        return self._flags(False, self.late())[1]

    def run(self, save: Callable[[], None], advance: Callable[[dict], None] | None = None) -> LoopState:
        """Train until the budget is spent, validation stops improving, or a stop is requested (saved, then
        Interrupted is raised). `save()` writes a checkpoint; `advance(step entry)` feeds a progress bar."""
        st, cfg = self.state, self.cfg
        start = time.perf_counter() - st.seconds
        if not st.validation:
            self.validate(0.0)
        with stop_requests() as flag:
            while st.stopped is None:
                entry = self.step(time.perf_counter() - start)
                st.seconds = time.perf_counter() - start
                if entry is None:  # the deadline came within the step: it is dropped
                    st.stopped = "time"
                    self.validate(st.seconds)
                    break
                if advance is not None:
                    advance(entry)
                stop, time_up = self._flags(flag["stop"], self.late())
                if cfg.budget_tokens and st.tokens >= cfg.budget_tokens:
                    st.stopped = "tokens"
                elif time_up:
                    st.stopped = "time"
                if st.stopped or st.step % cfg.eval_every == 0:
                    self.validate(time.perf_counter() - start)
                st.seconds = time.perf_counter() - start
                if stop and st.stopped is None:  # a stop that arrives with the last step lets the run finish
                    save()
                    how = (
                        "interrupted"
                        if flag["signal"] == signal.SIGINT
                        else f"terminated ({signal.Signals(flag['signal']).name})"
                    )
                    raise Interrupted(
                        f"{how} at step {st.step}; checkpoint saved, continue with --resume", flag["signal"]
                    )
                if st.stopped is None and st.step % cfg.checkpoint_every == 0:
                    save()
        if self.best_tensors is not None and st.best["step"] != st.validation[-1]["step"]:
            self.load_tensors(self.best_tensors)
        return st

    def step(self, elapsed: float) -> dict | None:
        """One optimizer step on global batch st.step; returns its entry (loss averaged over all processes), or
        None when the deadline came between its micro-batches (the step's gradients are dropped)."""
        import torch

        st, cfg, acc = self.state, self.cfg, self.acc
        share = cfg.batch_size // acc.num_processes
        rows = batch_indices(self.train_windows.shape[0], st.step, cfg.batch_size, cfg.seed)
        my_rows = rows[acc.process_index * share : (acc.process_index + 1) * share]
        mine = self.train_windows[my_rows]  # [share, T]
        micro = mine.split(cfg.micro_batch_size)
        micro_rows = my_rows.split(cfg.micro_batch_size)
        sums = torch.zeros(3, device=acc.device)  # loss, kl, attention term
        self.model.train()
        with attention_capture(self.attention_pairs) as capture:
            for i, ids in enumerate(micro):
                if self.out_of_time():
                    self.optimizer.zero_grad(set_to_none=True)
                    return None
                began = time.perf_counter()
                last = i == len(micro) - 1
                sync = contextlib.nullcontext() if last or self.sharded else acc.no_sync(self.model)
                with sync, acc.autocast():
                    if self.targets is not None:
                        logits = self.model(input_ids=ids.to(acc.device), use_cache=False).logits  # [B, T, V]
                        loss = kl = topk_kl(logits, self.targets[0].rows(micro_rows[i]))
                        attn = None
                    else:
                        loss, kl, attn = distill_loss(
                            self.model, self.teacher, ids.to(acc.device), cfg.attn_loss, capture
                        )
                    acc.backward(loss / len(micro))
                self.micro_seconds = max(self.micro_seconds, time.perf_counter() - began)
                sums += torch.stack(
                    [loss.detach(), kl.detach(), attn.detach() if attn is not None else kl.new_zeros(())]
                )
        if cfg.max_grad_norm and self.sharded:
            sharding.clip_grad_norm([p for _, p in self.trainable], cfg.max_grad_norm)
        elif cfg.max_grad_norm:
            acc.clip_grad_norm_([p for _, p in self.trainable], cfg.max_grad_norm)
        lr = lr_at(cfg, st.step, self.progress(elapsed))
        for group in self.optimizer.param_groups:
            group["lr"] = lr * group["lr_scale"]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        loss, kl, attn = (acc.reduce(sums / len(micro), reduction="mean")).tolist()
        st.step += 1
        st.tokens += cfg.batch_size * self.train_windows.shape[1]
        entry = {
            "step": st.step,
            "tokens": st.tokens,
            "lr": lr,
            "loss": loss,
            "kl": kl,
            "attn": attn if self.attention_pairs else None,
        }
        st.steps.append(entry)
        return entry

    def _idle_forwards(self, count: int) -> None:
        """Forward passes whose results are dropped, so that a process with fewer validation windows takes part in
        as many of the shards' gathers as the others."""
        import torch

        model = self.inner_model()
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for _ in range(count):
                model(input_ids=self.val_windows[:1].to(self.acc.device), use_cache=False)
        model.train(was_training)

    def inner_model(self):
        """The transformers model being trained (inside DDP and, with LoRA, inside peft: its adapters stay in it)."""
        model = self.acc.unwrap_model(self.model)
        return model.get_base_model() if hasattr(model, "get_base_model") else model

    def _flags(self, stop: bool, time_up: bool) -> tuple[bool, bool]:
        """Stop and time-up as seen by any process (one all-reduce), so every rank leaves at the same step."""
        import torch

        flags = torch.tensor([float(stop), float(time_up)], device=self.acc.device)
        flags = self.acc.reduce(flags, reduction="sum")
        return bool(flags[0] > 0), bool(flags[1] > 0)

    def validate(self, seconds: float) -> dict:
        """KL(teacher || student) and student perplexity on the validation windows, shared out over processes;
        keeps the best tensors and counts checks without improvement (early stopping after `patience`)."""
        st, acc = self.state, self.acc
        began = time.perf_counter()
        share = slice(acc.process_index, None, acc.num_processes)
        # accelerate runs the prepared student's forward under the training's autocast (bf16 on CUDA); the
        # teacher and the output-head check in scoring run under it too, so both sides compute alike
        with acc.autocast():
            if self.targets is not None:
                windows, targets = self.val_windows[share], self.targets[1].rows(share)
                sums = evaluate_shard_topk(self.inner_model(), windows, targets, acc.device)
            else:
                sums = evaluate_shard(self.inner_model(), self.teacher, self.val_windows[share], acc.device)
        if self.sharded:  # every process runs as many forward passes as the one with the most windows
            per_pass = 1 if self.targets is not None else val_batch(self.val_windows.shape[1])
            most = -(-self.val_windows.shape[0] // acc.num_processes)
            mine = self.val_windows[share].shape[0]
            self._idle_forwards(-(-most // per_pass) - -(-mine // per_pass))
        sums = acc.reduce(sums, reduction="sum").tolist()  # nll, kl, tokens
        entry = {
            "step": st.step,
            "tokens": st.tokens,
            "seconds": seconds,
            "kl_mean": sums[1] / sums[2],
            "perplexity": math.exp(sums[0] / sums[2]),
        }
        if self.monitor is not None and (acc.is_main_process or self.sharded):  # sharded: every process runs it
            entry.update(self.monitor(self.inner_model()))
        st.validation.append(entry)
        if not self.reserve:
            self.reserve = (time.perf_counter() - began) * self.cfg.after_training
        if self.on_validation is not None:
            self.on_validation(entry)
        if st.best is None or entry["kl_mean"] < st.best["kl_mean"]:
            st.best, st.bad_checks = entry, 0
            self.best_tensors = self.tensors()
        else:
            st.bad_checks += 1
            if self.cfg.patience and st.bad_checks >= self.cfg.patience and st.stopped is None:
                st.stopped = "early stop"
        return entry


def evaluate_shard_topk(model, windows, targets, device):
    """float64 tensor [NLL sum, coarsened KL sum, tokens] of `model` on windows [n, T] against the teacher's
    cached top-k targets (attnkit.commands.heal.topk)."""
    import torch

    sums = torch.zeros(3, dtype=torch.float64, device=device)
    if windows.shape[0] == 0:
        return sums
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for i in range(windows.shape[0]):
                ids = windows[i : i + 1].to(device)
                logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()  # [1, T-1, V]
                nll = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
                kl = topk_kl(logits, targets.rows(slice(i, i + 1)).window_prefix()) * logits.shape[1]
                sums += torch.stack([nll.double(), kl.double(), torch.tensor(logits.shape[1], dtype=torch.float64)])
    finally:
        model.train(was_training)
    return sums


#: Validation tokens per forward pass with the teacher beside the student (4 windows of 256; one long window).
VAL_PASS_TOKENS = 1024


def val_batch(seq_len: int) -> int:
    """Validation windows per forward pass: long windows go one at a time (an eager attention holds
    windows x heads x T^2 probabilities)."""
    return max(1, VAL_PASS_TOKENS // seq_len)


def evaluate_shard(model, teacher, windows, device):
    """float64 tensor [NLL sum, KL sum, tokens] of `model` on windows [n, T] (may be empty), KL against teacher."""
    import torch

    if windows.shape[0] == 0:
        return torch.zeros(3, dtype=torch.float64, device=device)
    was_training = model.training
    model.eval()
    try:
        r = evaluate(model, windows, reference=teacher, batch_size=val_batch(windows.shape[1]))
    finally:
        model.train(was_training)
    return torch.tensor([r.nll_mean * r.tokens, r.kl_mean * r.tokens, r.tokens], dtype=torch.float64, device=device)
