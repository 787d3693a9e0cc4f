"""The one exception type for bad configuration and API mis-use."""


class ConfigError(ValueError):
    """A configuration or API-usage error. The message names the key (dotted path) and the fix."""
