"""convert gqa|mqa|mla: rewrite a checkpoint into another attention variant."""
