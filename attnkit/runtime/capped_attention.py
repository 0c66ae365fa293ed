"""Apply config soft-caps (attn_logit_softcapping, final_logit_softcapping) where transformers does not.

Checked against transformers 5.24: only Gemma 2 passes `softcap=` to its attention function, and
Gemma 2/3 apply the final-logit cap in their *ForCausalLM; every other family (Gemma 3's attention
included) ignores these keys. For those, `apply_softcaps` switches attention to `attnkit_softcap`
(eager math plus the cap, registered in transformers' AttentionInterface), passes the cap to it as
`softcap=` (a pre-hook on each attention module, so probes see it like Gemma 2's) and caps `logits`
with a forward hook on the top-level model. SDPA cannot soft-cap, so a capped model always runs eager math.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Name of attnkit's attention function in transformers' AttentionInterface.
ATTN_NAME = "attnkit_softcap"
#: model_type -> honoured natively by stock transformers 5.24 (attention cap, final cap).
NATIVE = {
    "gemma2": (True, True),
    "gemma3": (False, True),
    "gemma3_text": (False, True),
    "attnkit_gemma3_mla": (False, True),  # attnkit.modeling.gemma3_mla: Gemma3ForCausalLM's final cap
}

#: Callbacks (module, scores [B, H, Tq, Tk] before the cap, visible bool [B|1, 1|H, Tq, Tk] | None).
_observers: list[Callable] = []


@dataclass
class SoftcapState:
    """Caps found in a model's config and how each is applied ("native", "attnkit" or None when absent)."""

    attn_cap: float | None
    attn_path: str | None
    final_cap: float | None
    final_path: str | None

    @property
    def runtime_only(self) -> bool:
        """True when some cap is applied only by attnkit (stock transformers would ignore it)."""
        return "attnkit" in (self.attn_path, self.final_path)


def native_support(model_type: str | None) -> tuple[bool, bool]:
    """(attention cap honoured, final cap honoured) by stock transformers for `model_type`."""
    return NATIVE.get(model_type or "", (False, False))


def softcap_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **kwargs):
    """Eager attention with an optional soft-cap (`softcap=`, passed by Gemma 2 or injected by `apply_softcaps`).

    query [B, H, Tq, D], key/value [B, Hkv, Tk, D]; returns (output [B, Tq, H, Dv], probabilities [B, H, Tq, Tk]).
    """
    import torch
    from transformers.integrations.sdpa_attention import repeat_kv

    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    groups = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)  # [B, H, Tk, D]
    scores = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, H, Tq, Tk]
    mask = None if attention_mask is None else attention_mask[:, :, :, : key.shape[-2]]
    for observe in _observers:
        observe(module, scores, None if mask is None else _visible(mask))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        scores = scores + mask if mask.dtype != torch.bool else scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    probs = torch.nn.functional.dropout(probs, p=dropout, training=module.training)
    out = torch.matmul(probs, value).transpose(1, 2).contiguous()  # [B, Tq, H, Dv]
    return out, probs


def _visible(mask):
    """Bool visibility from a transformers attention mask (bool, or additive float with large negatives)."""
    import torch

    return mask if mask.dtype == torch.bool else mask > torch.finfo(mask.dtype).min / 2


def register() -> None:
    """Register `attnkit_softcap` (and the eager mask it needs) with transformers; idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTN_NAME, softcap_attention)
    AttentionMaskInterface.register(ATTN_NAME, eager_mask)


def use_attnkit_attention(model) -> None:
    """Run every attention layer of `model` through `attnkit_softcap`."""
    register()
    model.set_attn_implementation(ATTN_NAME)


def _final_cap_hook(cap: float):
    def hook(module, _args, kwargs, output):
        import torch

        if getattr(output, "logits", None) is None:
            return output
        output.logits = cap * torch.tanh(output.logits / cap)
        labels = kwargs.get("labels")
        if labels is not None and getattr(output, "loss", None) is not None:
            output.loss = module.loss_function(logits=output.logits, labels=labels, vocab_size=output.logits.shape[-1])
        return output

    return hook


def _inject_cap(cap: float):
    def pre_hook(_module, args, kwargs):
        kwargs.setdefault("softcap", cap)
        return args, kwargs

    return pre_hook


def _attention_modules(model) -> list:
    """The modules that call the attention interface (their classes end in "Attention": LlamaAttention, ...)."""
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "config")]


def apply_softcaps(model) -> SoftcapState:
    """Make `model` honour the soft-caps in its config; returns what was found and how it is applied."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    attn_cap = getattr(config, "attn_logit_softcapping", None)
    final_cap = getattr(config, "final_logit_softcapping", None)
    native_attn, native_final = native_support(getattr(config, "model_type", None))
    state = SoftcapState(attn_cap, None, final_cap, None)
    if attn_cap:
        state.attn_path = "native" if native_attn else "attnkit"
        if not native_attn and model.config._attn_implementation != ATTN_NAME:
            use_attnkit_attention(model)
            for module in _attention_modules(model):  # the cap reaches the attention call as `softcap=`, as in Gemma 2
                module.register_forward_pre_hook(_inject_cap(float(attn_cap)), with_kwargs=True)
    if final_cap:
        state.final_path = "native" if native_final else "attnkit"
        if not native_final and not getattr(model, "_attnkit_final_cap", None):
            model.register_forward_hook(_final_cap_hook(float(final_cap)), with_kwargs=True)
            model._attnkit_final_cap = float(final_cap)
    return state
