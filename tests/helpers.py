"""Helpers the test modules share: text and a character tokenizer for tiny models, CLI error checks, folder
snapshots, tiny GGUF files and checkpoints, fresh-interpreter import checks."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from tests.tiny import build_model, save_model

PROSE_DIR = Path(__file__).parent / "data" / "prose"
CALIB = str(PROSE_DIR / "calib.txt")
HELDOUT = str(PROSE_DIR / "heldout.txt")
#: convert mla's calibration options for tiny models: a quarter of the default tokens, short windows.
FAST_CALIB = ["--calib", CALIB, "--calib-tokens", "512", "--calib-seq-len", "128"]

PROSE = (
    "Rain fell on the old harbour town all night, and by morning the fishing boats "
    "sat low in the water while the gulls argued over scraps on the pier. "
)


def char_tokenizer(folder):
    """Save a character-level tokenizer (ids < 100, EOS = 2) into `folder` so tiny models can read text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({chr(c): 4 + i for i, c in enumerate(range(32, 127))})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    ).save_pretrained(folder)
    return folder


def one_line_error(result, code: int, needle: str, progress_lines: int = 0) -> None:
    """Exit code, no traceback, and the error as the one last line (after `progress_lines` phase logs)."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.output.strip().splitlines() if line.strip()]
    assert len(lines) == 1 + progress_lines and "Traceback" not in result.output, result.output
    assert lines[-1].startswith("error: ") and needle in lines[-1], result.output


def tree(folder: Path) -> dict:
    """Relative path -> sha256 of every file under `folder`, and every folder (so new subfolders show)."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(folder.rglob("*"))
    }


def digest(folder: Path) -> dict:
    """File name -> sha256 of the files directly in `folder` (an input must be left as it was)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def leftovers(parent: Path, *also: str) -> list[str]:
    """attnkit's temp and garbage folders in `parent`, and the entries named in `also` that exist there."""
    return sorted(p.name for p in parent.iterdir() if ".attnkit-" in p.name or p.name in also)


def write_gguf(path, arch, **fields):
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(fields.get("layers", 2))
    writer.add_embedding_length(fields.get("hidden", 64))
    writer.add_head_count(fields.get("heads", 8))
    writer.add_head_count_kv(fields.get("kv_heads", 2))
    hidden, heads, kv_heads = fields.get("hidden", 64), fields.get("heads", 8), fields.get("kv_heads", 2)
    dim = hidden // heads
    writer.add_tensor("token_embd.weight", np.zeros((16, hidden), dtype=np.float32))
    for i in range(fields.get("layers", 2)):  # numpy [out, in]: GGUF dims [in, out]
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        for role, rows in (("attn_q", heads * dim), ("attn_k", kv_heads * dim), ("attn_v", kv_heads * dim)):
            writer.add_tensor(f"blk.{i}.{role}.weight", np.zeros((rows, hidden), dtype=np.float32))
        writer.add_tensor(f"blk.{i}.attn_output.weight", np.zeros((hidden, heads * dim), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def modules_after(args: list[str]) -> set[str]:
    """Run the CLI in a fresh interpreter and return which heavy modules it imported."""
    code = (
        "import sys\n"
        "from attnkit.cli import app\n"
        "try:\n"
        f"    app({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        "heavy = [m for m in ('torch', 'transformers', 'pandas', 'pydantic') if m in sys.modules]\n"
        "sys.stderr.write('HEAVY=' + ','.join(heavy))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    line = [l for l in out.stderr.splitlines() if l.startswith("HEAVY=")][-1]
    return {m for m in line[len("HEAVY=") :].split(",") if m}


def library_accepts(path) -> bool:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np"):
            return True
    except Exception:  # noqa: BLE001 - the library's verdict, whatever it raises
        return False


def tiny_source(tmp_path: Path, family: str, biases: bool = False, offset: float = 0.0, **overrides) -> Path:
    """A tiny checkpoint with a character tokenizer; biases: random nonzero q/k/v/o biases; offset: every token
    embedding gets offset x the same unit vector, the near-constant direction real LLM hidden states have (and
    random tiny models lack), which the engine route's anchor a.x ~ 1 is fitted to."""
    model = build_model(family, **overrides)
    g = torch.Generator().manual_seed(3)
    if biases:
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias"):
                p.data.copy_(0.5 * torch.randn(p.shape, generator=g))
    if offset:
        emb = model.get_input_embeddings().weight
        direction = torch.randn(emb.shape[1], generator=g)
        emb.data += offset * emb.norm(dim=1).mean() * direction / direction.norm()
    folder = tmp_path / f"src-{family}"
    save_model(model, folder)
    return char_tokenizer(folder)


def assert_numbers_close(got, want, rel: float, path: str = "") -> None:
    """Two JSON-like trees with the same structure whose numbers agree to `rel` relative to the larger magnitude
    (for figures that differ only in float32 rounding); everything else equal."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_numbers_close(got[key], want[key], rel, f"{path}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (g, w) in enumerate(zip(got, want)):
            assert_numbers_close(g, w, rel, f"{path}[{i}]")
    elif isinstance(want, float) and not isinstance(want, bool):
        assert isinstance(got, float | int), path
        assert abs(got - want) <= rel * max(abs(got), abs(want)) + 1e-12, f"{path}: {got} vs {want}"
    else:
        assert got == want, f"{path}: {got!r} vs {want!r}"
