"""The real-model tier's cache lives in attnkit's user cache, not in the checkout (it holds ~520 MB per model)."""

from __future__ import annotations

import os
from pathlib import Path

from attnkit import realmodels

ROOT = Path(__file__).resolve().parent.parent


def test_default_cache_is_outside_the_checkout_and_shared_with_attnkit(monkeypatch, tmp_path):
    for name in ("ATTNKIT_TEST_CACHE", "ATTNKIT_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert realmodels._cache() == tmp_path / "xdg" / "attnkit" / "tests"
    monkeypatch.setenv("ATTNKIT_TEST_CACHE", str(tmp_path / "mine"))
    assert realmodels._cache() == tmp_path / "mine"


def test_this_run_uses_one_cache_folder_outside_the_checkout():
    assert os.environ["ATTNKIT_CACHE"] == str(realmodels.CACHE)
    if not os.environ.get("ATTNKIT_TEST_CACHE"):
        assert not realmodels.CACHE.resolve().is_relative_to(ROOT)
