"""Serving engines: what their loaders and kernels take (targets), and running an output in them (verify)."""
