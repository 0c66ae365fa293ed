"""Running models: loading checkpoints, text windows, final hidden states and the attention hook."""

from attnkit.runtime.loader import LoadedModel, load_model
from attnkit.runtime.texts import batches, make_windows, read_texts

__all__ = ["LoadedModel", "load_model", "read_texts", "make_windows", "batches"]
