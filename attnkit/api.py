"""The Python API: `attnkit.load_model(path)` runs any checkpoint attnkit wrote exactly as attnkit's commands do."""

from __future__ import annotations


def load_model(path: str, *, device: str = "auto", dtype: str = "auto", attn_implementation: str | None = None):
    """Load a causal LM with its tokenizer (attnkit.runtime.LoadedModel: .model, .tokenizer, .device, .dtype).

    Besides what `transformers.AutoModelForCausalLM` does, config soft-caps that stock transformers
    ignores for the model's family (attn_logit_softcapping, final_logit_softcapping, e.g. written by
    `attnkit retrofit softcap` into a Llama checkpoint) are applied: attention runs through
    attnkit's soft-capped eager function and `logits` are capped by a forward hook. Hub kernels are off
    (`use_kernels=False`): the model runs transformers' own code and fetches nothing at run time.
    """
    from attnkit.runtime import load_model as _load

    return _load(path, device=device, dtype=dtype, attn_implementation=attn_implementation)
