"""ZeRO++ at stage 3 (arXiv 2306.10209), resolved once (by the engine's plans) into a `ZeroPPPolicy`:

- qwZ (`zero_quantized_weights`): training fetches all-gather int8 block-quantized shards
  (`comm.zeropp.all_gather_quantized`), dequantized into the full buffer.
- hpZ (`zero_hpz_partition_size` = H > 1): each unit keeps a secondary shard, 1/H of it, cut from
  its first gather after the weights changed; later training fetches (the backward re-gather, and
  every fetch of the further micro-steps of an accumulation window) all-gather those over the
  sub-group of H ranks only (Note [hpZ sub-groups] in comm/zeropp.py, Note [ZeRO++ gather routes]
  in gather.py).
- qgZ (`zero_quantized_gradients`): the gradient reduce-scatter becomes an all-to-all of int4
  block-quantized chunks (`comm.zeropp.reduce_scatter_quantized`), two-level (within the hpZ
  sub-group, then across) when hpZ is on.

- MixZ++ (`zero_quantized_nontrainable_weights`): the frozen parameters' shards are stored int8
  (Note [int8-stored frozen shards]).

Note [int8-stored frozen shards]: stage 3 partitions frozen parameters like trainable ones (Note
[partitioned frozen parameters], strategy.py). They never change, so with this switch each frozen
flat parameter's shard is block-quantized once, when the engine partitions it (int8, one fp32 scale
per WEIGHT_BLOCK elements, symmetric, round to nearest: the qwZ format), and kept only so — the
parameter-dtype shard is dropped. Memory per rank for them: about 1 byte per element plus
4 / WEIGHT_BLOCK, instead of 2 (bf16) or 4 (fp32); every gather (forward, backward, state dicts,
GatheredParameters) exchanges the stored bytes as they are and dequantizes them into the full
buffer: the model computes with the dequantized frozen weights, each rank's chunk quantized on its
own (the quantization error is fixed at partition time, not redrawn per gather as qwZ's). A checkpoint
saves the dequantized values; loading re-quantizes them, which reproduces the same codes. A
modification through GatheredParameters is re-quantized. With `offload_param.device: nvme` the swap
file holds the stored bytes (offload/param_swap.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from zerospeed.comm import zeropp as zcomm
from zerospeed.utils.errors import ConfigError


@dataclass(frozen=True)
class ZeroPPPolicy:
    """Which ZeRO++ techniques stage 3 runs (all off by default)."""

    quantized_weights: bool = False
    hpz_size: int = 1
    quantized_gradients: bool = False
    quantized_nontrainable: bool = False

    @classmethod
    def resolve(
        cls,
        *,
        stage: int,
        quantized_weights: bool = False,
        hpz_partition_size: int = 1,
        quantized_gradients: bool = False,
        quantized_nontrainable: bool = False,
        offload_param: str = "none",
    ) -> ZeroPPPolicy:
        """The policy of `zero_optimization`'s ZeRO++ switches; refuses what cannot be honoured (the
        errors name the keys)."""
        switches = {
            "zero_quantized_weights": quantized_weights,
            "zero_quantized_gradients": quantized_gradients,
            "zero_quantized_nontrainable_weights": quantized_nontrainable,
        }
        asked = [f"{k}=true" for k, on in switches.items() if on]
        hpz = max(1, int(hpz_partition_size))
        if hpz > 1:
            asked.append(f"zero_hpz_partition_size={hpz}")
        if asked and stage != 3:
            raise ConfigError(
                f"zero_optimization.{asked[0]}: ZeRO++ works on stage 3's partitioned parameters, but "
                f"zero_optimization.stage is {stage}; set stage to 3 or remove "
                f"{', '.join(a.split('=')[0] for a in asked)}"
            )
        if hpz > 1 and offload_param != "none":
            raise ConfigError(
                f"zero_optimization.zero_hpz_partition_size={hpz} with offload_param.device="
                f"{offload_param!r}: hpZ's secondary shards live in device memory, which offloading the "
                "parameters is meant to free; use one of them (set zero_hpz_partition_size to 1 or "
                "offload_param.device to none)"
            )
        return cls(bool(quantized_weights), hpz, bool(quantized_gradients), bool(quantized_nontrainable))


class QuantizedReduceScatter:
    """The reducer's reduce-scatter under qgZ: two-level over the hpZ groups of a reduction group
    that has them, single-level otherwise."""

    def __init__(self, hierarchies: list[tuple[object, tuple]]):
        self.hierarchies = hierarchies  # (reduction group handle, (intra, inter) AxisGroups)

    def __call__(self, output, input, op: str = "sum", group=None, async_op: bool = False):
        if op != "sum":
            raise ValueError(f"qgZ reduce-scatter sums; got op={op!r}")
        levels = next((h for g, h in self.hierarchies if g is group), None)
        return zcomm.reduce_scatter_quantized(output, input, group=group, async_op=async_op, hierarchy=levels)
