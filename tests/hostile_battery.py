"""The hostile-user battery of issue 12, rerun: bad CLI inputs, mutated metadata in-process, signals on SmolLM2.

Usage: python -m tests.hostile_battery [--parts readers,cli,classes,signals,gguf-signals] [--headers N]
                                        [--index N] [--gguf N] [--seed S]
  (default parts: readers, cli, classes, signals)
  cli      about 340 bad inputs through the CLI (in-process, typer's runner) on tiny checkpoints: damaged
           configs, headers, indexes and texts, missing tensors, bad option values, outputs inside inputs.
  headers  N mutated safetensors files through io.safetensors_header.read_header (default 25,120), each
           also given to the safetensors library: "lax" counts files we accept and it refuses.
  index    N mutated model.safetensors.index.json through io.checkpoint.safetensors_files (default 3,000).
  gguf     N mutated GGUF headers through io.gguf_meta.read_gguf (default 3,000).
  classes  the classes of bad input of issue 21, several files each, through the CLI: non-finite weights, a
           tiny token budget over a large text (peak RSS of a subprocess against the same run on a small text),
           a full disk (a 1 MiB tmpfs, where this machine lets root mount one) and an output place that cannot
           work, options that must be checked before loading, config values and weights that cannot be right,
           GGUF tensors missing, twice, misaligned or misshapen, FIFOs and symlink loops, unbounded numbers,
           and library errors (hub ids, degenerate calibration text).
  signals  `convert mqa --method mean` on SmolLM2-135M (fp32 folder, attnkit/realmodels.py) in a subprocess:
           SIGTERM at four moments (during the checks and reads, while the shard is written, after the
           weights, just before the rename), SIGINT and SIGHUP, and SIGKILL at two moments, each followed
           by a clean run that must remove what the killed one left.
  gguf-signals  SIGTERM, and SIGKILL then a clean run, while the dequantized SmolLM2 GGUF is written into
           a fresh cache (slower: each run dequantizes SmolLM2).
Prints per part and in all: cases, ok (accepted / exit 0), clean errors (attnkit's one line, exit 1 or 2, or
143/130/129 after a signal), crashes (tracebacks, exceptions other than AttnkitError, more than one line,
other exit codes), inputs modified and leftovers (.attnkit-tmp/old/del folders or files after the case).
Everything runs offline (HF_HUB_OFFLINE=1) in a temp folder that is removed at the end. Run it from the
repository root: it builds its inputs with the test suite's tiny checkpoints and mutators (tests/tiny.py,
tests/helpers.py, tests/hostile.py), so it lives beside them; pytest does not collect it (a check, not a test).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

from tests import hostile  # noqa: E402

LEFTOVER_TAGS = (".attnkit-tmp-", ".attnkit-old-", ".attnkit-del-")


class Tally:
    """Counts per part: cases, ok, clean, crash, modified, leftovers; keeps the first crash descriptions."""

    def __init__(self):
        self.parts: dict[str, Counter] = {}
        self.crashes: list[str] = []

    def add(self, part: str, outcome: str, detail: str = "", modified: bool = False, leftovers: int = 0) -> None:
        c = self.parts.setdefault(part, Counter())
        c["cases"] += 1
        c[outcome] += 1
        c["inputs modified"] += int(modified)
        c["leftovers"] += leftovers
        if outcome == "crash" and len(self.crashes) < 30:
            self.crashes.append(f"[{part}] {detail}")

    def report(self) -> str:
        keys = ["cases", "ok", "clean", "crash", "inputs modified", "leftovers", "lax", "strict"]
        rows = [(name, c) for name, c in self.parts.items()] + [("total", sum(self.parts.values(), Counter()))]
        lines = [
            "| part | " + " | ".join(k if k != "clean" else "clean errors" for k in keys) + " |",
            "|---|" + "---:|" * len(keys),
        ]
        lines += [f"| {name} | " + " | ".join(f"{c[k]:,}" for k in keys) + " |" for name, c in rows]
        if self.crashes:
            lines += ["", "crashes:"] + [f"- {c}" for c in self.crashes]
        return "\n".join(lines)


def leftovers(*roots: Path) -> list[Path]:
    found = []
    for root in roots:
        if root.exists():
            found += [p for p in root.rglob("*") if any(t in p.name for t in LEFTOVER_TAGS)]
    return found


def digest(folder: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(folder.rglob("*")):
        h.update(str(p.relative_to(folder)).encode())
        if p.is_file() and not p.is_symlink():
            h.update(p.read_bytes())
    return h.hexdigest()


def stat_digest(folder: Path) -> tuple:
    """Names, sizes and mtimes: enough to see a change to a large checkpoint without reading it."""
    return tuple(
        (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))
    )


# ------------------------------------------------------------------ in-process readers


def run_reader(fn) -> tuple[str, str]:
    from attnkit.errors import AttnkitError

    try:
        fn()
    except AttnkitError:
        return "clean", ""
    except Exception as exc:  # noqa: BLE001 - what the battery counts
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return "crash", f"{type(exc).__name__} in {frame.name} ({Path(frame.filename).name}:{frame.lineno}): {exc}"[
            :300
        ]
    return "ok", ""


def readers(tally: Tally, work: Path, n_headers: int, n_index: int, n_gguf: int, seed: int) -> None:
    from safetensors import safe_open

    from attnkit.io.checkpoint import INDEX_NAME, safetensors_files
    from attnkit.io.gguf_meta import read_gguf
    from attnkit.io.safetensors_header import read_header

    rng = random.Random(seed)
    folder = work / "readers"
    folder.mkdir()
    path = folder / "model.safetensors"
    for _ in range(n_headers):
        path.write_bytes(hostile.mutate_safetensors(rng))
        outcome, detail = run_reader(lambda: read_header(path))
        tally.add("safetensors headers", outcome, detail)
        try:
            with safe_open(str(path), framework="np"):
                library = True
        except Exception:  # noqa: BLE001 - the library's verdict
            library = False
        c = tally.parts["safetensors headers"]
        c["lax"] += int(outcome == "ok" and not library)
        c["strict"] += int(outcome == "clean" and library)
    path.unlink(missing_ok=True)
    for shard in hostile.SHARDS:
        (folder / shard).write_bytes(hostile.safetensors_bytes(hostile.safetensors_header()))
    for _ in range(n_index):
        (folder / INDEX_NAME).write_bytes(hostile.mutate_index(rng))
        tally.add("index JSON", *run_reader(lambda: safetensors_files(folder)))
    gguf = folder / "model.gguf"
    for _ in range(n_gguf):
        gguf.write_bytes(hostile.mutate_gguf(rng))
        tally.add("GGUF headers", *run_reader(lambda: read_gguf(gguf)))


# ------------------------------------------------------------------ CLI


def cli_outcome(result) -> tuple[str, str]:
    """ok / clean / crash for one CliRunner result."""
    stderr = result.stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        return "crash", f"{type(result.exception).__name__}: {result.exception}"[:300]
    if "Traceback" in result.output or "set ATTNKIT_DEBUG=1 for the traceback" in stderr:
        return "crash", (errors or [stderr.strip()[-300:]])[-1][:300]
    if result.exit_code == 0:
        return "ok", ""
    if result.exit_code in (1, 2) and len(errors) == 1:
        return "clean", ""
    if result.exit_code == 2 and "--help' for help." in stderr:  # typer's own usage message (bad option value)
        return "clean", ""
    return "crash", f"exit {result.exit_code}: {stderr.strip()[-300:]}"


def cli_cases(work: Path) -> tuple[list[tuple[str, list[str]]], list[Path]]:
    """(label, argv) cases and the input folders whose contents must never change."""
    from safetensors.torch import load_file, save_file

    from tests.helpers import PROSE, char_tokenizer
    from tests.tiny import make_checkpoint

    inputs = work / "inputs"
    inputs.mkdir()
    good = char_tokenizer(make_checkpoint(inputs / "good", "llama_gqa"))
    sharded = char_tokenizer(make_checkpoint(inputs / "sharded", "llama_gqa", max_shard_size="100KB"))
    texts = inputs / "texts"
    texts.mkdir()
    (texts / "good.txt").write_text(PROSE * 8)
    (texts / "binary.txt").write_bytes(b"\x7fELF\0\0\0\x01" * 64)
    (texts / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (texts / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    (texts / "deep.jsonl").write_bytes(b"[" * 100000 + b"\n")
    (texts / "bigint.jsonl").write_bytes(b'{"text": ' + b"9" * 5000 + b"}\n")
    (texts / "empty.txt").write_text("")
    (texts / "folder.txt").mkdir()
    gguf = inputs / "tiny.gguf"
    gguf.write_bytes(hostile.gguf_bytes(hostile.gguf_fields(), hostile.gguf_tensors()))

    def variant(name: str, edit) -> Path:
        folder = inputs / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def config_edit(**changes):
        def edit(folder):
            config = json.loads((folder / "config.json").read_text())
            config.update(changes)
            (folder / "config.json").write_text(json.dumps(config))

        return edit

    def drop(*names):
        def edit(folder):
            state = load_file(folder / "model.safetensors")
            for n in names:
                del state[n]
            save_file(state, folder / "model.safetensors", metadata={"format": "pt"})

        return edit

    def raw(name, data: bytes):
        return lambda folder: (folder / name).write_bytes(data)

    models = [good]
    for i, changes in enumerate(
        [
            {"num_hidden_layers": -2},
            {"num_attention_heads": 8.5},
            {"num_key_value_heads": 0},
            {"num_key_value_heads": [8]},
            {"num_hidden_layers": 50_000_000},
            {"hidden_size": "64"},
            {"num_key_value_heads": 3},
            {"num_key_value_heads": 4},
            {"head_dim": 0},
            {"vocab_size": -1},
            {"rope_parameters": {"rope_type": "default", "rope_theta": "x"}},
            {"tie_word_embeddings": "no"},
            {"model_type": ["llama"]},
            {"model_type": "falcon9"},
            {"max_position_embeddings": 2**80},
        ]
    ):
        models.append(variant(f"config{i}", config_edit(**changes)))
    models.append(variant("config-latin1", raw("config.json", b'{"model_type": "ll\xe9ama"}')))
    models.append(variant("config-list", raw("config.json", b"[1, 2]")))
    models.append(variant("config-deep", raw("config.json", b"[" * 100000)))
    for i, names in enumerate(
        [
            ["model.norm.weight"],
            ["model.layers.1.mlp.down_proj.weight"],
            ["model.layers.0.input_layernorm.weight", "model.layers.1.post_attention_layernorm.weight"],
            ["lm_head.weight"],
            ["model.layers.0.self_attn.k_proj.weight"],
        ]
    ):
        models.append(variant(f"missing{i}", drop(*names)))
    rng = random.Random(7)
    for i in range(12):
        models.append(variant(f"header{i}", raw("model.safetensors", hostile.mutate_safetensors(rng))))
    for i in range(6):
        folder = inputs / f"index{i}"
        shutil.copytree(sharded, folder)
        (folder / "model.safetensors.index.json").write_bytes(hostile.mutate_index(rng))
        models.append(folder)
    leave_out = inputs / "index-leaves-out-a-shard"
    shutil.copytree(sharded, leave_out)
    index = json.loads((leave_out / "model.safetensors.index.json").read_text())
    last = sorted(set(index["weight_map"].values()))[-1]
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != last}
    (leave_out / "model.safetensors.index.json").write_text(json.dumps(index))
    models.append(leave_out)
    escape = inputs / "index-escape"
    shutil.copytree(sharded, escape)
    index = json.loads((escape / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.norm.weight"] = "../../../../etc/passwd"
    (escape / "model.safetensors.index.json").write_text(json.dumps(index))
    models.append(escape)

    out = work / "out"
    txt = str(texts / "good.txt")
    cases: list[tuple[str, list[str]]] = []
    for m in models:
        cases += [
            (f"{m.name}: inspect", ["inspect", str(m)]),
            (f"{m.name}: kvmem", ["kvmem", str(m), "--context", "4k"]),
            (f"{m.name}: convert mqa", ["convert", "mqa", str(m), str(out / f"{m.name}-mqa")]),
            (
                f"{m.name}: retrofit softcap",
                ["retrofit", "softcap", str(m), str(out / f"{m.name}-cap"), "--attn-cap", "30"],
            ),
            (f"{m.name}: eval", ["eval", str(m), txt, "--seq-len", "64"]),
        ]
    for name in (
        "binary.txt",
        "latin1.txt",
        "latin1.jsonl",
        "deep.jsonl",
        "bigint.jsonl",
        "empty.txt",
        "folder.txt",
        "absent.txt",
    ):
        t = str(texts / name)
        cases += [
            (f"text {name}: eval", ["eval", str(good), t]),
            (f"text {name}: probe", ["probe", str(good), t]),
            (
                f"text {name}: --calib",
                ["convert", "mqa", str(good), str(out / "calib"), "--method", "merge", "--calib", t],
            ),
            (f"text {name}: --eval", ["convert", "mqa", str(good), str(out / "ev"), "--eval", t]),
        ]
    g, k8b = str(good), "llama-3.1-8b"
    options = [
        ["kvmem", k8b, "--context", c]
        for c in [
            "99999999999999999999999k",
            "9" * 5000,
            "-4k",
            "0",
            "1.5",
            "abc",
            "",
            ",",
            "4k,,",
            "nan",
            "inf",
            "1e9",
        ]
    ]
    options += [["kvmem", k8b, "--batch", b] for b in ["0", "-1", "9" * 5000, "1.5", "x"]]
    options += [["kvmem", k8b, "--dtype", d] for d in ["bf17", "", "fp8,,int3"]]
    options += [
        ["kvmem", k8b, "--variant", v]
        for v in ["gqa:0", "gqa:abc", "gqa:-8", "mla:1e9+3", "mla:5", "mla:a+b", "mqa:2", "gqa:3", "gqa:" + "9" * 30]
    ]
    options += [["kvmem", k8b, "--gpu-mem", m] for m in ["0", "-80GiB", "80XB", "1e400GiB", "9" * 400 + "GiB"]]
    options += [
        ["kvmem", k8b, "--gpu-mem", "80GiB", "--tp", "0"],
        ["kvmem", k8b, "--tp", "2"],
        ["kvmem", k8b, "--weight-dtype", "int3"],
        ["kvmem", str(gguf)],
        ["inspect", str(gguf)],
    ]
    options += [["convert", "gqa", g, str(out / "g"), "--kv-heads", k] for k in ["0", "-1", "3", "99"]]
    merge = ["--method", "merge", "--calib", txt]
    options += [
        ["convert", "mqa", g, str(out / "d"), "--device", "tpu9"],
        ["convert", "mqa", g, str(out / "d"), *merge, "--device", "cuda:99"],
        ["convert", "mqa", g, str(out / "s"), "--max-shard-size", "0"],
        ["convert", "mqa", g, str(out / "s"), "--max-shard-size", "-1GiB"],
        ["convert", "mqa", g, str(out / "s"), *merge, "--calib-tokens", "10", "--calib-seq-len", "512"],
        ["convert", "mqa", g, str(out / "s"), *merge, "--calib-seq-len", "100000", "--calib-tokens", "100000"],
        ["convert", "mqa", g, str(out / "s"), "--o-refit", "-1"],
        ["convert", "mqa", g, str(out / "s"), "--key-weight", "both"],
        ["convert", "mla", g, str(out / "mla"), "--kv-budget", "2", "--calib", txt],
        ["convert", "mla", g, str(out / "mla"), "--kv-lora-rank", "1", "--rope-dim", "3", "--calib", txt],
        ["convert", "mqa", g, g],
        ["convert", "mqa", g, str(good / "sub")],
        ["convert", "mqa", g, str(good / "a/b")],
        ["convert", "mqa", str(good / "model.safetensors"), str(good / "x")],
        ["convert", "mqa", g, str(good.parent), "--overwrite"],
        ["convert", "mqa", g, str(texts / "good.txt")],
        ["retrofit", "softcap", g, str(good / "a" / "b"), "--attn-cap", "30"],
    ]
    options += [["retrofit", "softcap", g, str(out / "c"), "--attn-cap", c] for c in ["0", "-3", "nan", "inf", "abc"]]
    options += [
        ["eval", g, txt, "--dtype", "bf16"],
        ["eval", g, txt, "--device", "tpu9"],
        ["eval", g, txt, "--seq-len", "1"],
        ["eval", g, txt, "--seq-len", "0"],
        ["eval", g, txt, "--max-tokens", "1"],
        ["eval", g, txt, "--batch-size", "0"],
        ["probe", g, txt, "--out", str(out / "stats.txt")],
        ["probe", g, txt, "--plot", str(out / "p.bmpx")],
        ["probe", g, txt, "--out", str(texts / "good.txt") + "/x.csv"],
        ["probe", g, txt, "--fail-if", "max_logit>>3"],
        ["probe", g, txt, "--fail-if", "nonsense"],
        ["probe", g, txt, "--top", "-1"],
        ["inspect", str(work / "absent")],
        ["inspect", "./absent.gguf"],
        ["inspect", "not a model!"],
        ["inspect", "acme/not-cached"],
        ["inspect", "acme/not-cached@v9"],
        ["eval", "acme/not-cached", txt],
        ["inspect", str(texts / "good.txt")],
        ["inspect", str(texts / "folder.txt")],
        ["inspect", str(good / "config.json")],
        ["eval", str(good / "config.json"), txt],
    ]
    cases += [(" ".join(a)[:80], a) for a in options]
    return cases, [inputs]


def cli(tally: Tally, work: Path) -> None:
    from typer.testing import CliRunner

    from attnkit.cli import app

    cases, inputs = cli_cases(work)
    before = {folder: digest(folder) for folder in inputs}
    runner = CliRunner()
    for label, argv in cases:
        result = runner.invoke(app, argv)
        outcome, detail = cli_outcome(result)
        modified = any(digest(folder) != before[folder] for folder in inputs)
        if modified:
            before = {folder: digest(folder) for folder in inputs}
        left = leftovers(work)
        for path in left:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        tally.add("CLI bad inputs", outcome, f"{label}: {detail}", modified, len(left))
        if modified or left:
            print(f"{label}: inputs modified {modified}, leftovers {[p.name for p in left]}", file=sys.stderr)
        shutil.rmtree(work / "out", ignore_errors=True)


# ------------------------------------------------------------------ classes (issue 21)


def class_cases(work: Path) -> tuple[list[tuple[str, list[str], dict]], list[Path]]:
    """(label, argv, environment) cases of every class, and the input folders that must never change."""
    import torch
    from safetensors.torch import load_file, save_file

    from tests.helpers import PROSE, tiny_source

    inputs = work / "class-inputs"
    inputs.mkdir()
    good = tiny_source(inputs, "llama_gqa")
    text = inputs / "text.txt"
    text.write_text(PROSE * 12)
    txt, out = str(text), work / "out"

    def variant(name: str, edit) -> Path:
        folder = inputs / name
        shutil.copytree(good, folder)
        edit(folder)
        return folder

    def tensor(name, fn):
        def edit(folder):
            state = load_file(str(folder / "model.safetensors"))
            state[name] = fn(state[name])
            save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})

        return edit

    def config(**changes):
        def edit(folder):
            doc = json.loads((folder / "config.json").read_text())
            doc.update(changes)
            (folder / "config.json").write_text(json.dumps(doc))

        return edit

    def special(name, make):
        def edit(folder):
            (folder / name).unlink()
            make(folder / name)

        return edit

    bad_models = [
        variant(
            "nan-mlp",
            tensor("model.layers.1.mlp.down_proj.weight", lambda t: t.index_fill(0, torch.tensor([3]), float("nan"))),
        ),
        variant(
            "inf-embed", tensor("model.embed_tokens.weight", lambda t: t.index_fill(0, torch.tensor([9]), float("inf")))
        ),
        variant("nan-attention", tensor("model.layers.0.self_attn.q_proj.weight", lambda t: t * float("nan"))),
        variant("rope-unknown", config(rope_parameters={"rope_type": "warp9", "rope_theta": 10000.0})),
        variant(
            "rope-negative", config(rope_parameters={"rope_type": "linear", "factor": -2.0, "rope_theta": 10000.0})
        ),
        variant("int-weights", tensor("model.layers.0.self_attn.q_proj.weight", lambda t: t.to(torch.int32))),
        variant("short-embed", tensor("model.embed_tokens.weight", lambda t: t[:-3])),
        variant("fifo-config", special("config.json", os.mkfifo)),
        variant("fifo-weights", special("model.safetensors", os.mkfifo)),
        variant("loop-tokenizer", special("tokenizer.json", lambda p: p.symlink_to(p.name))),
        variant("loop-config", special("config.json", lambda p: p.symlink_to(p.name))),
    ]
    cases: list[tuple[str, list[str], dict]] = []
    for m in bad_models:
        for args in (
            ["convert", "mqa", str(m), str(out / "mqa")],
            ["convert", "mla", str(m), str(out / "mla"), "--calib", txt, "--kv-budget", "0.5"],
            ["retrofit", "softcap", str(m), str(out / "cap"), "--attn-cap", "30"],
            ["retrofit", "qkclip", str(m), str(out / "clip"), "--calib", txt, "--tau", "1"],
            ["diff", str(good), str(m)],
            ["eval", str(m), txt, "--seq-len", "64"],
            ["probe", str(m), txt, "--seq-len", "64"],
            ["inspect", str(m)],
            ["heal", str(m), str(out / "healed"), "--teacher", str(good), "--tokens", "1k"],
        ):
            cases.append((f"{m.name}: {' '.join(args[:2])}", args, {}))
    ggufs = inputs / "gguf"
    ggufs.mkdir()
    block = hostile.gguf_tensors()
    gguf_variants = {
        "missing-k": [t for t in block if t[0] != "blk.1.attn_k.weight"],
        "twice": block + [block[1]],
        "misshapen": [(n, (64, 24) if n == "blk.0.attn_k.weight" else d, t) for n, d, t in block],
    }
    for name, tensors in gguf_variants.items():
        path = ggufs / f"{name}.gguf"
        path.write_bytes(hostile.gguf_bytes(hostile.gguf_fields(), tensors))
        cases += [
            (f"gguf {name}: {c}", [c, str(path), *([str(out / "g")] if c == "export" else [])], {})
            for c in ("inspect", "export")
        ]
    raw = bytearray(hostile.gguf_bytes(hostile.gguf_fields(), block))
    at = raw.index(b"blk.1.attn_output.weight") + len(b"blk.1.attn_output.weight") + 4 + 16 + 4
    raw[at : at + 8] = struct_pack_q(int.from_bytes(raw[at : at + 8], "little") + 4)
    (ggufs / "misaligned.gguf").write_bytes(bytes(raw))
    cases.append(("gguf misaligned: inspect", ["inspect", str(ggufs / "misaligned.gguf")], {}))
    wide = [(k, t, 60 if k.endswith("embedding_length") else v) for k, t, v in hostile.gguf_fields()]
    (ggufs / "width.gguf").write_bytes(hostile.gguf_bytes(wide, block))
    cases.append(("gguf width not heads x head size", ["inspect", str(ggufs / "width.gguf")], {}))
    blocker = inputs / "blocker"
    blocker.write_text("a file")
    ok_gguf = ggufs / "ok.gguf"
    ok_gguf.write_bytes(hostile.gguf_bytes(hostile.gguf_fields(), block))
    g = str(good)
    cases += [
        ("output is a file", ["convert", "mla", g, str(blocker), "--calib", txt, "--kv-budget", "0.5"], {}),
        ("output under a file", ["convert", "mqa", g, str(blocker / "out")], {}),
        ("cache is a file", ["export", str(ok_gguf), str(out / "e")], {"ATTNKIT_CACHE": str(blocker)}),
        ("eval --seq-len 0", ["eval", g, txt, "--seq-len", "0"], {}),
        ("eval --batch-size 0", ["eval", g, txt, "--batch-size", "0"], {}),
        ("eval --max-tokens -5", ["eval", g, txt, "--max-tokens", "-5"], {}),
        ("probe --threshold nan", ["probe", g, txt, "--threshold", "nan"], {}),
        (
            "qknorm --steps 1e10",
            ["retrofit", "qknorm", g, str(out / "q"), "--method", "kl", "--calib", txt, "--steps", "10000000000"],
            {},
        ),
        ("eval --batch-size 2^32+1", ["eval", g, txt, "--batch-size", str(2**32 + 1)], {}),
        ("probe --fail-if nan", ["probe", g, txt, "--fail-if", "max_logit>nan"], {}),
        ("probe --fail-if 1e999", ["probe", g, txt, "--fail-if", "max_logit>1e999"], {}),
        ("probe --top -1", ["probe", g, txt, "--top", "-1"], {}),
        ("kvmem 4k,,8k", ["kvmem", "llama-3.1-8b", "--context", "4k,,8k"], {}),
        ("heal --batch-size 2^32+4", ["heal", g, str(out / "h"), "--teacher", g, "--batch-size", str(2**32 + 4)], {}),
        (
            "mla --shrink nan",
            ["convert", "mla", g, str(out / "m"), "--calib", txt, "--kv-budget", "0.5", "--shrink", "nan"],
            {},
        ),
        ("hub id with --", ["inspect", "acme/ti--ny"], {"HF_HUB_OFFLINE": "1"}),
        ("hub revision ..", ["inspect", "acme/tiny@bad..rev"], {"HF_HUB_OFFLINE": "1"}),
    ]
    flat = inputs / "flat.txt"
    flat.write_text("a" * 8000)
    jsonl = inputs / "bad.jsonl"
    jsonl.write_text(json.dumps({"text": PROSE * 40}) + "\n" + json.dumps({"body": "x"}) + "\n")
    cases += [
        (
            "calibration with no variation",
            ["convert", "mla", g, str(out / "flat"), "--calib", str(flat), "--kv-budget", "0.5"],
            {},
        ),
        (
            "heal .jsonl without text",
            ["heal", g, str(out / "hj"), "--teacher", g, "--data", str(jsonl), "--tokens", "1k"],
            {},
        ),
    ]
    return cases, [inputs]


def struct_pack_q(value: int) -> bytes:
    return value.to_bytes(8, "little")


def classes(tally: Tally, work: Path) -> None:
    from typer.testing import CliRunner

    from attnkit.cli import app

    cases, inputs = class_cases(work)
    before = {folder: digest(folder) for folder in inputs}
    runner = CliRunner()
    for label, argv, env in cases:
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            result = runner.invoke(app, argv)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        outcome, detail = cli_outcome(result)
        modified = any(digest(folder) != before[folder] for folder in inputs)
        left = leftovers(work)
        for path in left:
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        tally.add("classes", outcome, f"{label}: {detail}", modified, len(left))
        if outcome != "clean" or modified or left:
            print(
                f"{label}: {outcome} {detail} modified {modified} leftovers {[p.name for p in left]}", file=sys.stderr
            )
        shutil.rmtree(work / "out", ignore_errors=True)
    text_memory(tally, work)
    full_disk(tally, work)


def text_memory(tally: Tally, work: Path) -> None:
    """Peak RSS of `eval --max-tokens 2048` and `convert mqa --method merge --calib-tokens 2048` on a 64 MiB text
    against a small one, each in its own process: reading only what the budget needs keeps them equal."""
    from tests.helpers import PROSE, tiny_source

    folder = work / "memory"
    folder.mkdir()
    model = tiny_source(folder, "llama_gqa")
    small, big = folder / "small.txt", folder / "big.txt"
    small.write_text(PROSE * 40)
    with big.open("w") as fh:
        for _ in range(64 * 1024):
            fh.write((PROSE * 8)[:1023] + "\n")
    for what, args in (
        ("eval", ["eval", str(model), "{text}", "--seq-len", "64", "--max-tokens", "2048"]),
        (
            "convert --calib",
            [
                "convert",
                "mqa",
                str(model),
                str(folder / "out"),
                "--method",
                "merge",
                "--calib",
                "{text}",
                "--calib-tokens",
                "2048",
                "--calib-seq-len",
                "64",
            ],
        ),
    ):
        peaks = {}
        for name, path in (("small", small), ("big", big)):
            code = (
                "import resource, sys, runpy; sys.argv = ['attnkit', *sys.argv[1:]]\n"
                "try:\n    runpy.run_module('attnkit', run_name='__main__')\nexcept SystemExit:\n    pass\n"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)"
            )
            proc = subprocess.run(
                [sys.executable, "-c", code, *[a.format(text=path) for a in args]],
                capture_output=True,
                text=True,
                env={**os.environ, "HF_HUB_OFFLINE": "1"},
            )
            peaks[name] = int(proc.stderr.strip().splitlines()[-1]) / 1024
            shutil.rmtree(folder / "out", ignore_errors=True)
        grew = peaks["big"] - peaks["small"]
        outcome = "clean" if grew < 64 else "crash"
        detail = f"{what}: peak RSS {peaks['small']:.0f} MiB on a small text, {peaks['big']:.0f} MiB on 64 MiB"
        tally.add("classes: text memory", outcome, detail)
        print(detail, file=sys.stderr)


def full_disk(tally: Tally, work: Path) -> None:
    """convert mqa, export and probe --plot into a 1 MiB tmpfs: one line, nothing left (root and mount only)."""
    from typer.testing import CliRunner

    from attnkit.cli import app
    from tests.helpers import PROSE, tiny_source

    disk = work / "full-disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], capture_output=True).returncode:
        print("full disk: cannot mount a tmpfs here; part skipped", file=sys.stderr)
        return
    try:
        model = tiny_source(work, "llama_gqa")
        text = work / "full-text.txt"
        text.write_text(PROSE * 12)
        with open(disk / "filler", "wb", buffering=0) as fh:  # fill the disk, then free 16 KiB: too little
            try:
                while True:
                    fh.write(b"\0" * 4096)
            except OSError:
                pass
        with open(disk / "filler", "r+b") as fh:
            fh.truncate(max(0, (disk / "filler").stat().st_size - (16 << 10)))
        runner = CliRunner()
        for label, argv in (
            ("convert mqa", ["convert", "mqa", str(model), str(disk / "out")]),
            ("probe --plot", ["probe", str(model), str(text), "--seq-len", "64", "--plot", str(disk / "heads.png")]),
        ):
            outcome, detail = cli_outcome(runner.invoke(app, argv))
            left = [p for p in disk.iterdir() if p.name != "filler"]
            tally.add("classes: full disk", outcome, f"{label}: {detail}", False, len(left))
            print(f"full disk, {label}: {outcome} {detail} left {[p.name for p in left]}", file=sys.stderr)
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)


# ------------------------------------------------------------------ signals


def run_child(args, sig=None, delay=0.0, env=None, when=None) -> tuple[int, str, float]:
    """Run `args`; send `sig` after `delay` seconds, or once `when()` is true (polled). (exit code, stderr, s)"""
    started = time.monotonic()
    child = subprocess.Popen(
        args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    if sig is not None:
        if when is None:
            time.sleep(delay)
        while when is not None and not when() and child.poll() is None:
            time.sleep(0.05)
        if child.poll() is None:
            child.send_signal(sig)
    _, err = child.communicate(timeout=900)
    return child.returncode, err, time.monotonic() - started


def _temp_holds(parent: Path, name: str, min_bytes: int = 0):
    """A trigger: true once a temp folder in `parent` holds a file `name*` of at least `min_bytes`."""

    def ready() -> bool:
        return any(f.stat().st_size >= min_bytes for t in leftovers(parent) if t.is_dir() for f in t.glob(name + "*"))

    return ready


def folder_signals(tally: Tally, work: Path) -> None:
    """convert mqa --method mean of the SmolLM2 folder, signalled at moments seen from outside: after a share
    of a warm run's time (checks, reading), while the shard is written, after the weights (verification,
    config, fsync), and just before the rename."""
    from attnkit.realmodels import smollm2_folder

    smol = smollm2_folder()
    stats = stat_digest(smol)
    out_parent = work / "signals"
    out_parent.mkdir()
    base = [sys.executable, "-m", "attnkit", "convert", "mqa", str(smol)]
    for _ in range(2):  # the second run is warm: the page cache holds the weights
        code, _, full = run_child([*base, str(out_parent / "clean")])
        shutil.rmtree(out_parent / "clean", ignore_errors=True)
    print(f"warm convert mqa --method mean on SmolLM2: exit {code}, {full:.1f}s", file=sys.stderr)
    moments = {
        "at 45% of a warm run": dict(delay=0.45 * full),
        "mid-write (shard over 100 MB)": dict(when=_temp_holds(out_parent, ".shard-", 100 << 20)),
        "after the weights (config.json written)": dict(when=_temp_holds(out_parent, "config.json")),
        "before the rename (attnkit.json written)": dict(when=_temp_holds(out_parent, "attnkit.json")),
    }
    plan = [(signal.SIGTERM, m) for m in moments] + [
        (signal.SIGINT, "mid-write (shard over 100 MB)"),
        (signal.SIGHUP, "after the weights (config.json written)"),
    ]
    for i, (sig, moment) in enumerate(plan):
        out = out_parent / f"run{i}"
        code, err, _ = run_child([*base, str(out)], sig, **moments[moment])
        _signal_tally(
            tally, "signals: convert mqa", sig, code, err, stat_digest(smol) != stats, leftovers(out_parent), moment
        )
        shutil.rmtree(out, ignore_errors=True)
    for moment in ("mid-write (shard over 100 MB)", "after the weights (config.json written)"):
        out = out_parent / "killed"  # SIGKILL: nothing can clean up; the next run into the same parent must
        run_child([*base, str(out)], signal.SIGKILL, **moments[moment])
        left_after_kill = leftovers(out_parent)
        code, err, _ = run_child([*base, str(out_parent / "next")])
        left = leftovers(out_parent)
        detail = (
            f"SIGKILL {moment} left {len(left_after_kill)}; the next run exit {code}, "
            f"{len(left)} left: {err.strip()[-200:]}"
        )
        outcome = "crash" if code != 0 else "clean" if left_after_kill else "ok"  # ok: the kill missed the write
        tally.add("signals: convert mqa", outcome, detail, stat_digest(smol) != stats, len(left))
        print(detail, file=sys.stderr)
        for p in (out, out_parent / "next"):
            shutil.rmtree(p, ignore_errors=True)


def gguf_signals(tally: Tally, work: Path) -> None:
    """convert mqa of the SmolLM2 GGUF into a fresh cache, signalled while the dequantized model is written."""
    from attnkit.realmodels import smollm2_gguf

    cache, out_parent = work / "gguf-cache", work / "gguf-signals"
    out_parent.mkdir()
    env = {"ATTNKIT_CACHE": str(cache)}
    base = [sys.executable, "-m", "attnkit", "convert", "mqa", str(smollm2_gguf())]
    writing = lambda: bool(leftovers(cache))  # noqa: E731 - the cache's temp folder exists
    for sig in (signal.SIGTERM, signal.SIGKILL):
        shutil.rmtree(cache, ignore_errors=True)
        code, err, _ = run_child([*base, str(out_parent / "g")], sig, env=env, when=writing)
        if sig == signal.SIGTERM:
            _signal_tally(
                tally,
                "signals: GGUF cache",
                sig,
                code,
                err,
                False,
                leftovers(out_parent, cache),
                "while the cache is written",
            )
            continue
        left_after_kill = leftovers(cache)
        code, err, _ = run_child([*base, str(out_parent / "g2")], env=env)
        left = leftovers(out_parent, cache)
        detail = (
            f"SIGKILL while writing the cache left {len(left_after_kill)}; the next run exit {code}, "
            f"{len(left)} left: {err.strip()[-200:]}"
        )
        tally.add("signals: GGUF cache", "clean" if code == 0 else "crash", detail, False, len(left))
        print(detail, file=sys.stderr)


def _signal_tally(tally, part, sig, code, err, modified, left, moment="") -> None:
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    expected = {signal.SIGTERM: 143, signal.SIGINT: 130, signal.SIGHUP: 129}[sig]
    if code == 0:
        outcome = "ok"  # finished before the signal arrived
    elif code == expected and len(errors) == 1 and "Traceback" not in err:
        outcome = "clean"
    else:
        outcome = "crash"
    tally.add(part, outcome, f"{sig.name} {moment}: exit {code}: {err.strip()[-200:]}", modified, len(left))
    print(
        f"{part}: {sig.name} {moment} -> exit {code}, {errors[-1] if errors else '(no error line)'}, "
        f"{len(left)} leftover(s)",
        file=sys.stderr,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--headers", type=int, default=25_120)
    parser.add_argument("--index", type=int, default=3_000)
    parser.add_argument("--gguf", type=int, default=3_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--parts",
        default="readers,cli,classes,signals",
        help="comma-separated: readers, cli, classes, signals, gguf-signals",
    )
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    tally = Tally()
    work = Path(tempfile.mkdtemp(prefix="hostile-battery-"))
    os.environ["ATTNKIT_CACHE"] = str(work / "cache")
    try:
        if "readers" in parts:
            started = time.perf_counter()
            readers(tally, work, args.headers, args.index, args.gguf, args.seed)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            print(f"readers: {time.perf_counter() - started:.1f}s, peak RSS {peak:.0f} MiB", file=sys.stderr)
        if "cli" in parts:
            started = time.perf_counter()
            cli(tally, work)
            print(f"CLI: {time.perf_counter() - started:.1f}s", file=sys.stderr)
        if "classes" in parts:
            started = time.perf_counter()
            classes(tally, work)
            print(f"classes: {time.perf_counter() - started:.1f}s", file=sys.stderr)
        del os.environ["ATTNKIT_CACHE"]  # the real-model parts read SmolLM2 from the test cache
        if "signals" in parts:
            folder_signals(tally, work)
        if "gguf-signals" in parts:
            gguf_signals(tally, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(tally.report())


if __name__ == "__main__":
    main()
