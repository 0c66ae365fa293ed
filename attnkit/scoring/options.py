"""What a writing command scores its result on (convert, retrofit: against the source; heal: against the teacher,
before and after training): held-out text (--eval), the greedy samples, tasks and pass keys. One EvalOptions,
embedded in RewriteRequest and HealRequest and built once by the CLI; its checks run before anything loads."""

from __future__ import annotations

from dataclasses import dataclass, field

from attnkit.errors import UsageError
from attnkit.runtime.texts import check_text_files, check_window_options, make_windows, read_texts
from attnkit.scoring.capability import CapabilitySpec
from attnkit.scoring.perplexity import FIRST_BUCKET
from attnkit.units import MAX_TOKENS, check_bounds

#: Prompt of the greedy sample when none is given: a fact a small model knows and a damaged one gets wrong.
DEFAULT_PROMPTS = ("The capital of the United States is",)
#: The flags that set `seq_len` and `tokens`, for the messages.
FLAGS = ("--eval-seq-len", "--eval-tokens")
#: Tokens per long window (--eval-long-seq-len), capped at the model's positions.
LONG_SEQ_LEN = 4096


@dataclass(frozen=True, kw_only=True)
class EvalOptions:
    """--eval text cut into windows of `seq_len`, at most `tokens` in all; prompts both models continue greedily
    for `sample_tokens` (with --eval text); tasks and pass keys of both."""

    files: tuple[str, ...] = ()
    tokens: int | None = 4096
    seq_len: int = 512
    sample_prompts: tuple[str, ...] = DEFAULT_PROMPTS
    sample_tokens: int = 16
    long_seq_len: int = LONG_SEQ_LEN  # the --eval text also in windows this long, scored by distance; 0: not
    capability: CapabilitySpec = field(default_factory=CapabilitySpec)

    def __bool__(self) -> bool:
        """Whether anything is scored (--eval text, tasks or pass keys)."""
        return bool(self.files) or bool(self.capability)

    def windows(self, tokenizer):
        """The --eval text as windows [N, seq_len], at most `tokens` in all."""
        return make_windows(tokenizer, read_texts(list(self.files)), self.seq_len, self.tokens, flags=FLAGS)

    def long_windows(self, tokenizer, max_positions: int | None) -> tuple:
        """(L, the --eval text as windows [N, L]) with L = long_seq_len tokens capped at the model's positions, at
        most max(tokens, L) in all; the windows are None when the text holds less than one."""
        from attnkit.errors import AttnkitError

        length = min(self.long_seq_len, max_positions or self.long_seq_len)
        try:
            windows = make_windows(tokenizer, read_texts(list(self.files)), length, max(self.tokens or length, length))
        except AttnkitError:  # shorter than one window: the report says so instead
            windows = None
        return length, windows


def check_eval_options(opts: EvalOptions) -> None:
    """What needs no model: the --eval files are UTF-8 text, the window options hold a window and the samples'
    length is bounded. The tasks and pass keys are checked against the models with check_capability (after the
    output folder: resolving a model is the slower check)."""
    check_text_files(list(opts.files))
    check_window_options(opts.seq_len, opts.tokens if opts.files else None, FLAGS)
    if opts.tokens is not None:
        check_bounds(FLAGS[1], opts.tokens, 1, MAX_TOKENS)
    check_bounds("the greedy samples' new tokens", opts.sample_tokens, 1, MAX_TOKENS)
    check_bounds("--eval-long-seq-len", opts.long_seq_len, 0, MAX_TOKENS)
    if 0 < opts.long_seq_len <= FIRST_BUCKET:
        raise UsageError(
            f"--eval-long-seq-len {opts.long_seq_len}: long windows are scored by distance and must be longer than "
            f"the first distance bucket ({FIRST_BUCKET} tokens); use {2 * FIRST_BUCKET} or more, or 0 for none"
        )
