"""attnkit: analyse and rewrite the attention layers of transformer checkpoints."""

__version__ = "0.1.0"
