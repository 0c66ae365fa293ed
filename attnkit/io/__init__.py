"""Checkpoint files and the hub: resolution, headers, readers and writers (no tensor math)."""
