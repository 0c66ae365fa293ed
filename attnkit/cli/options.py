"""Every command's shared arguments and options, declared once with their help (bounds live in the requests,
which check them with attnkit-worded messages, so the library is checked as the CLI is).

Typed aliases for the options of the commands that run a model (`seq_len: SeqLen = 512`), and `request_options`,
which makes a request dataclass's option fields (attnkit.option_fields) into a command's options.
Every command that writes a checkpoint (convert, retrofit, heal, export) gets MODEL and OUT first and the
output options last (--max-shard-size, --overwrite, --dry-run), plus the groups it asks for: DEVICE,
CALIB (calibration text), EVAL (evaluation text), SAMPLES (greedy samples), CAPABILITY (tasks, pass keys) and
CHECK (the self-check of the output). The
decorator `writes` adds them to the command's signature and hands their values to it as one mapping, `shared`;
`request_fields` turns that mapping into the keyword arguments of attnkit.commands.rewrite's requests (the scoring
groups into one attnkit.scoring.options.EvalOptions).
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
import typing
from pathlib import Path
from typing import Annotated, Callable, List, Optional

import typer

from attnkit.cli.common import OutputFormat

Format = Annotated[OutputFormat, typer.Option("--format", "-f", help="Output format: table, json, csv or markdown.")]
Device = Annotated[str, typer.Option("--device", help="auto, cpu, cuda, cuda:N or mps.")]
Dtype = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16 (or fp32, bf16, fp16).")]
LayerStream = Annotated[
    str,
    typer.Option(
        "--layer-stream",
        help="auto (when the weights would take more than 80% of the device's free memory), always or never: run "
        "the model layer by layer, each layer read once and freed.",
    ),
]
DeviceMap = Annotated[
    Optional[str],
    typer.Option("--device-map", help="auto: accelerate places the whole model over the GPUs (and CPU) it finds."),
]
#: The text options of eval, probe and diff.
SeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per window.")]
MaxTokens = Annotated[
    Optional[int], typer.Option("--max-tokens", help="At most this many tokens in all (whole windows).")
]
BatchSize = Annotated[int, typer.Option("--batch-size", help="Windows per forward pass.")]
Text = Annotated[Optional[str], typer.Option("--text", help="Literal text (besides any files).")]

MODEL_HELP = "Source: folder, .safetensors, .gguf (dequantized first) or hub id[@revision]."

#: name -> (annotation, typer default) of each group.
OUTPUT = {
    "max_shard_size": (
        str,
        typer.Option("1GiB", "--max-shard-size", help="Largest output shard (also the write buffer)."),
    ),
    "overwrite": (bool, typer.Option(False, "--overwrite", help="Replace a non-empty OUT.")),
    "dry_run": (bool, typer.Option(False, "--dry-run", help="Check everything and print the plan; write nothing.")),
}
DEVICE = {"device": (Device, "auto")}


def calib_group(tokens: int | None = None) -> dict:
    """The calibration options, `tokens` the default of --calib-tokens (None: the rewrites' own; convert mla asks
    for more)."""
    from attnkit.commands.rewrite import CALIB_SEQ_LEN, CALIB_TOKENS

    return {
        "calib": (
            List[str],
            typer.Option(
                [],
                "--calib",
                help="Calibration text file(s) (.txt, .jsonl), read in order and only as far as --calib-tokens needs; "
                "without --eval, the self-check scores the text past the tokens calibrated on.",
            ),
        ),
        "calib_tokens": (
            int,
            typer.Option(
                tokens or CALIB_TOKENS, "--calib-tokens", min=2, help="Calibration tokens (whole windows, at most)."
            ),
        ),
        "calib_seq_len": (
            int,
            typer.Option(CALIB_SEQ_LEN, "--calib-seq-len", min=2, help="Tokens per calibration window."),
        ),
    }


EVAL = {
    "eval_files": (
        List[str],
        typer.Option([], "--eval", help="Held-out text file(s): perplexity and KL of the result against the source."),
    ),
    "eval_tokens": (int, typer.Option(4096, "--eval-tokens", min=2, help="At most this many evaluation tokens.")),
    "eval_seq_len": (int, typer.Option(512, "--eval-seq-len", min=2, help="Tokens per evaluation window.")),
    "eval_long_seq_len": (
        int,
        typer.Option(
            4096,
            "--eval-long-seq-len",
            help="Also score the --eval text in windows this long (capped at the model's positions) by distance of "
            "the predicted token; 0: not.",
        ),
    ),
}
SAMPLES = {
    "sample_prompts": (
        List[str],
        typer.Option(
            [],
            "--sample-prompt",
            help="With --eval: a prompt both models continue greedily (16 "
            "tokens) in the report; repeatable (default: 'The capital of "
            "the United States is').",
        ),
    ),
}


#: The self-check every rewrite runs on its output (attnkit.scoring.selfcheck).
CHECK = {
    "no_check": (
        bool,
        typer.Option(
            False,
            "--no-check",
            help="Skip the self-check of the output against the source (held-out text, short and long windows, "
            "pass keys; docs/check.md).",
        ),
    ),
    "max_loss": (
        Optional[float],
        typer.Option(
            None,
            "--max-loss",
            help="Exit 3 when the self-check's worst perplexity ratio to the source is above this (e.g. 1.2).",
        ),
    ),
}

#: What a rewrite's report scores besides --eval text: task accuracy and pass-key retrieval, source beside result.
CAPABILITY = {
    "eval_tasks": (
        Optional[str],
        typer.Option(
            None,
            "--eval-tasks",
            help="lm-eval tasks (comma-separated) scored on source and result, paired differences in the report.",
        ),
    ),
    "eval_tasks_dir": (
        Optional[str],
        typer.Option(None, "--eval-tasks-dir", help="A folder of local lm-eval YAML tasks."),
    ),
    "eval_limit": (Optional[int], typer.Option(None, "--eval-limit", help="At most this many items per task.")),
    "eval_passkey": (
        Optional[str],
        typer.Option(
            None,
            "--eval-passkey",
            help="Pass-key retrieval of source and result at these context lengths (e.g. 1k,2k,4k).",
        ),
    ),
}


def rewrite_groups(calib_tokens: int | None = None) -> tuple[dict, ...]:
    """The option groups of a rewrite that calibrates (convert, retrofit): device, calibration (`calib_tokens` its
    --calib-tokens default), evaluation, samples, capability and the self-check."""
    return (DEVICE, calib_group(calib_tokens), EVAL, SAMPLES, CAPABILITY, CHECK)


def capability_spec(
    tasks: str | None,
    tasks_dir: str | None = None,
    num_fewshot: int | None = None,
    limit: int | None = None,
    passkey: str | None = None,
    depths: int = 5,
    trials: int = 3,
    seed: int = 0,
    variant: str = "repeat",
    batch_size: int = 1,
):
    """The CapabilitySpec of comma-separated --tasks and --passkey lengths (e.g. "1k,2k"), None for none."""
    from attnkit.errors import UsageError
    from attnkit.scoring.capability import CapabilitySpec
    from attnkit.scoring.passkey import PasskeySpec
    from attnkit.scoring.tasks import TaskSpec
    from attnkit.units import parse_list, parse_tokens

    if tasks is None and (tasks_dir is not None or limit is not None or num_fewshot is not None):
        raise UsageError("a task folder, a limit or a few-shot count applies to tasks: give the tasks too")
    task_spec = (
        None if tasks is None else TaskSpec(tuple(parse_list(tasks, str)), tasks_dir, num_fewshot, limit, batch_size)
    )
    pass_spec = (
        None
        if passkey is None
        else PasskeySpec(tuple(parse_list(passkey, parse_tokens)), depths, trials, seed, variant)
    )
    return CapabilitySpec(task_spec, pass_spec)


def writes(*groups: dict, model_help: str = MODEL_HELP) -> Callable:
    """Decorator of a command that writes a checkpoint: MODEL and OUT go first, the groups' options and the output
    options last; the command receives their values as `shared` (a dict by parameter name)."""
    head = {
        "model": (str, typer.Argument(..., metavar="MODEL", help=model_help)),
        "out": (
            Path,
            typer.Argument(..., metavar="OUT", help="Output folder (must be empty or absent unless --overwrite)."),
        ),
    }
    tail = {name: spec for group in (*groups, OUTPUT) for name, spec in group.items()}

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "shared"]
        added = [
            inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation)
            for name, (annotation, default) in {**head, **tail}.items()
        ]

        @functools.wraps(fn)
        def command(**kwargs):
            shared = {name: kwargs.pop(name) for name in (*head, *tail)}
            return fn(**kwargs, shared=shared)

        command.__signature__ = inspect.Signature(
            [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in added[:2] + own] + added[2:]
        )
        return command

    return decorate


def request_fields(shared: dict) -> dict:
    """The WriteRequest / RewriteRequest / HealRequest keyword arguments of the shared values a command took."""
    import shlex

    from attnkit.units import parse_bytes

    fields = dict(
        model=shared["model"],
        out=shared["out"],
        overwrite=shared["overwrite"],
        dry_run=shared["dry_run"],
        max_shard_bytes=parse_bytes(shared["max_shard_size"], "--max-shard-size"),
        command=shlex.join(["attnkit", *sys.argv[1:]]),
    )
    if "device" in shared:
        fields["device"] = shared["device"]
    if "calib" in shared:
        fields.update(
            calib=list(shared["calib"]), calib_tokens=shared["calib_tokens"], calib_seq_len=shared["calib_seq_len"]
        )
    if "eval_files" in shared:
        fields["scoring"] = eval_options(shared)
    if "no_check" in shared:
        from attnkit.scoring.selfcheck import CheckOptions

        fields["check"] = CheckOptions(enabled=not shared["no_check"], max_loss=shared["max_loss"])
    return fields


def eval_options(shared: dict):
    """The EvalOptions of the EVAL, SAMPLES and CAPABILITY values a command took (defaults for a group it lacks)."""
    from attnkit.scoring.options import EvalOptions

    fields = dict(
        files=tuple(shared["eval_files"]),
        tokens=shared["eval_tokens"],
        seq_len=shared["eval_seq_len"],
        long_seq_len=shared["eval_long_seq_len"],
    )
    if shared.get("sample_prompts"):
        fields["sample_prompts"] = tuple(shared["sample_prompts"])
    if "eval_tasks" in shared:
        fields["capability"] = capability_spec(
            shared["eval_tasks"], shared["eval_tasks_dir"], limit=shared["eval_limit"], passkey=shared["eval_passkey"]
        )
    return EvalOptions(**fields)


def request_options(cls) -> Callable:
    """Decorator: the option fields of request dataclass `cls` (attnkit.option_fields) become the
    command's options, before the command's own parameters; the command
    receives their values as `options` (a dict by field name; text read by each field's parse)."""
    from attnkit.option_fields import flags

    hints = typing.get_type_hints(cls)
    fields = list(flags(cls))
    params = [_parameter(f, flag, hints[f.name]) for f, flag in fields]

    def decorate(fn: Callable) -> Callable:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "options"]

        @functools.wraps(fn)
        def command(**kwargs):
            options = {}
            for f, flag in fields:
                value = kwargs.pop(f.name)
                options[f.name] = flag.parse(value) if flag.parse is not None and value is not None else value
            return fn(**kwargs, options=options)

        command.__signature__ = inspect.Signature(
            params + [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own]
        )
        return command

    return decorate


def _parameter(f, flag, hint) -> inspect.Parameter:
    """The typer parameter of one option field: its flag(s), help and default; text where the field parses it."""
    import dataclasses

    if dataclasses.MISSING is not f.default:
        default = f.default
    elif dataclasses.MISSING is not f.default_factory:
        default = f.default_factory()
    else:
        default = ...
    names = [f"{flag.flag}/{flag.negative}" if flag.negative else flag.flag] + ([flag.short] if flag.short else [])
    option = typer.Option(default, *names, help=flag.help, show_default=not flag.hidden_default)
    annotation = Optional[str] if flag.parse is not None else _typer_type(hint)
    return inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation)


def _typer_type(hint):
    """A field's type as typer reads it: `X | None` as Optional[X], `list[X]` as List[X]."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (inner,) = [a for a in args if a is not type(None)]
        return Optional[_typer_type(inner)]
    if typing.get_origin(hint) is list:
        return List[args[0]]
    return hint
