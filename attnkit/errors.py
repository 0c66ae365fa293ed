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


class Terminated(KeyboardInterrupt):
    """SIGTERM (or SIGHUP) arrived: unwinds like Ctrl-C, so every cleanup runs; exit code 128 + signal."""

    def __init__(self, signum: int, name: str):
        super().__init__(name)
        self.signum, self.name = signum, name
        self.exit_code = 128 + signum
