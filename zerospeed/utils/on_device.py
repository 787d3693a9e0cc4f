"""DeepSpeed's `deepspeed.OnDevice`: build a model's tensors on a chosen device and in a chosen dtype."""

from __future__ import annotations

import torch


class OnDevice:
    """Context manager: tensors created inside are made on `device` (default "meta": shapes only, no memory)
    and floating-point ones in `dtype`. `enabled=False` makes it a no-op, as DeepSpeed's, so callers can
    write one `with` for both cases. Built on torch's own default-device context and default dtype."""

    def __init__(self, dtype: torch.dtype | None, device: str | torch.device = "meta", enabled: bool = True) -> None:
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._device_ctx = None
        self._saved_dtype = None

    def __enter__(self) -> OnDevice:
        if not self.enabled:
            return self
        self._saved_dtype = torch.get_default_dtype()
        if self.dtype is not None and self.dtype.is_floating_point:
            torch.set_default_dtype(self.dtype)
        self._device_ctx = self.device
        self._device_ctx.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        self._device_ctx.__exit__(*exc)
        torch.set_default_dtype(self._saved_dtype)
