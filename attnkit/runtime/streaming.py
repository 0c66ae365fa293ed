"""Run a causal LM with its decoder layers read from the checkpoint only while they run (bounded memory).

The model is built on the meta device; embeddings, final norm and head are loaded once, and each
decoder layer's weights are read (on the target device) by a pre-hook just before the layer runs and
dropped by a post-hook right after. One forward pass then holds the non-layer weights plus one layer,
whatever the depth: what calibration needs to handle checkpoints larger than memory. The layers' linear
weights stay as stored and are widened a slice at a time as they are used (attnkit.runtime.sliced_linear),
so on the CPU a layer costs the pages of its file, not a float32 copy. The math is the stock
`transformers` forward, so outputs equal a fully loaded model's.
"""

from __future__ import annotations

import functools
import re

from attnkit.errors import AttnkitError


class StreamingUnsupported(AttnkitError):
    """The checkpoint's tensors are not the model's parameters one to one (e.g. fused MoE experts, GGUF)."""


def load_streaming(ref, device: str = "auto"):
    """LoadedModel (float32) whose decoder layers are streamed from the checkpoint, for calibration: the hidden
    states are what it is run for, so the output head is not loaded (an identity stands in, tied or not) and a
    plain embedding table stays in its stored dtype, its rows made float32 as they are looked up (exact:
    widening loses nothing). Made ready as load_model makes a model (loader.ready). `ref`: a reference or an
    opened Source (see build_streamed). Raises StreamingUnsupported when parameters and checkpoint tensors do not
    match by name."""
    loaded, files, layers = build_streamed(ref, device, hidden_only=True)
    for prefix, layer in layers:
        layer.register_forward_pre_hook(_loader(files, prefix, loaded.device, loaded.dtype), with_kwargs=True)
        layer.register_forward_hook(_dropper, with_kwargs=True)
    return loaded


def build_streamed(ref, device: str = "auto", dtype=None, hidden_only: bool = False):
    """(LoadedModel with its decoder layers on the meta device and everything else loaded, the weight files,
    [(prefix, layer)]): what load_streaming hooks up and attnkit.runtime.layerwise drives layer by layer.
    `ref`: a model reference, or the Source it was opened as (attnkit.runtime.loader.run_source), which is not
    opened again. `dtype`: a torch dtype for the weights (float32 when None); `hidden_only`: see load_streaming.

    The weight files are scanned for NaN and Inf once the model is known to stream (its parameters match the
    checkpoint's tensors by name) and before it is returned (Source.check_finite; a no-op for a Source a command
    opened with the scan): a layer is read only when the run reaches it, so a check as each layer is read would
    refuse a bad last layer after every other layer ran; the scan refuses it before any work, as a whole load
    does, at the cost of one more read of the weights (docs/checkpoints.md)."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from attnkit.io.reader import LazyReader
    from attnkit.runtime.loader import LoadedModel, load_tokenizer, ready, register_layouts, resolve_device, run_source
    from attnkit.runtime.sliced_linear import SlicedLinear, slice_linears

    dtype = dtype or torch.float32
    src = run_source(ref)
    ref, ckpt = src.ref, src.ckpt
    if not ckpt.weight_files:
        raise StreamingUnsupported(f"{ref}: only safetensors checkpoints can be streamed, not {ckpt.kind}")
    bound_heap()
    dev = resolve_device(device)
    register_layouts()
    try:
        config = AutoConfig.from_pretrained(str(ckpt.root))
        with init_empty_weights(include_buffers=False):  # parameters on meta; RoPE tables etc. computed for real
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except (ValueError, OSError, ImportError) as exc:  # load_model reports these its own way
        raise StreamingUnsupported(f"{ref}: cannot build the model on the meta device ({exc})") from None
    files = ckpt.weight_files
    embedding = model.get_input_embeddings()
    tied = bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    head = model.get_output_embeddings()
    headless = hidden_only and head is not None
    if headless:
        model.set_output_embeddings(torch.nn.Identity())  # an identity instead of a head nobody reads
    sliced = not hidden_only and type(head) is torch.nn.Linear and head.bias is None  # attnkit.runtime.sliced_linear
    # tables and heads stay as stored, widened as they are used; subclasses (Gemma's scaled embedding) may
    # compute in the table's dtype, so they are widened up front, as is a table that another head reads
    compact = type(embedding) is torch.nn.Embedding and (headless or sliced or not tied)
    with LazyReader(files) as reader:
        stored = set(reader.names())
        layers = _decoder_layers(model)
        for _, layer in layers:
            slice_linears(layer, dtype)  # read_layer keeps their weights as stored
        layer_param_ids = {id(p) for _, layer in layers for p in layer.parameters()}
        for name, param in model.named_parameters():
            if id(param) not in layer_param_ids and name in stored:
                keep = (compact and param is embedding.weight) or (sliced and not tied and param is head.weight)
                _set(model, name, _as_stored(reader.get(name), dtype) if keep else reader.get(name, dtype=dtype), dev)
    if compact:
        embedding.register_forward_hook(lambda module, args, out: out.to(dtype))
    if sliced:
        model.set_output_embeddings(SlicedLinear(embedding.weight if tied else head.weight, None, dtype))
    elif not headless:
        model.tie_weights()  # a tied head follows the embeddings just loaded
    _check_names(ref, model, layers, layer_param_ids, stored)
    src.check_finite()
    ready(model)
    loaded = LoadedModel(model=model, tokenizer=load_tokenizer(ckpt.root), checkpoint=ckpt, device=dev, dtype=dtype)
    return loaded, files, layers


def load_for_calibration(ref, device: str = "auto"):
    """load_streaming where the checkpoint allows it, else the fully loaded float32 model (load_model); `ref`:
    a reference or an opened Source (opened once here either way)."""
    from attnkit.runtime.loader import load_model, run_source

    src = run_source(ref)
    try:
        return load_streaming(src, device)
    except StreamingUnsupported:
        return load_model(src, device=device, dtype="float32")


def _as_stored(tensor, dtype):
    """The tensor in its stored dtype where that is no wider than `dtype` (widening per lookup is exact and
    the table stays small), else in `dtype` (narrowing first or per lookup rounds each element the same)."""
    return tensor if tensor.element_size() <= dtype.itemsize else tensor.to(dtype)


def _decoder_layers(model) -> list[tuple[str, object]]:
    """[(qualified name, module)] of the decoder layers: the children of the `layers` ModuleList."""
    import torch

    found = [
        (name, module)
        for name, module in model.named_modules()
        if re.search(r"(^|\.)(layers|h)$", name) and isinstance(module, torch.nn.ModuleList)
    ]
    if len(found) != 1:
        raise StreamingUnsupported(f"{type(model).__name__}: no single decoder layer list to stream")
    prefix, layers = found[0]
    return [(f"{prefix}.{i}", layer) for i, layer in enumerate(layers)]


def _check_names(ref: str, model, layers, layer_param_ids: set[int], stored: set[str]) -> None:
    """Every non-layer parameter loaded, every layer parameter present in the checkpoint under its own name."""
    left = [n for n, p in model.named_parameters() if id(p) not in layer_param_ids and p.is_meta]
    missing = [
        f"{prefix}.{n}"
        for prefix, layer in layers
        for n, _ in layer.named_parameters()
        if f"{prefix}.{n}" not in stored
    ]
    if left or missing:
        raise StreamingUnsupported(
            f"{ref}: checkpoint tensors do not match the model's parameters (e.g. {(left + missing)[0]})"
        )


def _set(module, name: str, value, device) -> None:
    """Replace parameter `name` of `module` (meta or real) by `value` on `device`, or by a meta tensor."""
    import torch

    owner_name, _, leaf = name.rpartition(".")
    owner = module.get_submodule(owner_name) if owner_name else module
    owner._parameters[leaf] = torch.nn.Parameter(value.to(device), requires_grad=False)


def read_layer(layer, files, prefix: str, device, dtype) -> None:
    """Read the layer's parameters from the checkpoint onto `device`: a SlicedLinear's as stored (where that is
    no wider than `dtype`), the others (norms) in `dtype`."""
    from attnkit.io.reader import LazyReader
    from attnkit.runtime.sliced_linear import sliced_parameters

    as_stored = sliced_parameters(layer)
    with LazyReader(files) as reader:
        for name, _ in list(layer.named_parameters()):
            tensor = reader.get(f"{prefix}.{name}")
            _set(layer, name, _as_stored(tensor, dtype) if name in as_stored else tensor.to(dtype), device)


def drop_layer(layer) -> None:
    """Put the layer's parameters back on the meta device and hand their memory back."""
    import torch

    for name, param in list(layer.named_parameters()):
        _set(layer, name, torch.empty_like(param, device="meta"), "meta")
    trim_heap()


def _loader(files, prefix: str, device, dtype):
    """Pre-hook: read_layer before the layer runs."""

    def hook(layer, args, kwargs):
        read_layer(layer, files, prefix, device, dtype)

    return hook


def _dropper(layer, args, kwargs, output):
    """Post-hook: drop_layer after the layer ran."""
    drop_layer(layer)
    return output


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc keeps freed arenas otherwise, so RSS would grow layer by layer)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


#: glibc's mallopt parameter for the size from which malloc maps memory of its own, and the size used here
M_MMAP_THRESHOLD, MMAP_THRESHOLD = -3, 1 << 20


def bound_heap() -> None:
    """Have glibc serve every allocation of 1 MiB or more by a mapping of its own, unmapped when freed. By default
    it moves that threshold up to 32 MiB as large blocks are freed and serves them from the heap, where the
    layer-sized buffers freed and made again in every layer leave holes that the OS never gets back: the held
    memory of a streamed run then creeps up layer after layer (docs/benchmarks.md, "big checkpoints").
    Process-wide, set once a run streams layers."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc (malloc_trim and mallopt), or None where the C library lacks them."""
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim, libc.mallopt  # noqa: B018 -- both, or neither
    except (OSError, AttributeError):
        return None
    return libc
