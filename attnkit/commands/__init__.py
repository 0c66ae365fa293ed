"""Command logic behind the CLI: each module computes data; attnkit/cli renders it."""
