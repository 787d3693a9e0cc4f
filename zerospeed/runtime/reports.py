"""What an engine reports about itself: its model-state memory next to the ZeRO formula's prediction
(`engine.memory_breakdown()`), and DeepSpeed's `dump_state` log of what it was built from and into."""

from __future__ import annotations

import torch

from zerospeed.utils.logging import get_logger
from zerospeed.zero.memory import (
    ONEBIT_STATE_WORDS,
    OPTIMIZER_STATE_BYTES,
    grouped_model_state_bytes,
    onebit_state_bytes,
    optimizer_kind,
)

logger = get_logger(__name__)  # Note [rank-0 logging]


def memory_breakdown(engine) -> dict[str, dict[str, float]]:
    """Per-rank model-state bytes held by `engine`, next to the ZeRO formula's prediction."""
    measured = engine.zero.memory_breakdown(engine.optimizer)
    precision, stage, sizes = engine.precision, engine.plans.zero.stage, engine.trained_sizes
    pb = torch.tensor([], dtype=precision.param_dtype).element_size()
    predicted = grouped_model_state_bytes(
        list(sizes.groups),
        stage,
        param_bytes=pb,
        grad_bytes=torch.tensor([], dtype=precision.grad_accum_dtype).element_size(),
        master_bytes=precision.master_bytes,
        # (fp32 states; Note [bf16 masters]: in the masters' dtype)
        optim_bytes=OPTIMIZER_STATE_BYTES[optimizer_kind(engine.optimizer)] * precision.master_dtype.itemsize // 4
        if engine.optimizer
        else 0,
    )
    kind = type(engine.optimizer).__name__.lower()
    if kind in ONEBIT_STATE_WORDS:  # Note [1-bit optimizer states]: its compressed stage
        predicted["optimizer_states"] = sum(
            onebit_state_bytes(kind, numel, world, stage) for numel, world in sizes.groups
        )
    if stage == 3 and sizes.frozen_numel:  # partitioned frozen parameters, as stored
        stored = 1 + 4 / 512 if engine.plans.zero.zeropp.quantized_nontrainable else pb
        predicted["parameters"] = predicted.get("parameters", 0.0) + sizes.frozen_numel * stored / engine.mesh.size(
            "dp_sp"
        )
    return {"measured": measured, "predicted": predicted}


def dump_state(engine) -> None:
    """`dump_state`: log what `engine` was built from and into (rank 0), as DeepSpeed prints its
    engine's attributes after initialisation."""
    lines = [
        f"  {k}: {v}"
        for k, v in (
            ("mesh", engine.mesh),
            ("world_size", engine.world_size),
            ("dp_world_size", engine.dp_world_size),
            ("device", engine.device),
            ("precision", engine.precision),
            ("zero_stage", engine.plans.zero.stage),
            ("zero_strategy", type(engine.zero).__name__),
            ("placement", engine.zero.placement()),
            ("optimizer", type(engine.optimizer).__name__ if engine.optimizer is not None else None),
            ("lr_scheduler", type(engine.lr_scheduler).__name__ if engine.lr_scheduler is not None else None),
            ("loss_scaler", engine.loss_scaler),
            ("train_batch_size", engine.train_batch_size()),
            ("train_micro_batch_size_per_gpu", engine.train_micro_batch_size_per_gpu()),
            ("gradient_accumulation_steps", engine.gradient_accumulation_steps()),
            ("memory_breakdown", memory_breakdown(engine)["measured"]),
        )
    ]
    config = engine.config.model_dump(mode="json", exclude_defaults=True)
    logger.info("engine state (dump_state):\n%s\n  config (non-default keys): %s", "\n".join(lines), config)
