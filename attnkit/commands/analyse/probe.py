"""`attnkit probe`: attention statistics of models on text windows, per layer and head
(attnkit.scoring.attention_stats), the command's orchestration (`run_probe`: checks before any model loads, then
each model in turn, output files, --fail-if rules of attnkit.commands.analyse.probe_rules)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from attnkit.commands.analyse.probe_report import PLOT_SUFFIXES, TABLE_SUFFIXES, check_output_path, plot, write_table
from attnkit.commands.analyse.probe_rules import max_logit_limit, parse_rule
from attnkit.errors import UsageError
from attnkit.runtime import make_windows
from attnkit.runtime.layerwise import check_run_options, open_model
from attnkit.runtime.loader import check_models
from attnkit.runtime.texts import check_text_files, check_window_options, read_texts
from attnkit.scoring.attention_stats import ProbeResult, probe
from attnkit.units import MAX_COUNT, check_bounds


@dataclass(kw_only=True)
class ProbeRequest:
    """attnkit probe: the models, the text, how it is cut and run, the thresholds and output files."""

    models: list[str]
    texts: list[str] = field(default_factory=list)
    text: str | None = None
    seq_len: int = 512
    max_tokens: int | None = None
    batch_size: int = 1
    threshold: float = 100.0
    z_lambda: float = 1e-4
    fail_if: list[str] = field(default_factory=list)
    out: str | None = None
    plot: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    layer_stream: str = "auto"  # auto | always | never (attnkit.runtime.layerwise)
    device_map: str | None = None  # auto: accelerate places the model over the GPUs


def check_request(req: ProbeRequest):
    """Options, rules, output paths, text files and every model, before the first model loads; returns
    (rules, text inputs, the models' opened Sources)."""

    if not req.models:
        raise UsageError("give at least one model")
    rules = [parse_rule(r) for r in req.fail_if]
    check_window_options(req.seq_len, req.max_tokens)
    check_bounds("--batch-size", req.batch_size, 1, MAX_COUNT)
    check_bounds("--threshold", req.threshold)
    check_bounds("--z-lambda", req.z_lambda, 0)
    check_run_options(req.layer_stream, req.device_map)
    for path, option, suffixes in ((req.out, "--out", TABLE_SUFFIXES), (req.plot, "--plot", PLOT_SUFFIXES)):
        if path:
            check_output_path(path, option, suffixes)
    check_text_files(req.texts)
    texts = read_texts(req.texts, req.text)
    sources = check_models(req.models, req.device, req.dtype, req.layer_stream)
    return rules, texts, sources


def run_probe(req: ProbeRequest, log: Callable[[str], None] = lambda message: None) -> tuple[list[ProbeResult], list]:
    """Probe every model on the same text (one loaded at a time), write --out and --plot; returns the results and
    the --fail-if rules, which the caller checks once the results are shown (check_rules)."""

    rules, texts, sources = check_request(req)
    results = []
    for ref, source in zip(req.models, sources):
        loaded = open_model(
            source, device=req.device, dtype=req.dtype, layer_stream=req.layer_stream, device_map=req.device_map
        )
        windows = make_windows(loaded.tokenizer, texts, req.seq_len, req.max_tokens)
        log(f"probing {ref}: {windows.shape[0]} window(s) of {req.seq_len} tokens")
        results.append(
            probe(loaded, windows, threshold=req.threshold, z_lambda=req.z_lambda, batch_size=req.batch_size, name=ref)
        )
        del loaded
    if req.out:
        write_table(results, req.out)
    if req.plot:
        plot(results, req.plot, limit=max_logit_limit(rules))
    return results, rules
