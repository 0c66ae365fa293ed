"""Final hidden states of a causal LM and its output logits in position chunks (never all [T, V] at once)."""

from __future__ import annotations

from collections.abc import Iterator

#: Elements of one fp32 logits chunk (64 MiB).
CHUNK_ELEMENTS = 1 << 24


def _head_logits(model, hidden):
    """Apply the output head (and Gemma-style final soft-cap) to hidden [B, c, d] -> fp32 logits [B, c, V]."""
    import torch

    head = model.get_output_embeddings()
    logits = head(hidden.to(head.weight.device)).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = cap * torch.tanh(logits / cap)
    return logits


def final_hidden(model, ids):
    """Run the model once on ids [B, T]; returns the last hidden state [B, T, d] after the final norm.

    The head is checked on the last position against the model's own logits, so models whose head
    does more than a linear map (+ final soft-cap) are refused instead of silently mis-scored.
    """
    import torch

    from attnkit.errors import AttnkitError

    captured = {}

    def grab(_module, _args, output):
        captured["h"] = output[0]

    handle = model.base_model.register_forward_hook(grab)
    try:
        with torch.no_grad():
            out = model(input_ids=ids.to(_input_device(model)), use_cache=False, logits_to_keep=1)
    finally:
        handle.remove()
    hidden = captured["h"]  # [B, T, d]
    mine = _head_logits(model, hidden[:, -1:])
    theirs = out.logits[:, -1:].float().to(mine.device)
    if not torch.allclose(mine, theirs, rtol=1e-3, atol=1e-3 * float(theirs.abs().max().clamp_min(1.0))):
        raise AttnkitError(f"{type(model).__name__}: its output head is not a plain linear map; not supported")
    return hidden


def batch_hidden(model, windows, batch_size: int) -> Iterator[tuple[object, object]]:
    """Yield (ids [B, T], final hidden states [B, T, d]) per batch of windows [N, T]; a LayerStreamed model
    (attnkit.runtime.layerwise) runs every window layer by layer first, then hands out the same batches."""
    from attnkit.runtime.layerwise import LayerStreamed
    from attnkit.runtime.texts import batches

    if isinstance(model, LayerStreamed):
        hidden = model.final_hidden(windows, batch_size)
        for start, ids in zip(range(0, windows.shape[0], batch_size), batches(windows, batch_size)):
            yield ids, hidden[start : start + ids.shape[0]]
        return
    for ids in batches(windows, batch_size):
        yield ids, final_hidden(model, ids)


def head_module(model):
    """The nn.Module whose output head scores hidden states (a LayerStreamed model's own)."""
    return getattr(model, "model", model) if type(model).__name__ == "LayerStreamed" else model


def logit_chunks(model, hidden) -> Iterator[tuple[int, object]]:
    """Yield (start, fp32 logits [B, c, V]) over positions of hidden [B, T, d]."""
    batch, seq = hidden.shape[:2]
    vocab = model.get_output_embeddings().weight.shape[0]
    step = max(1, CHUNK_ELEMENTS // max(1, batch * vocab))
    for start in range(0, seq, step):
        yield start, _head_logits(model, hidden[:, start : start + step])


def _input_device(model):
    return model.get_input_embeddings().weight.device
