"""`TrainingArguments` that take `--deepspeed cfg.json` without touching the deepspeed package.

transformers' own arguments turn a `deepspeed` value into a DeepSpeed plugin for accelerate (which
imports deepspeed and lets it own the process group). Ours keep the value where users look for it
(`args.deepspeed`), hide it from those two set-up steps, and instead join the process group through
`zerospeed.comm` before accelerate looks, so accelerate sees an initialised group and reuses it.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import transformers

from zerospeed import comm
from zerospeed.accelerator import get_accelerator

logger = logging.getLogger(__name__)


@dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers' `TrainingArguments`; `deepspeed` (a path or a dict) selects zerospeed."""

    @property
    def zerospeed_enabled(self) -> bool:
        """True when a zerospeed (DeepSpeed-format) config was given."""
        return bool(self.deepspeed)

    @contextlib.contextmanager
    def _deepspeed_hidden(self):
        # transformers would build a DeepSpeed plugin from this value; zerospeed owns it instead
        saved, self.deepspeed = self.deepspeed, None
        try:
            yield
        finally:
            self.deepspeed = saved

    def __post_init__(self) -> None:
        if self.deepspeed and get_accelerator().name == "cpu" and not self.use_cpu:
            # accelerate only forms a multi-process CPU (gloo) state when told it runs on the CPU
            logger.info("zerospeed runs on the CPU: setting use_cpu=True for accelerate")
            self.use_cpu = True
        with self._deepspeed_hidden():
            super().__post_init__()

    @property
    def _setup_devices(self) -> Any:
        # A property over transformers' cached one: the process group must exist before accelerate's
        # PartialState is built there, or accelerate would create it (and on GPUs, wrap in DDP later).
        if "_zs_device" not in self.__dict__:
            if self.deepspeed:
                comm.init_distributed()
            with self._deepspeed_hidden():
                self.__dict__["_zs_device"] = transformers.TrainingArguments._setup_devices.func(self)
        return self.__dict__["_zs_device"]

    @property
    def place_model_on_device(self) -> bool:
        # the engine places (and at stage 3 shards) the model itself
        return False if self.deepspeed else super().place_model_on_device
