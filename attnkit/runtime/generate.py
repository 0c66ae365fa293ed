"""Greedy continuations of a prompt: what a rewrite says, next to what its source said."""

from __future__ import annotations


def greedy(loaded, prompt: str, new_tokens: int) -> str | None:
    """The model's greedy continuation of `prompt` (`new_tokens` at most, fewer at EOS), decoded; None
    without a tokenizer."""
    import torch
    from transformers import GenerationConfig

    tokenizer = loaded.tokenizer
    if tokenizer is None:
        return None
    ids = torch.tensor([tokenizer(prompt, add_special_tokens=False)["input_ids"]], device=loaded.device)  # [1, T]
    config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    with torch.no_grad():
        out = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)  # [1, T + n]
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
