"""Attention hook through transformers' AttentionInterface: the real attention output plus a statistics callback."""

from __future__ import annotations

import contextlib
import contextvars
import sys
from collections.abc import Callable, Iterator

from attnkit.errors import AttnkitError

PROBE = "attnkit_probe"  # wraps sdpa, gets sdpa's boolean masks
PROBE_EAGER = "attnkit_probe_eager"  # wraps the model's own eager function, gets additive float masks
PROBE_SOFTCAP = "attnkit_probe_softcap"  # wraps attnkit_softcap (runtime/capped_attention.py), additive float masks
PROBE_PADDED = "attnkit_probe_padded"  # wraps attnkit_sdpa (runtime/padded_attention.py), gets sdpa's boolean masks
_BASES = {PROBE: "sdpa", PROBE_EAGER: "eager", PROBE_SOFTCAP: "attnkit_softcap", PROBE_PADDED: "attnkit_sdpa"}

#: callback(module, query, key, attention_mask, kwargs) of the model being probed.
_callback: contextvars.ContextVar[Callable | None] = contextvars.ContextVar("attnkit_probe_callback", default=None)


def _base_function(base: str, module):
    """The function the model would call for `base`: its own eager_attention_forward, or the registered one."""
    if base == "eager":
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise AttnkitError(f"{type(module).__name__}: no eager_attention_forward to delegate to")
        return fn
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def _make(name: str):
    base = _BASES[name]

    def attention(module, query, key, value, attention_mask, **kwargs):
        """Compute the real attention (sdpa/eager semantics, soft-cap, window, sinks), then report q/k/mask."""
        output = _base_function(base, module)(module, query, key, value, attention_mask, **kwargs)
        callback = _callback.get()
        if callback is not None:
            callback(module, query, key, attention_mask, kwargs)
        return output

    return attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

    AttentionInterface.register(PROBE, _make(PROBE))
    AttentionInterface.register(PROBE_EAGER, _make(PROBE_EAGER))
    AttentionMaskInterface.register(PROBE, sdpa_mask)
    AttentionMaskInterface.register(PROBE_EAGER, eager_mask)
    AttentionInterface.register(PROBE_SOFTCAP, _make(PROBE_SOFTCAP))
    AttentionMaskInterface.register(PROBE_SOFTCAP, eager_mask)
    AttentionInterface.register(PROBE_PADDED, _make(PROBE_PADDED))
    AttentionMaskInterface.register(PROBE_PADDED, sdpa_mask)


@contextlib.contextmanager
def attention_hook(model, callback: Callable) -> Iterator[None]:
    """Within the block, every attention call of `model` also calls callback(module, query, key, mask, kwargs)."""
    base = model.config._attn_implementation
    name = {v: k for k, v in _BASES.items()}.get(base)
    if name is None:
        raise AttnkitError(f"attention implementation {base!r} cannot be probed; load the model with sdpa or eager")
    _register()
    token = _callback.set(callback)
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(base)
        _callback.reset(token)


def layer_index(model) -> Callable:
    """module -> layer number: module.layer_idx where models set it, else order of appearance."""
    order: dict[int, int] = {}

    def index(module) -> int:
        idx = getattr(module, "layer_idx", None)
        if idx is not None:
            return int(idx)
        return order.setdefault(id(module), len(order))

    return index
