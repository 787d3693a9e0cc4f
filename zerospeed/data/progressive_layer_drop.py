"""Progressive layer dropping (`progressive_layer_drop` in the config; DeepSpeed's
`deepspeed.runtime.progressive_layer_drop.ProgressiveLayerDrop`, Zhang & He 2020, arXiv 2010.13369).

The engine keeps a keep-probability theta(t) = (1 - theta) * exp(-gamma * t) + theta, updated at each
accumulation boundary from the global step (before that step's optimizer runs; 1.0 until the first),
and passes `progressive_layer_drop=True, pld_theta=theta(t)` to every training forward. The model
decides what to drop with it (DeepSpeed's PLD BERT keeps layer i with a probability falling with
depth); the engine drops nothing itself.
"""

from __future__ import annotations

import math

from zerospeed.utils.logging import log_dist


class ProgressiveLayerDrop:
    def __init__(self, theta: float = 0.5, gamma: float = 0.001):
        self.theta, self.gamma = theta, gamma
        self.current_theta = 1.0
        log_dist(f"progressive layer drop enabled (theta {theta}, gamma {gamma})", ranks=[0])

    def get_state(self) -> dict:
        """The keyword arguments of a training forward."""
        return {"progressive_layer_drop": True, "pld_theta": self.get_theta()}

    def get_theta(self) -> float:
        return self.current_theta

    def update_state(self, global_step: int) -> None:
        self.current_theta = (1.0 - self.theta) * math.exp(-self.gamma * global_step) + self.theta
