"""DeepSpeed's `engine.offload_states()` / `reload_states()` over an engine (Note [offloaded states] in
offload/states.py): which kinds move, and the refusals."""

from __future__ import annotations

import gc

from zerospeed.offload.states import (
    ALL_STATES,
    OffloadDeviceEnum,
    OffloadStateTypeEnum,
    state_tensors,
)
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)  # Note [rank-0 logging]


def offload_states(engine, include=None, device="cpu", pin_memory: bool = True, non_blocking: bool = False) -> None:
    """Move `engine`'s training states (`include`: OffloadStateTypeEnum kinds; all by default) to host
    memory until `reload_states`. States already on the host (an offloaded optimizer's masters and
    moments) are left out, as in DeepSpeed."""
    device = OffloadDeviceEnum(device.value if isinstance(device, OffloadDeviceEnum) else device)
    offload = engine.plans.zero.offload
    if offload is not None and offload.param != "none":
        raise ValueError(
            "engine.offload_states: the parameters are already offloaded "
            "(zero_optimization.offload_param); moving states is for engines that keep them "
            "on the device"
        )
    if engine.optimizer is None:
        raise ValueError(
            "engine.offload_states needs an optimizer: an engine without one has no training states to move"
        )
    if device is OffloadDeviceEnum.nvme:
        raise ValueError(
            "engine.offload_states: device='nvme' is not supported (DeepSpeed's neither); use device='cpu'"
        )
    if device is OffloadDeviceEnum.none:
        logger.warning("engine.offload_states: device 'none' given, nothing offloaded")
        return
    kinds = [OffloadStateTypeEnum(k) for k in (ALL_STATES if include is None else include)]
    if offload is not None and offload.optimizer != "none":  # already on the host
        skip = {OffloadStateTypeEnum.hp_params, OffloadStateTypeEnum.optim_states}
        if engine.plans.zero.stage >= 3:
            skip.add(OffloadStateTypeEnum.lp_grads)
        kinds = [k for k in kinds if k not in skip]
    engine.empty_partition_cache()
    engine.state_offloader.offload(state_tensors(engine), kinds, "cpu", pin_memory, non_blocking)
    gc.collect()
    engine.accelerator.empty_cache()


def refuse_offloaded(what: str, offloader) -> None:
    """The error of a step, forward or checkpoint while `offload_states` holds the states."""
    names = ", ".join(sorted(k.value for k in offloader.kinds))
    raise RuntimeError(
        f"{what}: the engine's states ({names}) are offloaded by engine.offload_states(); "
        "call engine.reload_states() first"
    )
