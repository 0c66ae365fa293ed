"""`convert mla --layer-budget auto`: how --kv-budget is shared among the converted layers of a layout that gives each
layer its own shape (--target gemma3-mla), chosen on the user's model by measuring each layer through it.

The layers do not matter alike: on Gemma 3 270M at half the cache one global layer holds the pass keys and another
loses nothing at a sixth of its share (docs/convert-mla.md, "### Which global layer holds the pass keys"), and
neither the fit's own errors nor where the source's attention goes shows which. So each converted layer is fitted
on the source's own calibration activations and measured alone: its cost is the mean KL(source || the source with
that one layer converted) over one long window of the calibration text (LONG_WINDOW tokens, or the model's
context), every KL_STRIDE-th token. Then layers trade in pairs, costliest with cheapest: the giver keeps its RoPE
key and GIVER_LATENT latent channels (plus its key factors), the taker gets the rest of the pair's cache with its
whole key in its RoPE key (P = D: its keys exact, the rest its latent, for the values). A trade stands where the
pair's costs at their new shapes, measured the same way, sum to less than at the even share; trading stops at the
first that does not. Only layers that hold the same tokens (the same sliding window, or none) trade, so the whole
cache stays what --kv-budget gives at every length. The self-check then judges the output on
held-out text, as it judges every output."""

from __future__ import annotations

import dataclasses
import time

from attnkit.commands.convert.mla_layer import fit_layer
from attnkit.commands.convert.mla_request import MLARequest, MLASource
from attnkit.commands.convert.mla_target import target_config
from attnkit.commands.rewrite import CALIB_FLAGS
from attnkit.errors import AttnkitError
from attnkit.io.reader import LazyReader
from attnkit.ops.mla import MLAShape
from attnkit.runtime.attention import replaced_output
from attnkit.runtime.calibrate import attention_module_name, calibrate
from attnkit.runtime.texts import make_windows, read_texts

#: Latent channels a giver keeps besides its key factors (Gemma 3 270M's layer 17 lost nothing at 11 or 43).
GIVER_LATENT = 11
#: The window the costs are measured on, capped at the model's context, and the tokens scored in it.
LONG_WINDOW = 4096
KL_STRIDE = 4
#: Vocabulary rows of the output head made float32 at a time, and scored tokens per block of log-probabilities (the
#: source's are kept: L / KL_STRIDE x vocabulary floats, 1 GiB for Gemma 3's 262,144 at 4,096 tokens).
HEAD_ROWS = 1 << 15
CHUNK = 64


def applies(req: MLARequest, src: MLASource) -> bool:
    """Whether --layer-budget auto has anything to choose: a budget to share, a layout whose layers may differ, two
    converted layers or more, no --layer-shape."""
    return (
        req.layer_budget == "auto"
        and req.kv_budget is not None
        and src.target.layer_shapes
        and not req.layer_shapes
        and len(src.converted_layers) >= 2
    )


def trade_shapes(src: MLASource) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """((R, P) of a giver, (R, P) of a taker) of one trade at `src`'s even share (R counts the key factors), or
    None where the share is too small for a taker to hold its whole key and more latent than the giver."""
    extra = src.target.besides_latent(src.spec)
    share, rope, head = src.rank + src.shape.rope_dim, src.shape.rope_dim, src.spec.head_dim
    giver = (extra + GIVER_LATENT, rope)
    taker = (2 * share - sum(giver) - head, head)
    return (giver, taker) if sum(giver) < share and taker[0] > giver[0] else None


def choose_layer_budget(req: MLARequest, src: MLASource, loaded, windows, log) -> MLASource:
    """`src` with the layer shapes --layer-budget auto chooses (none where no trade stands), and the measurement
    in src.layer_budget (the report's `layer_budget`)."""
    if not applies(req, src):
        return src
    started = time.perf_counter()
    shapes = trade_shapes(src)
    if shapes is None:
        return dataclasses.replace(src, layer_budget={"chosen": "even", "why": "the share holds no trade"})
    long = _long_window(req, loaded, src)
    if long is None:
        why = f"the --calib text holds no {LONG_WINDOW:,}-token window to measure on"
        return dataclasses.replace(src, layer_budget={"chosen": "even", "why": why})
    log("measuring what each converted layer costs alone ...")
    even = (src.rank, src.shape.rope_dim)
    variants = {shape: _at_shape(src, shape) for shape in {even, *shapes}}
    fits = _fit_alone(req, variants, loaded, windows)
    with LazyReader(src.ckpt.weight_files) as reader:
        scorer = _Scorer(src, loaded, long, reader)

        def cost(layer: int, shape: tuple[int, int]) -> float:
            tensors, scale = fits[layer, shape]
            return scorer.kl(layer, variants[shape][1], tensors, scale)

        costs = {layer: cost(layer, even) for layer in src.converted_layers}
        chosen, trades = _trade(costs, cost, src.spec.layer_windows, shapes)
    extra = src.target.besides_latent(src.spec)
    own = {layer: _shape(src, rank - extra, rope) for layer, (rank, rope) in chosen.items()}
    report = {
        "chosen": "traded" if own else "even",
        "costs": {str(layer): kl for layer, kl in sorted(costs.items())},
        "trades": trades,
        "text": {"files": list(req.calib), "tokens": int(long.shape[1]), "scored_every": KL_STRIDE},
        "seconds": time.perf_counter() - started,
    }
    return dataclasses.replace(src, layer_shapes=own, layer_budget=report)


def _trade(costs: dict, cost, windows: tuple, shapes: tuple) -> tuple[dict, list]:
    """({layer: (R, P)} of the trades that stand, every trade tried): costliest layer first, each takes the share of
    the cheapest left that holds the same tokens (`windows`: per layer its sliding window or None), at `shapes`
    (giver, taker); `costs`: each layer's alone at the even share, cost(layer, shape): at another."""
    giver, taker = shapes
    left, chosen, trades = set(costs), {}, []
    while left:
        high = max(left, key=costs.get)
        left.discard(high)
        alike = [layer for layer in left if windows[layer] == windows[high]]
        if not alike:
            continue
        low = min(alike, key=costs.get)
        before, after = costs[high] + costs[low], cost(high, taker) + cost(low, giver)
        trades.append({"taker": high, "giver": low, "cost_even": before, "cost": after, "stands": after < before})
        if after >= before:
            break
        chosen |= {high: taker, low: giver}
        left.discard(low)
    return chosen, trades


def _shape(src: MLASource, latent: int, rope: int) -> MLAShape:
    return dataclasses.replace(src.shape, latent_rank=latent, rope_dim=rope)


def _at_shape(src: MLASource, shape: tuple[int, int]) -> tuple[MLASource, object]:
    """(`src` with every converted layer at `shape` (R, P), its target config)."""
    own = _shape(src, shape[0] - src.target.besides_latent(src.spec), shape[1])
    variant = dataclasses.replace(src, layer_shapes={layer: own for layer in src.converted_layers})
    return variant, target_config(variant, bias_route=False)


def _long_window(req: MLARequest, loaded, src: MLASource):
    """The first window of LONG_WINDOW tokens (the model's context where shorter) of the --calib text [1, L], or
    None where it holds none."""
    longest = src.arch.config_value(src.config, "max_positions") or LONG_WINDOW
    length = min(LONG_WINDOW, longest)
    try:
        return make_windows(loaded.tokenizer, read_texts(req.calib), length, length, flags=CALIB_FLAGS)
    except AttnkitError:
        return None


def _fit_alone(req: MLARequest, variants: dict, loaded, windows) -> dict:
    """{(layer, shape): (tensors, input scale)}: each converted layer fitted at each shape of `variants` on the
    source's own activations (no layer replaced: each is measured alone)."""
    src = next(iter(variants.values()))[0]
    modules = [attention_module_name(src.arch.tensors["k"], src.prefix, i) for i in range(src.spec.num_layers)]
    fits = {}
    with LazyReader(src.ckpt.weight_files) as reader:
        dtype = reader.get(src.layer_names[0]["o"]).dtype

        def on_layer(layer: int, hidden, rope=None, scaling=None):
            if layer in src.plain_layers:
                return None
            window = getattr(loaded.model.get_submodule(modules[layer]), "sliding_window", None)
            for shape, (variant, config) in variants.items():
                inputs = (hidden, rope, scaling, window)
                tensors, _, scale = fit_layer(req.options, variant, layer, reader, inputs, config, loaded.device, dtype)
                fits[layer, shape] = (tensors, scale)
            return None

        calibrate(loaded.model, windows, modules, on_layer)
    return fits


class _Scorer:
    """KL(source || the source with one converted layer) on one window, from the calibration model's final hidden
    states (its head is an identity: attnkit.runtime.streaming) and the checkpoint's output head; the source's
    log-probabilities are computed once."""

    def __init__(self, src: MLASource, loaded, window, reader):
        self.src, self.loaded, self.window = src, loaded, window
        head = src.arch.head_name if src.arch.head_name in reader.names() else src.tensor("embed", None)
        self.head = reader.get(head)  # [V, n], as stored
        self.cap = src.spec.final_softcap
        reference = self._hidden()
        self.reference = [self._log_probs(reference[i : i + CHUNK]) for i in range(0, reference.shape[0], CHUNK)]

    def _hidden(self):
        """Final hidden states [L, n] of the calibration model on the window (scored positions only)."""
        import torch

        model, captured = self.loaded.model, {}
        handle = model.base_model.register_forward_hook(lambda _m, _a, output: captured.update(h=output[0]))
        try:
            with torch.no_grad():
                model(input_ids=self.window.to(self.loaded.device), use_cache=False, logits_to_keep=1)
        finally:
            handle.remove()
        return captured["h"][0, ::KL_STRIDE].float()  # [L / KL_STRIDE, n]

    def _log_probs(self, hidden):
        """hidden [c, n] -> log-probabilities [c, V] (fp32; the head a block of rows at a time)."""
        import torch

        rows = range(0, self.head.shape[0], HEAD_ROWS)
        logits = torch.cat([hidden @ self.head[i : i + HEAD_ROWS].to(hidden).T for i in rows], dim=-1)
        if self.cap:
            logits = self.cap * torch.tanh(logits / self.cap)
        return torch.log_softmax(logits, dim=-1)

    def kl(self, layer: int, config, tensors: dict, scale) -> float:
        """Mean KL(source || source with `layer` converted to `tensors`) per scored token."""
        module = self.loaded.model.get_submodule(
            attention_module_name(self.src.arch.tensors["k"], self.src.prefix, layer)
        )
        with replaced_output(module, config, layer, tensors, self.loaded.device, scale):
            hidden = self._hidden()
        total = 0.0
        for p, start in zip(self.reference, range(0, hidden.shape[0], CHUNK), strict=True):
            q = self._log_probs(hidden[start : start + CHUNK])
            total += float((p.exp() * (p - q)).sum())
        return total / hidden.shape[0]
