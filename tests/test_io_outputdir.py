"""OutputDir: refuse, clean up, replace only at commit, disk full."""

from __future__ import annotations

import errno
import io

import pytest
import torch

from attnkit.errors import AttnkitError
from attnkit.io import writer as writer_mod
from attnkit.io.writer import OutputDir, ShardedWriter, verify_output
from tests.helpers import leftovers


def _old_target(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "old.txt").write_text("old")
    return target


def test_refuses_non_empty_target_before_any_work(tmp_path):
    target = _old_target(tmp_path)
    with pytest.raises(AttnkitError, match=f"{target}: folder is not empty \\(pass --overwrite"):
        OutputDir(target)
    assert leftovers(tmp_path) == [] and (target / "old.txt").read_text() == "old"


def test_refuses_to_replace_its_input(tmp_path):
    target = _old_target(tmp_path)
    source_file = target / "sub" / "model.safetensors"
    for source in (target, source_file, tmp_path / "out" / ".." / "out"):
        with pytest.raises(AttnkitError, match="output would replace the input"):
            OutputDir(target, overwrite=True, sources=[source])
    with OutputDir(tmp_path / "new", sources=[target]) as out:
        out.commit()


def test_refuses_a_file_as_target(tmp_path):
    target = tmp_path / "out"
    target.write_text("x")
    with pytest.raises(AttnkitError, match="exists and is not a folder"):
        OutputDir(target, overwrite=True)


def test_commit_creates_target_next_to_temp(tmp_path):
    target = tmp_path / "nested" / "out"
    with OutputDir(target) as out:
        assert out.path.parent == target.parent and out.path != target
        (out.path / "a.txt").write_text("new")
        assert out.commit() == target
    assert (target / "a.txt").read_text() == "new"
    assert leftovers(target.parent) == []


def test_empty_existing_target_is_accepted(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with OutputDir(target) as out:
        (out.path / "a.txt").write_text("new")
        out.commit()
    assert [p.name for p in target.iterdir()] == ["a.txt"]


@pytest.mark.parametrize("exc", [RuntimeError("boom"), KeyboardInterrupt()])
def test_exception_removes_temp_and_keeps_target(tmp_path, exc):
    target = _old_target(tmp_path)
    with pytest.raises(type(exc)):
        with OutputDir(target, overwrite=True) as out:
            (out.path / "a.txt").write_text("new")
            raise exc
    assert leftovers(tmp_path) == []
    assert [p.name for p in target.iterdir()] == ["old.txt"]


def test_leaving_without_commit_discards(tmp_path):
    target = tmp_path / "out"
    with OutputDir(target) as out:
        (out.path / "a.txt").write_text("new")
    assert not target.exists() and leftovers(tmp_path) == []


def test_overwrite_replaces_only_at_commit(tmp_path):
    target = _old_target(tmp_path)
    with OutputDir(target, overwrite=True) as out:
        (out.path / "a.txt").write_text("new")
        assert (target / "old.txt").read_text() == "old"  # untouched while working
        out.commit()
    assert [p.name for p in target.iterdir()] == ["a.txt"]
    assert leftovers(tmp_path) == []


def test_failing_verifier_keeps_target(tmp_path):
    target = _old_target(tmp_path)
    with pytest.raises(AttnkitError, match=r"tensor 'w' has shape \[2\], expected \[3\]"):
        with OutputDir(target, overwrite=True) as out:
            writer = ShardedWriter(out.path)
            writer.add("w", torch.tensor([1.0, 2.0]))
            writer.finish()
            out.commit(verifier=lambda folder: verify_output(folder, {"w": (3,)}))
    assert [p.name for p in target.iterdir()] == ["old.txt"] and leftovers(tmp_path) == []


def test_target_filled_meanwhile_is_not_clobbered(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(AttnkitError, match="folder is not empty"):
        with OutputDir(target) as out:
            (out.path / "a.txt").write_text("new")
            target.mkdir()
            (target / "other.txt").write_text("someone else")
            out.commit()
    assert [p.name for p in target.iterdir()] == ["other.txt"] and leftovers(tmp_path) == []


def test_commit_twice_is_an_error(tmp_path):
    with OutputDir(tmp_path / "out") as out:
        out.commit()
        with pytest.raises(AttnkitError, match="uncommitted"):
            out.commit()


class _FullDisk(io.BytesIO):
    """A file that accepts `room` bytes, then fails like a full disk."""

    def __init__(self, room):
        super().__init__()
        self.room = room

    def write(self, data):
        self.room -= len(memoryview(data).cast("B"))
        if self.room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return super().write(data)


def test_disk_full_leaves_no_partial_output(tmp_path, monkeypatch):
    real_open = open
    budget = {"shards": 1}

    def fake_open(path, mode="r", *args, **kwargs):
        if "w" in mode and str(path).endswith(".partial"):
            budget["shards"] -= 1
            if budget["shards"] < 0:
                return _FullDisk(room=100)
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(writer_mod, "open", fake_open, raising=False)
    target = _old_target(tmp_path)
    with pytest.raises(AttnkitError, match=f"^disk full while writing {target}$"):
        with OutputDir(target, overwrite=True) as out:
            writer = ShardedWriter(out.path, max_shard_bytes=4096)
            for i in range(4):
                writer.add(f"t{i}", torch.randn(1000))
            writer.finish()
            out.commit()
    assert budget["shards"] < 0  # the first shard was written, the second hit the full disk
    assert [p.name for p in target.iterdir()] == ["old.txt"] and leftovers(tmp_path) == []


def test_commit_fsyncs_every_file_before_the_rename(tmp_path, monkeypatch):
    target = tmp_path / "out"
    synced, renamed_at = [], []
    real_fsync = writer_mod.os.fsync

    def fsync(fd):
        synced.append(writer_mod.os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(writer_mod.os, "fsync", fsync)
    with OutputDir(target) as out:
        (out.path / "sub").mkdir()
        (out.path / "a.bin").write_bytes(b"a")
        (out.path / "sub" / "b.bin").write_bytes(b"b")
        temp = out.path
        real_rename = type(temp).rename
        monkeypatch.setattr(type(temp), "rename", lambda p, t: (renamed_at.append(len(synced)), real_rename(p, t))[1])
        out.commit()
    before = set(synced[: renamed_at[0]])
    assert {str(temp / "a.bin"), str(temp / "sub" / "b.bin"), str(temp / "sub"), str(temp)} <= before
    assert synced[-1] == str(tmp_path)  # the folder holding the renamed target, after the rename
    assert (target / "sub" / "b.bin").read_bytes() == b"b"
