"""The exception types for bad configuration and API mis-use, catchable as DeepSpeed's.

Note [errors catchable as DeepSpeed's]: zerospeed raises its own error types, whose messages name the
key, file or rank and the fix. Code written for DeepSpeed catches what DeepSpeed raises in the same
situation: `DeepSpeedConfigError` for a bad config value, `ZeRORuntimeException` for a ZeRO setup
DeepSpeed refuses, and a bare `AssertionError` where DeepSpeed checks with `assert`. So each zerospeed
error that stands for one of those derives from it too (a class with both bases): `except ConfigError`
and `except deepspeed.DeepSpeedConfigError` both catch a bad `checkpoint.tag_validation`, and
`except AssertionError` catches `initialize(model=None)`. The classes add no state: only the type
relations differ.
"""


class DeepSpeedConfigError(Exception):
    """DeepSpeed's config error (`deepspeed.DeepSpeedConfigError`): the base of zerospeed's `ConfigError`."""


class ConfigError(ValueError, DeepSpeedConfigError):
    """A configuration or API-usage error. The message names the key (dotted path) and the fix."""


class ConfigAssertionError(ConfigError, AssertionError):
    """A `ConfigError` where DeepSpeed fails an `assert` (e.g. `initialize(model=None)`): catchable as either."""


class UsageAssertionError(ValueError, AssertionError):
    """A bad argument to an engine method where DeepSpeed fails an `assert` (e.g. `engine.scale` of a loss
    that is not a scalar): a `ValueError` as zerospeed raised it before, and an `AssertionError` as DeepSpeed's."""


class IncompatibleUsageError(RuntimeError, AssertionError):
    """An engine feature used where it cannot work and DeepSpeed fails an `assert` (`no_sync()` at ZeRO 2-3,
    nested, or `step()` inside it): a `RuntimeError` as zerospeed raised it before, and an `AssertionError`
    as DeepSpeed's."""


class ZeRORuntimeException(Exception):
    """DeepSpeed's ZeRO error (`deepspeed.runtime.zero.utils.ZeRORuntimeException`)."""


class ZeroConfigError(ConfigError, ZeRORuntimeException):
    """A ZeRO setup that DeepSpeed refuses with `ZeRORuntimeException` (a client optimizer with optimizer
    offload under `zero_force_ds_cpu_optimizer`): a `ConfigError` that code written for DeepSpeed catches."""
