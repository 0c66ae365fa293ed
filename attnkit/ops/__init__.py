"""Pure tensor math: no files, no printing."""
