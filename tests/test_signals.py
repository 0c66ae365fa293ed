"""SIGTERM and SIGINT in the middle of a write: one error line, exit 143 / 130, no temp folder, input unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import leftovers, tree

#: Runs `attnkit convert mqa SRC OUT` with a shard writer that signals READY after the first shard, then waits.
CHILD = """
import pathlib, sys, time
from attnkit.io import writer
real, ready = writer.write_safetensors, pathlib.Path(sys.argv[3])
def slow(path, tensors, metadata):
    real(path, tensors, metadata)
    ready.write_text("ready")
    time.sleep(120)
writer.write_safetensors = slow
sys.argv = ["attnkit", "convert", "mqa", sys.argv[1], sys.argv[2]]
from attnkit.cli import main
from tests.helpers import leftovers, tree
main()
"""


@pytest.mark.parametrize(
    "signum, code, message",
    [
        (signal.SIGTERM, 143, "error: terminated (SIGTERM)"),
        (signal.SIGINT, 130, "error: interrupted"),
    ],
)
def test_a_signal_mid_write_removes_the_temp_folder(tiny, tmp_path, signum, code, message):
    src = tiny("llama_gqa")
    before = tree(src)
    out, ready = tmp_path / "out", tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(src), str(out), str(ready)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ATTNKIT_DEBUG": ""},
    )
    deadline = time.monotonic() + 120
    while not ready.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), child.communicate()[1]
    assert len(leftovers(tmp_path)) == 1  # the temp folder, with a shard in it
    child.send_signal(signum)
    _, err = child.communicate(timeout=60)
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert child.returncode == code and errors == [message] and "Traceback" not in err, err
    assert leftovers(tmp_path) == [] and not out.exists()
    assert tree(src) == before


def test_a_signal_a_library_swallows_still_stops_the_next_read_and_the_commit(tiny, tmp_path, monkeypatch):
    from attnkit import interrupts
    from attnkit.cli.common import _on_signal
    from attnkit.errors import Terminated
    from attnkit.io.reader import LazyReader
    from attnkit.io.writer import OutputDir

    monkeypatch.setattr(interrupts, "_pending", None)
    try:
        _on_signal(signal.SIGTERM, None)
    except Terminated:
        pass  # what C code that calls back into Python may do with the exception
    src = tiny("llama")
    with LazyReader([src / "model.safetensors"]) as reader:
        with pytest.raises(Terminated):
            reader.get("model.norm.weight")
    out = tmp_path / "out"
    with pytest.raises(Terminated):
        with OutputDir(out) as target:
            (target.path / "a.txt").write_text("x")
            target.commit()
    assert not out.exists() and leftovers(tmp_path) == []
