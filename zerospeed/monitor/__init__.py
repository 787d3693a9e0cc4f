"""Training monitors: TensorBoard event files and CSV (no extra packages), WandB and Comet (optional)."""
from zerospeed.monitor.tfevents import crc32c, read_scalars
from zerospeed.monitor.writers import CometMonitor, CsvMonitor, TensorBoardMonitor, WandbMonitor, build_monitors

__all__ = ["CometMonitor", "CsvMonitor", "TensorBoardMonitor", "WandbMonitor", "build_monitors", "crc32c",
           "read_scalars"]
