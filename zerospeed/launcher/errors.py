"""The launcher's error type."""

from zerospeed.utils.errors import ConfigError


class LauncherError(ConfigError):
    """A bad launch request: a flag, a hostfile line, an include/exclude spec or a world layout.

    The message names the offending input (file and line, flag, host or slot) and the fix. The CLI
    prints it and exits with code 2. It is a ``ConfigError`` (hence a ``ValueError``) so callers
    can catch all configuration mistakes alike.
    """
