"""Run a causal LM layer by layer over a whole set of windows: memory holds one decoder layer's weights, whatever
the model's size, and each layer is read from the checkpoint once.

The model is built with its decoder layers on the meta device (attnkit.runtime.streaming.build_streamed). For
each batch of windows one stock forward pass runs with every decoder layer replaced by a recorder that keeps the
arguments the model gives it (the hidden states into the first layer, the attention mask and rotary tables of
each layer: per layer type, so sliding windows and per-type RoPE come out as the model makes them) and passes
the hidden states on. Then each layer is read, run on every batch's hidden states with that batch's recorded
arguments, and freed; the final norm closes. The math is the stock layers' on the same inputs in the same
order, so the final hidden states and whatever hooks collect per layer equal a fully loaded model's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from attnkit.progress import phase
from attnkit.runtime.streaming import build_streamed, drop_layer, read_layer


@dataclass
class LayerStreamed:
    """A model to run layer by layer (see the module docstring); `loaded` is its LoadedModel (layers on meta)."""

    loaded: object
    files: list
    layers: list  # [(prefix, decoder layer)]

    @property
    def model(self):
        return self.loaded.model

    @property
    def tokenizer(self):
        return self.loaded.tokenizer

    @property
    def dtype(self):
        return self.loaded.dtype

    def final_hidden(self, windows, batch_size: int):
        """Final hidden states [N, T, d] (after the final norm) of windows [N, T], on the model's device."""
        import torch

        with torch.no_grad():
            batches = [self._record(ids) for ids in windows.split(batch_size)]  # (hidden [B, T, d], [kwargs])
            hidden = [h for h, _ in batches]
            with phase(f"layer by layer over {windows.shape[0]} window(s)", len(self.layers), "layers") as advance:
                for i, (prefix, layer) in enumerate(self.layers):
                    read_layer(layer, self.files, prefix, self.loaded.device, self.loaded.dtype)
                    try:
                        hidden = [layer(h, **calls[i]) for h, (_, calls) in zip(hidden, batches)]
                    finally:
                        drop_layer(layer)
                    advance(1)
            norm = self.model.base_model.norm
            return torch.cat([norm(h) for h in hidden])

    def _record(self, ids):
        """(hidden states into the first layer [B, T, d], the keyword arguments of every layer) for ids [B, T]."""
        calls, first = [], {}

        def recorder(hidden_states, *args, **kwargs):
            if args:
                raise RuntimeError("decoder layers are called with keyword arguments after the hidden states")
            first.setdefault("hidden", hidden_states)
            calls.append(kwargs)
            return hidden_states

        with _replaced_forward([layer for _, layer in self.layers], recorder):
            self.model.base_model(input_ids=ids.to(self.loaded.device), use_cache=False)
        return first["hidden"], calls


@contextlib.contextmanager
def _replaced_forward(modules: list, forward):
    """Within the block, each module's forward is `forward` (an instance attribute over the class's method)."""
    for module in modules:
        module.forward = forward
    try:
        yield
    finally:
        for module in modules:
            del module.forward


def load_layerwise(ref, device: str = "auto", dtype=None) -> LayerStreamed:
    """The checkpoint (a reference or an opened Source) as a LayerStreamed model (safetensors checkpoints whose
    tensors are the model's parameters by name; StreamingUnsupported otherwise)."""
    return LayerStreamed(*build_streamed(ref, device, dtype))


#: How eval and probe run a model: layer by layer when it does not fit (auto), always, or never.
LAYER_STREAM = ("auto", "always", "never")
#: auto streams when the weights would take more than this share of the device's free memory.
FIT_SHARE = 0.8


def check_run_options(layer_stream: str, device_map: str | None) -> None:
    from attnkit.errors import UsageError

    if layer_stream not in LAYER_STREAM:
        raise UsageError(f"--layer-stream must be one of {', '.join(LAYER_STREAM)}, got {layer_stream!r}")
    if device_map is not None and device_map != "auto":
        raise UsageError(f"--device-map takes auto (accelerate's placement over the GPUs), got {device_map!r}")
    if device_map is not None and layer_stream == "always":
        raise UsageError("--device-map places a whole model; it cannot be combined with --layer-stream always")


def open_model(ref, *, device: str, dtype: str, layer_stream: str = "auto", device_map: str | None = None):
    """The model to run: LoadedModel (whole; placed by accelerate with device_map) or LayerStreamed. `ref`: a
    reference or the Source check_models opened, which is not opened again. auto streams a checkpoint whose
    weights (at the dtype it would run in) exceed FIT_SHARE of the device's free memory, where streaming applies
    (safetensors, parameters by name); a GGUF file runs whole."""
    from attnkit.errors import AttnkitError
    from attnkit.runtime.loader import free_memory, load_model, resolve_device, resolve_dtype, run_source
    from attnkit.runtime.streaming import StreamingUnsupported

    dev = resolve_device(device)
    src = run_source(ref, dequantize=layer_stream != "always")
    if layer_stream == "never" or device_map is not None:
        return load_model(src, device=device, dtype=dtype, device_map=device_map)
    run_dtype = resolve_dtype(dtype, dev, src.config)
    if layer_stream == "auto":
        needed = None if src.ckpt.dequantized_from else src.numel * run_dtype.itemsize
        free = free_memory(dev)
        if needed is None or free is None or needed <= FIT_SHARE * free:
            return load_model(src, device=device, dtype=dtype)
    try:
        return load_layerwise(src, device, run_dtype)
    except StreamingUnsupported as exc:
        if layer_stream == "always":
            raise AttnkitError(f"--layer-stream always: {exc}") from None
        return load_model(src, device=device, dtype=dtype)
