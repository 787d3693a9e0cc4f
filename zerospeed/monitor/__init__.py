"""Training monitors: CSV (no extra packages), TensorBoard (the `tensorboard` extra), WandB and Comet (optional)."""

from zerospeed.monitor.writers import (
    CometMonitor,
    CsvMonitor,
    TensorBoardMonitor,
    WandbMonitor,
    build_monitors,
    read_scalars,
)

__all__ = ["CometMonitor", "CsvMonitor", "TensorBoardMonitor", "WandbMonitor", "build_monitors", "read_scalars"]
