"""Shared fixtures: tiny checkpoints in tmp dirs, and the CLI runner."""

from __future__ import annotations

import os
import shutil

import pytest
from typer.testing import CliRunner

from attnkit.realmodels import CACHE
from tests.tiny import make_checkpoint

# attnkit's GGUF cache and the real-model helpers share one folder (see attnkit/realmodels.py), outside the checkout.
os.environ["ATTNKIT_CACHE"] = str(CACHE)


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner()


@pytest.fixture
def tiny(tmp_path_factory):
    """Factory: tiny(family, **config_overrides) -> folder of a saved random tiny checkpoint."""
    counter = {"n": 0}

    def make(family: str = "llama", seed: int = 0, max_shard_size: str | None = None, **overrides):
        counter["n"] += 1
        folder = tmp_path_factory.mktemp(f"{family}{counter['n']}")
        return make_checkpoint(folder, family, seed=seed, max_shard_size=max_shard_size, **overrides)

    return make


@pytest.fixture(scope="module")
def module_tmp(tmp_path_factory):
    """A folder for a module's shared outputs (a real model's are GB-sized), removed when the module ends: pytest
    removes a passing test's tmp_path at once, but a module fixture's folders only when the whole run ends."""
    path = tmp_path_factory.mktemp("module")
    yield path
    shutil.rmtree(path, ignore_errors=True)
