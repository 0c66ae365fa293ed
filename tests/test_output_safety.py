"""Output safety: never write inside an input, clean what killed runs left, follow the umask, write files atomically,
and make temp folders only when there is something to write."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from attnkit.cli import app
from attnkit.errors import AttnkitError
from attnkit.io import tempdirs
from attnkit.io.tempdirs import MARKER, atomic_file, clean_stale
from attnkit.io.writer import OutputDir
from tests.helpers import FAST_CALIB, char_tokenizer, leftovers, tree


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def _temp_folder(parent: Path, name: str, owner: dict | None) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"\0" * 1000)
    if owner is not None:
        (folder / MARKER).write_text(json.dumps(owner))
    return folder


# ------------------------------------------------------------------ never inside an input


@pytest.mark.parametrize(
    "args, words",
    [
        (["convert", "mqa", "{src}", "{src}/sub"], "output would be written inside the input"),
        (["convert", "mqa", "{src}/model.safetensors", "{src}/x"], "output would be written inside the input"),
        (["retrofit", "softcap", "{src}", "{src}/a/b", "--attn-cap", "30"], "output would be written inside the input"),
        (["convert", "mqa", "{src}", "{src}/..", "--overwrite"], "output would replace the input"),
    ],
)
def test_output_inside_or_around_the_input_is_refused_and_the_input_is_untouched(runner, tiny, args, words):
    src = char_tokenizer(tiny("llama_gqa"))
    before = tree(src.parent)
    result = runner.invoke(app, [a.format(src=src) for a in args])
    assert result.exit_code == 1 and words in result.stderr, result.output
    assert tree(src.parent) == before


# ------------------------------------------------------------------ stale temp folders


def test_folders_of_dead_owners_are_removed_live_and_unmarked_ones_kept(tmp_path):
    host = socket.gethostname()
    dead = _temp_folder(tmp_path, ".out.attnkit-tmp-dead", {"pid": _dead_pid(), "host": host, "start": None})
    reused = _temp_folder(tmp_path, ".out.attnkit-tmp-reused", {"pid": os.getpid(), "host": host, "start": -1})
    garbage = _temp_folder(tmp_path, ".out.attnkit-del-half", None)
    live = _temp_folder(
        tmp_path,
        ".out.attnkit-tmp-live",
        {"pid": os.getpid(), "host": host, "start": tempdirs._start_time(os.getpid())},
    )
    other_host = _temp_folder(
        tmp_path, ".out.attnkit-tmp-far", {"pid": _dead_pid(), "host": host + "-x", "start": None}
    )
    unmarked = _temp_folder(tmp_path, ".out.attnkit-tmp-unmarked", None)
    user = _temp_folder(tmp_path, ".my-notes", {"pid": _dead_pid(), "host": host, "start": None})
    with OutputDir(tmp_path / "new") as out:
        (out.path / "a.txt").write_text("new")
        out.commit()
    assert not dead.exists() and not reused.exists() and not garbage.exists()
    assert live.exists() and other_host.exists() and unmarked.exists() and user.exists()


def test_a_sigkilled_run_leaves_a_folder_that_the_next_run_removes(tmp_path):
    code = (
        "import os, signal; from attnkit.io.writer import OutputDir\n"
        f"out = OutputDir({str(tmp_path / 'out')!r}).__enter__()\n"
        "(out.path / 'w.bin').write_bytes(b'0' * 4096)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    assert len(leftovers(tmp_path)) == 1
    assert clean_stale(tmp_path) and leftovers(tmp_path) == []


def test_the_gguf_cache_is_cleaned_and_follows_the_umask(tmp_path, monkeypatch):
    from attnkit.io import gguf_load

    class Fake:  # what transformers' save_pretrained does: private temp files, mode 0o600
        def save_pretrained(self, folder):
            path = Path(folder) / "config.json"
            path.write_text("{}")
            os.chmod(path, 0o600)

    monkeypatch.setattr(gguf_load, "load_gguf_model", lambda path, dtype: (Fake(), Fake()))
    monkeypatch.setattr(gguf_load, "check_gguf_tokenizer", lambda path: None)  # no file: its header is not read
    cache = tmp_path / "cache"
    stale = _temp_folder(
        cache, ".m-float32-abc.attnkit-tmp-1234", {"pid": _dead_pid(), "host": socket.gethostname(), "start": None}
    )
    old = os.umask(0o022)
    try:
        folder = gguf_load.materialize_gguf(tmp_path / "m.gguf", cache / "m-float32-abc")
    finally:
        os.umask(old)
    assert not stale.exists() and leftovers(cache) == []
    assert oct(folder.stat().st_mode & 0o777) == "0o755"
    assert oct((folder / "config.json").stat().st_mode & 0o777) == "0o644"
    assert not (folder / MARKER).exists()


@pytest.mark.parametrize("umask, mode", [(0o022, "0o755"), (0o002, "0o775"), (0o077, "0o700")])
def test_output_folders_follow_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        with OutputDir(tmp_path / "out") as out:
            (out.path / "a.txt").write_text("x")
            out.commit()
    finally:
        os.umask(old)
    assert oct((tmp_path / "out").stat().st_mode & 0o777) == mode
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.txt"]  # no marker in the output


# ------------------------------------------------------------------ atomic files, temp folders made late


def test_a_failed_write_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "stats.csv"
    path.write_text("old,complete\n")
    with pytest.raises(AttnkitError, match=f"disk full while writing {path}"):
        with atomic_file(path) as tmp:
            tmp.write_text("new,half")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert path.read_text() == "old,complete\n" and leftovers(tmp_path) == []
    with atomic_file(path) as tmp:
        tmp.write_text("new,complete\n")
    assert path.read_text() == "new,complete\n" and leftovers(tmp_path) == []


def _half_then_interrupted(tensors, filename, *args, **kwargs):
    """A safetensors write cut short: half a file on disk, then Ctrl-C."""
    Path(filename).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{")
    raise KeyboardInterrupt


def test_an_interrupted_topk_cache_write_leaves_no_file_and_the_next_run_writes_it(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from attnkit.commands.heal.topk import Targets, load_or_compute

    path = tmp_path / "teacher-topk" / "key.safetensors"
    targets = Targets(torch.zeros(1, 2, 3, dtype=torch.int32), torch.zeros(1, 2, 3).half(), torch.zeros(1, 2))
    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", _half_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            load_or_compute(path, lambda: targets)
    assert list(path.parent.iterdir()) == []  # no half file under the cache's name, no temp file left
    again = load_or_compute(path, lambda: targets)
    assert path.is_file() and torch.equal(load_or_compute(path, pytest.fail).ids, again.ids)
    assert sorted(p.name for p in path.parent.iterdir()) == ["key.safetensors"]


def test_an_interrupted_teacher_sample_batch_leaves_no_file(tmp_path, monkeypatch):
    import safetensors.torch
    import torch

    from attnkit.commands.heal import samples

    path = tmp_path / "batch-00000.safetensors"
    with monkeypatch.context() as patch:
        patch.setattr(safetensors.torch, "save_file", _half_then_interrupted)
        with pytest.raises(KeyboardInterrupt):
            samples._save(path, torch.ones(2, 4, dtype=torch.long))
    assert list(tmp_path.iterdir()) == []
    samples._save(path, torch.ones(2, 4, dtype=torch.long))
    assert torch.equal(samples._load(path), torch.ones(2, 4, dtype=torch.long))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch-00000.safetensors"]


def test_probe_table_on_a_full_disk_keeps_the_previous_table(tmp_path, monkeypatch):
    import pandas as pd

    from attnkit.commands.analyse.probe_report import write_table
    from attnkit.scoring.attention_stats import ProbeResult

    path = tmp_path / "stats.csv"
    path.write_text("previous\n")

    def half_then_full(self, target, **_kw):
        Path(target).write_text("layer,head\n0,")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pd.DataFrame, "to_csv", half_then_full)
    result = ProbeResult("m", 1, 1, 1, 0.0, 0.0, heads=[{"layer": 0, "head": 0}])
    with pytest.raises(AttnkitError, match="disk full"):
        write_table([result], str(path))
    assert path.read_text() == "previous\n" and leftovers(tmp_path) == []


def test_output_dir_makes_its_temp_folder_on_first_use(tmp_path):
    with OutputDir(tmp_path / "out"):
        assert leftovers(tmp_path) == []
    with OutputDir(tmp_path / "out") as out:
        out.path.joinpath("x").write_text("x")
        assert len(leftovers(tmp_path)) == 1
    assert leftovers(tmp_path) == [] and not (tmp_path / "out").exists()


def test_convert_mla_has_only_its_layer_spill_beside_out_while_it_calibrates(runner, tiny, tmp_path, monkeypatch):
    """The output's temp folder is made when the first shard is written, after calibration; what calibration
    makes is the layer spill (attnkit.commands.convert.layer_spill), gone at the end."""
    from attnkit.commands.convert import mla

    seen = []
    original = mla.calibrate

    def spy(*args, **kwargs):
        seen.append(leftovers(tmp_path))
        return original(*args, **kwargs)

    monkeypatch.setattr(mla, "calibrate", spy)
    src = char_tokenizer(tiny("llama_gqa"))
    result = runner.invoke(app, ["convert", "mla", str(src), str(tmp_path / "out"), *FAST_CALIB, "--kv-budget", "0.5"])
    assert result.exit_code == 0, result.output
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].startswith(".out.layers")
    assert (tmp_path / "out" / "config.json").is_file() and leftovers(tmp_path) == []
