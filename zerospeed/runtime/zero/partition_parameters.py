"""DeepSpeed's `deepspeed.runtime.zero.partition_parameters`: `Init`, `GatheredParameters`,
`register_external_parameter` and the `ZeroParamStatus` enum (with DeepSpeed's values)."""
import enum

from zerospeed.zero import GatheredParameters, Init, register_external_parameter


class ZeroParamStatus(enum.Enum):
    NOT_AVAILABLE = 1  # sharded: only this rank's slice exists
    INFLIGHT = 2       # being gathered
    AVAILABLE = 3      # full


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "register_external_parameter"]
