"""The exception types that end a run with one line instead of a stack trace."""


class ConfigError(ValueError):
    """A user error in flags or files; entry points print it as one line and exit with status 2."""


class TrainingStopped(RuntimeError):
    """Training cannot go on (a non-finite step under --on-nan stop, a collective that failed): one line, exit 1.
    ``every_rank``: each rank prints its own line (what it saw differs), not only rank 0."""

    def __init__(self, message: str, every_rank: bool = False):
        super().__init__(message)
        self.every_rank = every_rank


PREFLIGHT = "MEGATRON_EXT_PREFLIGHT"


class PreflightPassed(Exception):
    """Every check of the flags passed in megatron_ext.launch's single-process check (``MEGATRON_EXT_PREFLIGHT``):
    the entry point stops there, exit 0, before any process group or data."""
