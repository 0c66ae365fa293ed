"""Run a Hugging Face folder in llama.cpp with its own tools: convert_hf_to_gguf.py, llama-perplexity, llama-completion.

Found in a llama.cpp tree (--llama-cpp DIR or $ATTNKIT_LLAMA_CPP: convert_hf_to_gguf.py at its top, the
binaries in build/bin or bin), or on PATH. Perplexity is scored on token ids given by the caller, through
llama-perplexity's --kl-divergence mode: a base file written here carries the ids (and the reference
log-probabilities it diffs against), so both sides score exactly the same tokens. Greedy completion takes a
prompt text; llama-completion prints the prompt's token ids (--verbose-prompt) and the continuation's text.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import subprocess
from dataclasses import dataclass
from pathlib import Path

from attnkit.errors import AttnkitError

BINARIES = ("llama-completion", "llama-perplexity")
CONVERTER = "convert_hf_to_gguf.py"


@dataclass(frozen=True)
class LlamaCpp:
    """The llama.cpp tools and the Python that runs the converter (needs torch, transformers, sentencepiece)."""

    converter: Path
    completion: Path
    perplexity: Path
    python: str
    bench: Path | None = None  # llama-bench, where it is built (decode speed)

    def env(self) -> dict:
        """The converter's environment: the tree's own gguf-py ahead of any installed gguf."""
        env = dict(os.environ)
        gguf_py = self.converter.parent / "gguf-py"
        if gguf_py.is_dir():
            env["PYTHONPATH"] = os.pathsep.join([str(gguf_py), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env


def find_llama_cpp(folder: str | None, python: str) -> LlamaCpp | str:
    """The tools in `folder` (or $ATTNKIT_LLAMA_CPP, or PATH); a one-line reason when they are not there."""
    root = folder or os.environ.get("ATTNKIT_LLAMA_CPP")
    if root:
        base = Path(root).expanduser()
        converter = base / CONVERTER
        bins = {}
        for name in BINARIES:
            found = [p for p in (base / "build" / "bin" / name, base / "bin" / name, base / name) if p.is_file()]
            bins[name] = found[0] if found else None
        where = f"in {base}"
    else:
        which = shutil.which(CONVERTER)
        converter = Path(which) if which else None
        bins = {name: Path(p) if (p := shutil.which(name)) else None for name in BINARIES}
        where = "on PATH (pass --llama-cpp DIR, a llama.cpp tree with a build)"
    missing = [name for name, path in bins.items() if path is None]
    if converter is None or not converter.is_file():
        missing.insert(0, CONVERTER)
    if missing:
        return f"{', '.join(missing)} not found {where}"
    bench = next((p for p in (converter.parent / "build" / "bin" / "llama-bench",) if p.is_file()), None)
    if bench is None and shutil.which("llama-bench"):
        bench = Path(shutil.which("llama-bench"))
    return LlamaCpp(converter, bins["llama-completion"], bins["llama-perplexity"], python, bench)


def _run(cmd: list[str], what: str, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(
            cmd, capture_output=True, encoding="utf-8", errors="replace", timeout=timeout, env=env
        )  # a continuation may end inside a UTF-8 character
    except subprocess.TimeoutExpired:
        raise AttnkitError(f"llama.cpp {what} did not finish in {timeout:.0f}s") from None
    if proc.returncode != 0:
        tail = " | ".join(line for line in (proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise AttnkitError(f"llama.cpp {what} failed (exit {proc.returncode}): {tail}")
    return proc


def convert(tools: LlamaCpp, folder: Path, gguf: Path, timeout: float = 1800) -> None:
    """convert_hf_to_gguf.py FOLDER --outtype f32 --outfile GGUF."""
    _run(
        [tools.python, str(tools.converter), str(folder), "--outtype", "f32", "--outfile", str(gguf)],
        "convert_hf_to_gguf.py",
        timeout,
        tools.env(),
    )


def added_bos(gguf: Path) -> int | None:
    """The BOS id llama.cpp puts in front of every prompt and perplexity chunk of this GGUF, or None when it adds
    none (tokenizer.ggml.add_bos_token; absent: none for the BPE vocabularies the converter writes)."""
    from attnkit.io.gguf_header import parse_gguf_header

    fields = parse_gguf_header(gguf).fields
    if not fields.get("tokenizer.ggml.add_bos_token", False):
        return None
    return int(fields.get("tokenizer.ggml.bos_token_id", -1))


def write_kld_base(path: Path, tokens: list[int], n_ctx: int, vocab: int, chunk_logits) -> None:
    """llama-perplexity's --kl-divergence-base file: header, the token ids, then for each chunk the scored rows
    (positions n_ctx/2 .. n_ctx-2) as uint16 log-probabilities over the top 16 log-units.

    chunk_logits: an iterable of float arrays [n_ctx - 1 - n_ctx // 2, vocab], one per chunk."""
    import numpy as np

    n_chunk = len(tokens) // n_ctx
    width = 2 * ((vocab + 1) // 2) + 4
    with open(path, "wb") as fh:
        fh.write(b"_logits_")
        fh.write(struct.pack("<Iii", n_ctx, vocab, n_chunk))
        fh.write(np.asarray(tokens[: n_chunk * n_ctx], dtype=np.int32).tobytes())
        for rows in chunk_logits:
            rows = np.asarray(rows, dtype=np.float32)
            top = rows.max(axis=1, keepdims=True)
            lse = np.log(np.exp(rows - top).sum(axis=1, keepdims=True))
            low = np.maximum(rows.min(axis=1, keepdims=True), top - 16)
            scale = (top - low) / 65535.0
            q = np.where(rows > low, np.rint((rows - low) / np.where(scale > 0, scale, 1)), 0).astype(np.uint16)
            out = np.zeros((rows.shape[0], width), dtype=np.uint16)
            header = np.concatenate([scale, low - top - lse], axis=1).astype(np.float32)  # [rows, 2]
            out[:, :4] = header.view(np.uint16)
            out[:, 4 : 4 + vocab] = q
            fh.write(out.tobytes())


_FLOAT = r"([-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)"


def perplexity(tools: LlamaCpp, gguf: Path, base: Path, n_ctx: int, threads: int, timeout: float = 1800) -> dict:
    """Score the base file's tokens: llama.cpp's perplexity, the base's, mean KL and same-top-1 share."""
    proc = _run(
        [
            str(tools.perplexity),
            "-m",
            str(gguf),
            "--kl-divergence-base",
            str(base),
            "--kl-divergence",
            "-c",
            str(n_ctx),
            "-b",
            str(n_ctx),
            "-t",
            str(threads),
            "--no-warmup",
        ],
        "llama-perplexity",
        timeout,
    )
    log = proc.stdout + proc.stderr

    def grab(label: str) -> float:
        found = re.search(re.escape(label) + r"\s*:\s*" + _FLOAT, log)
        if not found:
            raise AttnkitError(f"llama-perplexity printed no '{label}' line")
        return float(found.group(1))

    return {
        "perplexity": grab("Mean PPL(Q)"),
        "base_perplexity": grab("Mean PPL(base)"),
        "kl_mean": grab("Mean    KLD"),
        "same_top1": grab("Same top p") / 100.0,
    }


def complete(
    tools: LlamaCpp, gguf: Path, prompt: str, new_tokens: int, n_ctx: int, threads: int, timeout: float = 600
) -> tuple[list[int], str]:
    """(prompt token ids as llama.cpp tokenized them, greedy continuation text) for `prompt`."""
    proc = _run(
        [
            str(tools.completion),
            "-m",
            str(gguf),
            "-p",
            prompt,
            "-n",
            str(new_tokens),
            "--temp",
            "0",
            "-no-cnv",
            "--no-warmup",
            "--ignore-eos",
            "-s",
            "1",
            "-t",
            str(threads),
            "-c",
            str(n_ctx),
            "--no-display-prompt",
            "--verbose-prompt",
            "--no-escape",
            "-sp",
        ],
        "llama-completion",
        timeout,
    )
    ids = [int(m.group(1)) for m in re.finditer(r"^(?:\S+ I)?\s*(\d+) -> '", proc.stderr, flags=re.M)]
    text = proc.stdout
    return ids, text[:-2] if text.endswith("\n\n") else text  # it ends its output with a blank line


def nll_to_perplexity(nll: list[float]) -> float:
    return math.exp(sum(nll) / len(nll))


#: One cache's line in llama.cpp's log (src/llama-kv-cache.cpp), e.g. "llama_kv_cache: size =   12.00 MiB (  4096
#: cells,   3 layers,  1/1 seqs), K (f16):    6.00 MiB, V (f16):    6.00 MiB" (a sliding-window model prints two).
KV_LINE = re.compile(
    r"llama_kv_cache: size = *([0-9.]+) MiB \( *(\d+) cells, *(\d+) layers, *(\d+)/(\d+) seqs\), "
    r"K \((\w+)\): *([0-9.]+) MiB, V \((\w+)\): *([0-9.]+) MiB"
)


def kv_allocation(tools: LlamaCpp, gguf: Path, n_ctx: int, args: tuple[str, ...] = (), timeout: float = 600) -> dict:
    """The KV cache llama.cpp allocates for `gguf` at `-c n_ctx` (its own log, read at the library's INFO level:
    llama-completion -lv 4, no token generated): {"mib": the total, rounded per cache to 0.01 MiB as printed,
    "caches": [{"mib", "cells", "layers", "k_type", "v_mib"}]}; `args`: more llama-completion arguments (-ub,
    --swa-full, -ctk/-ctv)."""
    cmd = [str(tools.completion), "-m", str(gguf), "-c", str(n_ctx), "-n", "0", "-p", "a", "-t", "1", "-no-cnv"]
    cmd += ["--no-warmup", "-fit", "off", "-lv", "4", "--no-log-prefix", "--no-log-timestamps", *args]
    proc = _run(cmd, "llama-completion", timeout)
    caches = [
        {"mib": float(m[1]), "cells": int(m[2]), "layers": int(m[3]), "k_type": m[6], "v_mib": float(m[9])}
        for m in KV_LINE.finditer(proc.stderr)
    ]
    if not caches:
        raise AttnkitError(f"llama.cpp printed no KV cache size for {gguf} (-lv 4)")
    return {"mib": sum(c["mib"] for c in caches), "caches": caches}


#: llama-bench -fa values: auto (its default: on for a CPU-only build), on, off.
FLASH_ATTN = ("auto", "on", "off")


def decode_speed(
    tools: LlamaCpp,
    gguf: Path,
    depths: list[int],
    n_gen: int = 32,
    repetitions: int = 3,
    threads: int = 2,
    flash_attn: str = "auto",
) -> dict[int, float]:
    """Decode tokens/s at each context depth (llama-bench -p 0 -n n_gen -d depth -fa flash_attn: n_gen tokens
    generated after `depth` tokens already in the cache, the mean of `repetitions` runs), by depth."""
    if tools.bench is None:
        raise AttnkitError("llama-bench is not built in this llama.cpp tree (source .ci/engines.sh builds it)")
    cmd = [str(tools.bench), "-m", str(gguf), "-p", "0", "-n", str(n_gen), "-d", ",".join(map(str, depths))]
    cmd += ["-r", str(repetitions), "-t", str(threads), "-fa", flash_attn, "-o", "json"]
    runs = json.loads(_run(cmd, "llama-bench", 3600).stdout)
    return {int(r["n_depth"]): float(r["avg_ts"]) for r in runs}
