"""Seeded fuzzing of the metadata readers: any exception other than AttnkitError is a failure.

Each reader gets CASES mutated inputs from tests/hostile.py (a few seconds in all on 2 CPU cores).
tests/hostile_battery.py runs the same mutators with many more cases.
"""

from __future__ import annotations

import random
import traceback
from collections import Counter

import pytest

from attnkit.errors import AttnkitError
from attnkit.io.checkpoint import INDEX_NAME, safetensors_files
from attnkit.io.gguf_meta import read_gguf
from attnkit.io.safetensors_header import read_header
from tests import hostile
from tests.helpers import library_accepts

CASES = 500


def _outcome(fn) -> str:
    """'ok', 'error' (AttnkitError) or 'crash: <type> in <function>'."""
    try:
        fn()
    except AttnkitError:
        return "error"
    except Exception as exc:  # noqa: BLE001 - what the test looks for
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        return f"crash: {type(exc).__name__} in {frame.name} ({frame.filename.rsplit('/', 1)[-1]}:{frame.lineno})"
    return "ok"


def _assert_clean(outcomes: Counter) -> None:
    crashes = {k: v for k, v in outcomes.items() if k.startswith("crash")}
    assert not crashes, crashes
    assert outcomes["error"] > CASES // 2 and outcomes["ok"] > 0, outcomes  # the mutator reaches both answers


def test_safetensors_headers_never_crash_nor_pass_what_the_library_refuses(tmp_path):
    rng = random.Random(12)
    path = tmp_path / "model.safetensors"
    outcomes: Counter = Counter()
    lax = []
    for _ in range(CASES):
        path.write_bytes(hostile.mutate_safetensors(rng))
        outcome = _outcome(lambda: read_header(path))
        outcomes[outcome] += 1
        if outcome == "ok" and not library_accepts(path):
            lax.append(path.read_bytes()[:200])
    _assert_clean(outcomes)
    assert lax == []


def test_index_json_never_crashes(tmp_path):
    rng = random.Random(13)
    for shard in hostile.SHARDS:
        (tmp_path / shard).write_bytes(hostile.safetensors_bytes(hostile.safetensors_header()))
    outcomes: Counter = Counter()
    for _ in range(CASES):
        (tmp_path / INDEX_NAME).write_bytes(hostile.mutate_index(rng))
        outcomes[_outcome(lambda: safetensors_files(tmp_path))] += 1
    _assert_clean(outcomes)


def test_gguf_headers_never_crash(tmp_path):
    rng = random.Random(14)
    path = tmp_path / "model.gguf"
    outcomes: Counter = Counter()
    for _ in range(CASES):
        path.write_bytes(hostile.mutate_gguf(rng))
        outcomes[_outcome(lambda: read_gguf(path))] += 1
    _assert_clean(outcomes)


@pytest.mark.parametrize("make", [hostile.safetensors_bytes, hostile.gguf_bytes])
def test_the_unmutated_inputs_are_valid(tmp_path, make):
    """The fuzzers start from valid files, so a refusal is the mutation's doing."""
    if make is hostile.safetensors_bytes:
        path = tmp_path / "m.safetensors"
        path.write_bytes(make(hostile.safetensors_header()))
        infos, metadata = read_header(path)
        assert set(infos) == {"a", "b", "c"} and metadata == {"format": "pt"} and library_accepts(path)
    else:
        path = tmp_path / "m.gguf"
        path.write_bytes(make(hostile.gguf_fields(), hostile.gguf_tensors()))
        config, tensors = read_gguf(path)
        assert (config["num_hidden_layers"], config["num_key_value_heads"], len(tensors)) == (2, 2, 11)
