"""Capture activations: attention inputs layer by layer (`calibrate`, optionally converting each layer as it is
reached), and what chosen modules return (`OutputCapture`, e.g. q/k projections or attention outputs).

One forward pass over the calibration windows with a pre-hook on every attention module. When the
pass reaches layer l, the hook hands l's input activations to a callback; in sequential mode the
callback returns layer l's converted tensors (at the source's shapes), which are loaded into the
model before l's attention runs, so layers l+1.. are calibrated on the converted model's activations.
Only one layer's statistics and weights are handled at a time; callers pass a model from
attnkit.runtime.streaming.load_for_calibration, which keeps only the running decoder layer resident.
"""

from __future__ import annotations

from collections.abc import Callable

from attnkit.errors import AttnkitError


class OutputCapture:
    """Forward hooks that keep what some modules return (a tuple's first element), by key, until `take()`.

    `keep(tensor)` turns an output into what is kept (default: the tensor itself, gradients and all; e.g.
    `lambda t: t.detach().float().cpu()` to collect over many windows). Use as a context manager: leaving the
    block removes the hooks."""

    def __init__(self, modules: dict, keep: Callable | None = None):
        self.outputs: dict[str, list] = {key: [] for key in modules}
        self._keep = keep or (lambda t: t)
        self._handles = [m.register_forward_hook(self._keeper(key)) for key, m in modules.items()]

    def _keeper(self, key: str):
        def hook(_module, _args, output):
            self.outputs[key].append(self._keep(output[0] if isinstance(output, tuple) else output))

        return hook

    def take(self) -> dict[str, list]:
        """Everything kept since the last take(), by key (a list of outputs, one per call)."""
        out, self.outputs = self.outputs, {key: [] for key in self.outputs}
        return out

    def __enter__(self) -> OutputCapture:
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()


def attention_module_name(k_template: str, prefix: str, layer: int) -> str:
    """Module path of layer `layer`'s attention from the k (or qkv) tensor template:
    'layers.{i}.self_attn.k_proj.weight' -> 'model.layers.3.self_attn'."""
    return prefix + k_template.format(i=layer).rsplit(".", 2)[0]


def token_rows(hidden, augment: bool):
    """hidden [B, T, n] -> float64 CPU rows [B*T, n], with a constant-1 column when augmenting."""
    import torch

    x = hidden.detach().reshape(-1, hidden.shape[-1]).to(device="cpu", dtype=torch.float64)  # [B*T, n]
    if augment:
        x = torch.cat([x, torch.ones(x.shape[0], 1, dtype=torch.float64)], dim=1)  # [B*T, n+1]
    return x


def input_covariance(hidden, augment: bool):
    """E[x x^T] over all tokens of hidden [B, T, n]: float64 on CPU, [n(+1), n(+1)]."""
    return input_moments(hidden, augment)[0]


def input_moments(hidden, augment: bool):
    """(E[x x^T] [n(+1), n(+1)], E[x] [n(+1)]) over all tokens of hidden [B, T, n], float64 on CPU."""
    x = token_rows(hidden, augment)
    return (x.T @ x).div_(x.shape[0]), x.mean(0)


def calibrate(model, windows, module_names: list[str], on_layer: Callable[..., dict | None]) -> None:
    """Run `model` once on windows [N, T]; for each layer in forward order call
    on_layer(l, hidden [N, T, n], position_embeddings (cos, sin) or None, the module's softmax scaling).

    on_layer may return {parameter name: tensor} to load into the model before that layer's
    attention runs (sequential calibration), or None to leave the model unchanged.
    """
    import torch

    from attnkit.progress import phase

    reached: list[int] = []

    def make_hook(layer: int):
        def hook(_module, args, kwargs):
            hidden = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, T, n]
            updates = on_layer(layer, hidden, kwargs.get("position_embeddings"), getattr(_module, "scaling", None))
            for name, tensor in (updates or {}).items():
                param = model.get_parameter(name)
                param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))
            reached.append(layer)
            advance(1)

        return hook

    handles = []
    label = f"calibrating on {windows.numel():,} tokens"
    try:
        for layer, name in enumerate(module_names):
            try:
                module = model.get_submodule(name)
            except AttributeError:
                raise AttnkitError(f"calibration: the loaded model has no module {name!r}") from None
            handles.append(module.register_forward_pre_hook(make_hook(layer), with_kwargs=True))
        with torch.no_grad(), phase(label, len(module_names), "layers") as advance:
            model(input_ids=windows.to(model.get_input_embeddings().weight.device), use_cache=False, logits_to_keep=1)
    finally:
        for handle in handles:
            handle.remove()
    if sorted(reached) != list(range(len(module_names))):
        raise AttnkitError(f"calibration reached {len(reached)} of {len(module_names)} attention layers")
