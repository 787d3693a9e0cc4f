"""``compression_scheduler`` (DeepSpeed's name): advances every compressed layer with the engine's
optimizer steps. The layers own their schedules; the scheduler only counts."""

from __future__ import annotations

from torch import nn

from zerospeed.compression.basic_layer import Conv2dLayer_Compress, LinearLayer_Compress


class compression_scheduler:  # noqa: N801 - DeepSpeed's name
    """Counts optimizer steps and tells each compressed layer of ``model`` the current one."""

    def __init__(self, model: nn.Module, compression_config=None):
        self.layers = [m for m in model.modules() if isinstance(m, (LinearLayer_Compress, Conv2dLayer_Compress))]
        self.training_steps = 0

    def step(self, step_zero_check: bool = False) -> None:
        self.training_steps += 1
        for layer in self.layers:
            layer.set_step(self.training_steps)


def scheduler_for(model: nn.Module) -> compression_scheduler | None:
    """A scheduler when ``init_compression`` has compressed some layer of ``model``, else None."""
    scheduler = compression_scheduler(model)
    return scheduler if scheduler.layers else None
