"""The one exception type for user mistakes (flags, files)."""


class ConfigError(ValueError):
    """A user error in flags or files; entry points print it as one line and exit with status 2."""
