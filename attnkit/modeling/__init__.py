"""Model classes attnkit writes checkpoints for that transformers does not ship; importing this package registers
them with transformers' Auto classes (`import attnkit.modeling`, then AutoModelForCausalLM.from_pretrained)."""

from attnkit.modeling.gemma3_mla import register

register()

__all__ = ["register"]
