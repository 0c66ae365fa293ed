"""The self-check: every rewrite scores the folder it wrote against its source before it reports success.

convert gqa|mqa|mla, retrofit softcap|qknorm|qkclip and heal run it by default (--no-check skips it). It scores
both models on held-out text in short windows and in one long window, the long one by distance of the predicted
token, and asks both for a few pass keys at the long window's length. The verdict holds the worst ratio of the
result's perplexity to the source's (the short windows' and every distance bucket's), how that ratio grows from
256-512 tokens of context to the longest bucket, and the pass keys each model found, against the rewrite's limit
(LIMITS; docs/check.md) and the user's --max-loss. Commands put it in the report and attnkit.json ("check") and
print it as the last line on stderr (attnkit.cli.output.print_check).

The text (CheckText, chosen by attnkit.commands.rewrite.self_check): the --eval text when given, else the
calibration text past the tokens the rewrite calibrated on, else attnkit's sample text (attnkit/data).
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

from attnkit.errors import UsageError

#: Tokens per short window, and short-window tokens scored in all.
SHORT_SEQ_LEN = 512
SHORT_TOKENS = 2048
#: Tokens of the long window (capped at the model's positions), scored by distance.
LONG_SEQ_LEN = 4096
#: Pass keys at the long window's length: one per depth, the "repeat" variant.
PASSKEY_DEPTHS = 3
#: The distance bucket the growth is measured from (its start), and the shortest long window that has buckets past it.
GROWTH_FROM = 256
GROWTH_MIN_LEN = 1024


@dataclass(frozen=True)
class Limit:
    """What a rewrite is held to: the worst perplexity ratio to the source (short windows and every distance bucket)
    and the most that ratio may grow from the 256-512 bucket to the longest one. `meant` names the kind of rewrite
    for the messages: exact, near-exact or lossy."""

    ratio: float
    growth: float
    meant: str


#: Per rewrite (attnkit.json's "operation"), the limit it is held to (docs/check.md says why each).
LIMITS = {
    "retrofit softcap": Limit(1.05, 1.15, "near-exact"),
    "retrofit qknorm": Limit(1.15, 1.15, "near-exact"),
    "retrofit qkclip": Limit(1.10, 1.15, "near-exact"),
    "convert gqa": Limit(1.5, 1.15, "lossy"),
    "convert mla": Limit(1.5, 1.15, "lossy"),
    "heal": Limit(1.5, 1.15, "lossy"),
}
#: The file of attnkit's own held-out sample text (CC0 English prose), used when a rewrite has no other text.
SAMPLE_TEXT = "sample.txt"


@dataclass(frozen=True)
class CheckOptions:
    """--no-check (enabled False) and --max-loss (exit 3 above it)."""

    enabled: bool = True
    max_loss: float | None = None


def check_options(opts: CheckOptions) -> None:
    """--max-loss is a ratio of at least 1 and goes with the check."""
    if opts.max_loss is None:
        return
    if not opts.enabled:
        raise UsageError("--max-loss holds the self-check's result to a limit: it cannot go with --no-check")
    if not opts.max_loss >= 1:  # also refuses NaN
        raise UsageError(f"--max-loss is a perplexity ratio to the source, at least 1 (e.g. 1.2), got {opts.max_loss}")


@dataclass(frozen=True)
class CheckText:
    """Where the check's windows come from: text files, the tokens of their stream to pass over (what the
    calibration read), and how the report names the text."""

    files: tuple[str, ...]
    skip: int = 0
    origin: str = "--eval"


@dataclass(frozen=True)
class SelfCheck:
    """What a rewrite checks its output on: the text (None: attnkit's sample text), its limit, the options."""

    text: CheckText | None
    limit: Limit
    options: CheckOptions


def sample_text() -> CheckText:
    """attnkit's own sample text (tests/data/prose/heldout.txt shipped as package data)."""
    path = resources.files("attnkit.data").joinpath(SAMPLE_TEXT)
    return CheckText((str(path),), 0, "attnkit's sample text")


def lengths(max_positions: int | None) -> tuple[int, int]:
    """(short window, long window) lengths, capped at the model's positions."""
    cap = max_positions or LONG_SEQ_LEN
    return min(SHORT_SEQ_LEN, cap), min(LONG_SEQ_LEN, cap)


def windows(tokenizer, text: CheckText | None, max_positions: int | None):
    """(the text used, short windows [N, S], the long window [1, L] or None). The --eval text is used as given
    (no long window when it holds none); calibration text past the calibration's tokens is used when it holds a
    long window, else attnkit's sample text is (`text` None: the sample text)."""
    from attnkit.errors import AttnkitError
    from attnkit.runtime.texts import make_windows, read_texts

    short_len, long_len = lengths(max_positions)

    def cut(chosen: CheckText):
        texts = read_texts(list(chosen.files))
        short = make_windows(tokenizer, texts, short_len, SHORT_TOKENS, skip=chosen.skip)
        try:
            long = make_windows(tokenizer, texts, long_len, long_len, skip=chosen.skip)
        except AttnkitError:
            long = None
        return short, long

    if text is not None and text.origin == "--eval":
        return (text, *cut(text))
    if text is not None:
        try:
            short, long = cut(text)
        except AttnkitError:
            long = None
        if long is not None:
            return text, short, long
    sample = sample_text()
    if text is not None:
        past = f" past the {text.skip:,} tokens calibrated on" if text.skip else ""
        reason = f"the --calib text holds no {long_len:,}-token window{past}"
        sample = CheckText(sample.files, 0, f"{sample.origin}: {reason}")
    return (sample, *cut(sample))


def run_check(
    source, result, text: CheckText | None, limit: Limit, opts: CheckOptions, *, passkeys: bool = True
) -> dict:
    """The check block of `result` against `source` (LoadedModel or LayerStreamed, in inference mode) on `text`:
    scores, verdict and what it cost. Pass keys need whole models (`passkeys` False skips them)."""
    import time

    from attnkit.errors import AttnkitError
    from attnkit.scoring.perplexity import evaluate

    started = time.perf_counter()
    config = source.model.config.get_text_config()
    positions = getattr(config, "max_position_embeddings", None)
    if source.tokenizer is None:
        return not_checked("the source has no tokenizer to turn text into tokens", limit, opts)
    try:
        text, short, long = windows(source.tokenizer, text, positions)
    except AttnkitError as exc:  # a tokenizer that makes almost nothing of any text
        return not_checked(f"no window of text to score: {exc}", limit, opts)
    res = evaluate(result, short, reference=source)
    block = {
        "text": {"origin": text.origin, "files": list(text.files), "skipped_tokens": text.skip},
        "short": {
            "seq_len": int(short.shape[1]),
            "windows": int(short.shape[0]),
            "source_perplexity": res.reference_perplexity,
            "perplexity": res.perplexity,
            "ratio": res.perplexity / res.reference_perplexity,
            "kl_mean": res.kl_mean,
            "top1_agreement": res.top1_agreement,
        },
        "long": None,
        "passkey": None,
    }
    if long is not None:
        rows = evaluate(result, long, reference=source, by_distance=True).by_distance
        block["long"] = {"seq_len": int(long.shape[1]), "by_distance": rows, "growth": growth(rows)}
    if passkeys and long is not None:
        block["passkey"] = _passkeys(source, result, int(long.shape[1]))
    block.update(verdict(block, limit, opts))
    block["seconds"] = time.perf_counter() - started
    return block


def not_checked(why: str, limit: Limit, opts: CheckOptions) -> dict:
    """The block of a check that could not run: every score null, the verdict says why."""
    return {
        "text": None,
        "short": None,
        "long": None,
        "passkey": None,
        "worst": None,
        "limit": {"ratio": limit.ratio, "growth": limit.growth, "meant": limit.meant},
        "max_loss": opts.max_loss,
        "verdict": "not checked",
        "problems": [why],
        "over_max_loss": opts.max_loss is not None,  # a limit that cannot be checked is not met
        "seconds": 0.0,
    }


def growth(rows: list[dict]) -> float | None:
    """The longest bucket's ratio over the ratio of the bucket that starts at GROWTH_FROM tokens; None when the
    window has no bucket past it or is shorter than GROWTH_MIN_LEN."""
    start = next((r for r in rows if r["start"] == GROWTH_FROM), None)
    if start is None or rows[-1]["end"] < GROWTH_MIN_LEN or rows[-1] is start:
        return None
    return rows[-1]["ratio"] / start["ratio"]


def _passkeys(source, result, length: int) -> dict | None:
    """Pass keys found by both models at `length` tokens (PASSKEY_DEPTHS depths, one key each); None where the
    window is shorter than a pass-key prompt can be."""
    from attnkit.scoring.passkey import PasskeySpec, run_passkey

    if length < 256:
        return None
    spec = PasskeySpec((length,), depths=PASSKEY_DEPTHS, trials=1, variant="repeat")
    found = {}
    for name, model in (("source", source), ("result", result)):
        scores = run_passkey(model, spec, name)
        found[name] = sum(c["correct"] for c in scores["cells"])
    return {"length": length, "keys": PASSKEY_DEPTHS, **found, "lost": lost_keys(found["source"], found["result"])}


def lost_keys(source: int, result: int) -> bool:
    """Whether the result lost pass keys: it finds fewer than half of those the source finds."""
    return source > 0 and result < source / 2


def worst(block: dict) -> dict:
    """{"where", "ratio"}: the short windows' ratio or the worst distance bucket's, whichever is larger."""
    out = {"where": f"{block['short']['seq_len']:,}-token windows", "ratio": block["short"]["ratio"]}
    for row in (block["long"] or {}).get("by_distance") or []:
        if row["ratio"] > out["ratio"]:
            out = {"where": f"{row['start']:,}-{row['end']:,} tokens of context", "ratio": row["ratio"]}
    return out


def verdict(block: dict, limit: Limit, opts: CheckOptions) -> dict:
    """The limit, the user's --max-loss and what the scores say against them: "ok", or the reasons the output is
    worse than the rewrite's limit ("problems"); "over_max_loss" when --max-loss is crossed."""
    top = worst(block)
    problems = []
    if top["ratio"] > limit.ratio:
        problems.append(f"perplexity x{top['ratio']:.3g} the source's at {top['where']} (limit x{limit.ratio:g})")
    grows = (block["long"] or {}).get("growth")
    if grows is not None and grows > limit.growth:
        problems.append(
            f"its ratio grows x{grows:.3g} from {GROWTH_FROM}-{2 * GROWTH_FROM} tokens of context to the longest "
            f"bucket (limit x{limit.growth:g})"
        )
    keys = block["passkey"]
    if keys is not None and keys["lost"]:
        problems.append(
            f"it finds {keys['result']} of {keys['keys']} pass keys at {keys['length']:,} tokens, the source "
            f"{keys['source']}"
        )
    over = opts.max_loss is not None and top["ratio"] > opts.max_loss
    return {
        "worst": top,
        "limit": {"ratio": limit.ratio, "growth": limit.growth, "meant": limit.meant},
        "max_loss": opts.max_loss,
        "verdict": "ok" if not problems else "worse than its limit",
        "problems": problems,
        "over_max_loss": over,
    }


def summary(block: dict, operation: str) -> str:
    """The check's line for stderr: the ratio, the worst place, the pass keys and the verdict."""
    if block["verdict"] == "not checked":
        return f"self-check: {operation}'s output is NOT checked: {block['problems'][0]}"
    s = block["short"]
    line = (
        f"self-check ({block['text']['origin']}): perplexity x{s['ratio']:.3f} the source's on "
        f"{s['windows'] * s['seq_len']:,} tokens; worst x{block['worst']['ratio']:.3f} at {block['worst']['where']}"
    )
    keys = block["passkey"]
    if keys is not None:
        line += f"; pass keys {keys['result']}/{keys['keys']} (source {keys['source']}/{keys['keys']})"
    if block["verdict"] == "ok":
        return line + f"; within {operation}'s limit x{block['limit']['ratio']:g}"
    return line + f"; WORSE than {operation}'s limit: " + "; ".join(block["problems"])
