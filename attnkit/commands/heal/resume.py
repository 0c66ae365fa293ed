"""Resumable run state: written atomically every N steps and on Ctrl-C/SIGTERM, read back by --resume.

A checkpoint folder holds run.json (the run's fingerprint, counters and curves) and state.pt (the
trained tensors, the optimizer state and the best tensors so far). It is written into a temp folder
next to it and renamed into place (attnkit.io.writer.OutputDir), so a crash leaves the previous one.
"""

from __future__ import annotations

import json
from pathlib import Path

from attnkit.errors import AttnkitError
from attnkit.io.writer import OutputDir

RUN_FILE = "run.json"
STATE_FILE = "state.pt"


def read_run(folder: Path) -> dict:
    """The run.json of a checkpoint folder."""
    path = Path(folder) / RUN_FILE
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise AttnkitError(f"{path}: not a readable heal checkpoint ({exc})") from None


def check_fingerprint(folder: Path, fingerprint: dict) -> dict:
    """The checkpoint's run.json when it was written by a run with this fingerprint; else a one-line error."""
    run = read_run(folder)
    theirs = run.get("fingerprint") or {}
    for key, value in fingerprint.items():
        if theirs.get(key) != value:
            raise AttnkitError(
                f"--resume: {folder} is from another run ({key} was {_short(theirs.get(key))}, now {_short(value)})"
            )
    return run


def _short(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def save(folder: Path, run: dict, state: dict) -> None:
    """Write run.json and state.pt into a temp folder next to `folder`, then rename it into place."""
    import torch

    with OutputDir(Path(folder), overwrite=True) as out:
        torch.save(state, out.path / STATE_FILE)
        (out.path / RUN_FILE).write_text(json.dumps(run, indent=2) + "\n")
        out.commit()


def load_state(folder: Path) -> dict:
    """The state.pt of a checkpoint (tensors on CPU)."""
    import torch

    try:
        return torch.load(Path(folder) / STATE_FILE, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError) as exc:
        raise AttnkitError(f"{folder}: cannot read {STATE_FILE} ({exc})") from None
