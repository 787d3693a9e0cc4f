"""Mixed precision: the fp16 loss scaler (a pure state machine) and casting policies."""

from zerospeed.precision.loss_scaler import (
    DynamicLossScaler,
    LossScalePlan,
    LossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    loss_scaler_from_config,
)
from zerospeed.precision.policy import PrecisionPolicy

__all__ = [
    "DynamicLossScaler",
    "LossScalePlan",
    "LossScaleUnderflowError",
    "LossScaler",
    "PrecisionPolicy",
    "StaticLossScaler",
    "loss_scaler_from_config",
]
