"""attnkit: analyse and rewrite the attention layers of transformer checkpoints."""

__version__ = "0.1.0"

from attnkit.api import load_model  # noqa: E402  (no heavy imports until called)

__all__ = ["__version__", "load_model"]
