"""Exceptions that the CLI turns into one-line messages and exit codes."""

EXIT_OK = 0
EXIT_RUNTIME = 1
EXIT_USAGE = 2
EXIT_THRESHOLD = 3


class AttnkitError(Exception):
    """A runtime failure with a message fit for one line of output (exit code 1)."""

    exit_code = EXIT_RUNTIME


class UsageError(AttnkitError):
    """Bad arguments or option values (exit code 2)."""

    exit_code = EXIT_USAGE


class ThresholdError(AttnkitError):
    """A CI threshold was crossed (exit code 3)."""

    exit_code = EXIT_THRESHOLD
