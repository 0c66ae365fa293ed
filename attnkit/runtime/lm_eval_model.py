"""attnkit as an lm-evaluation-harness model, "attnkit": lm-eval's own HFLM on the model as attnkit.load_model
loads it (GGUF files through the cache, retrofitted soft-caps applied), so every lm-eval task and setting works
and a stock model scores exactly as `lm_eval --model hf` scores it.

    lm_eval.simple_evaluate(model=AttnkitLM(pretrained="./mla-model"), tasks=[...])
    attnkit-lm-eval run --model attnkit --model_args pretrained=./mla-model,dtype=float32 --tasks ...

pyproject.toml declares it under the `lm_eval.models` entry-point group; lm-eval 0.4 does not read that group
yet, so `attnkit-lm-eval` (this module's `main`) registers the model and then runs lm-eval's own command line.
Importing this module needs lm-eval (`pip install 'attnkit[tasks]'`).
"""

from __future__ import annotations

import contextlib
import logging
import os

from lm_eval.api.registry import register_model
from lm_eval.models.huggingface import HFLM

from attnkit.runtime.loader import load_model


@register_model("attnkit")
class AttnkitLM(HFLM):
    """HFLM over attnkit.load_model(pretrained, device, dtype); every other argument is HFLM's."""

    def __init__(self, pretrained, device: str | None = "auto", dtype: str = "auto", **kwargs):
        import torch

        kwargs.pop("backend", None)  # always causal
        if device is None or (str(device).startswith("cuda") and not torch.cuda.is_available()):
            device = "auto"  # lm-eval's command line asks for cuda:0 by default; HFLM falls back the same way
        loaded = load_model(str(pretrained), device=device, dtype=dtype)
        super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, backend="causal", **kwargs)
        self.attnkit_ref = str(pretrained)


class _QuietHFLM(HFLM):
    """HFLM whose requests run without lm-eval's progress bars (attnkit's commands show their own)."""

    def loglikelihood(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood(requests, disable_tqdm=True)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        return super().loglikelihood_rolling(requests, disable_tqdm=True)

    def generate_until(self, requests, disable_tqdm: bool = False):
        return super().generate_until(requests, disable_tqdm=True)


def harness_model(loaded, **kwargs) -> HFLM:
    """HFLM over a model attnkit has loaded already (a LoadedModel), as AttnkitLM wraps the one it loads; quiet
    unless ATTNKIT_DEBUG=1."""
    cls = HFLM if _debug() else _QuietHFLM
    with quiet():
        return cls(pretrained=loaded.model, tokenizer=loaded.tokenizer, backend="causal", **kwargs)


def _debug() -> bool:
    return os.environ.get("ATTNKIT_DEBUG", "") not in ("", "0")


@contextlib.contextmanager
def quiet():
    """lm-eval's log lines below errors off inside the block (ATTNKIT_DEBUG=1 keeps them), as attnkit's command
    line quiets every library."""
    import datasets

    logger = logging.getLogger("lm_eval")
    level, bars = logger.level, datasets.utils.logging.is_progress_bar_enabled()
    if not _debug():
        logger.setLevel(logging.ERROR)
        datasets.disable_progress_bars()
    try:
        yield
    finally:
        logger.setLevel(level)
        if bars:
            datasets.enable_progress_bars()


def main() -> None:
    """`attnkit-lm-eval ...`: lm-eval's command line with the "attnkit" model registered."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()
