"""Mixed precision: the fp16 loss scaler (a pure state machine) and casting policies."""

from zerospeed.precision.loss_scaler import (
    DynamicLossScaler,
    LossScaler,
    LossScaleUnderflowError,
    StaticLossScaler,
    loss_scaler_from_config,
)

__all__ = [
    "DynamicLossScaler",
    "LossScaleUnderflowError",
    "LossScaler",
    "StaticLossScaler",
    "loss_scaler_from_config",
]
