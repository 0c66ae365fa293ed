"""Generation checks: greedy continuations of a prompt (what a rewrite says, next to what its source said), and
what a model's DynamicCache holds per token after a generate call."""

from __future__ import annotations


def greedy(loaded, prompt: str, new_tokens: int) -> str | None:
    """The model's greedy continuation of `prompt` (`new_tokens` at most, fewer at EOS), decoded; None
    without a tokenizer. The prompt starts as the tokenizer starts a text (attnkit.runtime.texts)."""
    import torch
    from transformers import GenerationConfig

    from attnkit.runtime.texts import prompt_ids

    tokenizer = loaded.tokenizer
    if tokenizer is None:
        return None
    ids = torch.tensor([prompt_ids(tokenizer, prompt)], device=loaded.device)  # [1, T]
    config = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
    )
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)  # [1, T + n]
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def cache_check(model, prompt_len: int = 8, new_tokens: int = 4, layer: int = 0) -> dict:
    """Generate with the converted model and read what its DynamicCache holds per token in `layer`."""
    import torch

    ids = torch.arange(3, 3 + prompt_len, device=model.device)[None] % model.config.vocab_size
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            return_dict_in_generate=True,
            pad_token_id=model.config.pad_token_id,
        )
    cached = out.past_key_values.layers[layer]
    k, v = cached.keys, cached.values  # [B, 1, T, R] and [B, 1, T, P]
    tokens = k.shape[2]
    per_token = (k.numel() + v.numel()) // (k.shape[0] * tokens)
    return {
        "layer": layer,
        "key_shape": list(k.shape),
        "value_shape": list(v.shape),
        "tokens": tokens,
        "values_per_token_layer": per_token,
    }
