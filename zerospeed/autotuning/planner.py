"""The planner: the memory estimator cuts the tuning space before any trial runs (pure).

For every candidate the device bytes per rank are the estimator's model states
(`zerospeed.estimate.formulas.placed_model_states`: stage and offload, the ZeRO paper's accounting)
plus activations: the bytes per sample measured by the model-information run (Note [activation
census] in probe.py) times the micro batch. Then:

- a candidate whose estimate exceeds the device budget (``MEMORY_HEADROOM`` of the device memory)
  is **pruned**: it would run out of memory;
- Note [dominated candidates]: a candidate is **dominated** when a candidate of a faster tier
  (`Candidate.tier`: no offload, then optimizer offload, then parameter offload; within each, the
  bytes the ZeRO stage moves per step, `space.traffic`) with the same micro batch, accumulation and
  knobs fits. ZeRO stages and offload buy memory with communication or host transfers; when the
  memory is not needed they only cost time. Stages that move the same bytes share a tier (0 and 1
  always; 2 too at gradient accumulation 1, the ZeRO paper's case), so only a trial tells them apart.
  Pruned candidates are never launched; a dominated one is tried only when the candidate that
  dominates it crashes (the estimate was wrong: it did not fit after all) and no other faster twin
  ran, in a second round (`Autotuner.tune`).

Per variant (stage, offload, knobs) the micro batches kept are `num_tuning_micro_batch_sizes` of the
ladder's sizes that fit, spread from the smallest to the largest (`space.spread`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerospeed.autotuning.space import Candidate, TuningSpace, micro_batches, spread, variants, with_micro_batch
from zerospeed.estimate.formulas import Option, Precision, placed_model_states

# Fraction of the device memory a trial may plan to use: the allocator's fragmentation, the CUDA
# context, temporaries inside the forward pass and communication buffers live in the rest.
MEMORY_HEADROOM = 0.9

OK, PRUNED, DOMINATED = "candidate", "pruned", "dominated"


@dataclass(frozen=True)
class ModelInfo:
    """What the estimator needs to know about the model and the machine (model-information run)."""

    num_params: int
    largest_layer_params: int = 0
    precision: Precision = Precision(4, 4, 0, 8)
    activation_bytes_per_sample: float = 0.0
    dp_size: int = 1
    device_memory_per_rank: float | None = None

    @classmethod
    def from_profile(cls, info: dict[str, Any], mp_size: int = 1) -> ModelInfo:
        """From the JSON the model-information run writes (probe.TrialProbe.model_info)."""
        memory = float(info["device_memory"])
        if info.get("device") == "cpu":  # the ranks of a node share its memory
            memory /= max(1, int(info.get("local_size", 1)))
        prec = Precision(info["param_bytes"], info["grad_bytes"], info["master_bytes"], info["optim_bytes"])
        per_sample = info["activation_bytes"] / max(1, info["micro_batch"])
        return cls(
            int(info["num_params"]),
            int(info.get("largest_layer_params", 0)),
            prec,
            per_sample,
            max(1, int(info["dp_world_size"]) // max(1, mp_size)),
            memory,
        )


@dataclass(frozen=True)
class Planned:
    """A candidate with its estimate and what the planner decided."""

    candidate: Candidate
    device_bytes: float
    status: str  # OK, PRUNED or DOMINATED
    note: str = ""
    dominated_by: Candidate | None = None  # the faster candidate that fits the same micro batch


def device_bytes(c: Candidate, info: ModelInfo) -> float:
    """Estimated peak device bytes per rank of candidate ``c``: model states plus activations."""
    option = Option(c.stage, c.offload_optimizer != "none", c.offload_param != "none")
    placed = placed_model_states(info.num_params, info.dp_size, option, info.precision, info.largest_layer_params)
    return sum(placed["device"].values()) + info.activation_bytes_per_sample * c.micro_batch


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def plan(
    space: TuningSpace, info: ModelInfo | None, budget: float | None, *, dp_size: int = 1, prune_dominated: bool = True
) -> list[Planned]:
    """Every candidate of ``space``: estimated, pruned when it cannot fit ``budget`` bytes, dominated
    (Note [dominated candidates]); in the gridsearch order (`grid_order`). Without ``info`` (an
    exhaustive grid) nothing is estimated; without ``budget`` nothing is pruned."""
    ladder = micro_batches(space, info.dp_size if info else dp_size)
    out: list[Planned] = []
    for v in variants(space):
        sized = [(with_micro_batch(v, m), device_bytes(with_micro_batch(v, m), info) if info else 0.0) for m in ladder]
        fits = [m for (c, b), m in zip(sized, ladder) if budget is None or b <= budget]
        keep = set(fits if space.micro_batches else spread(fits, space.num_micro_batches))
        for (c, b), m in zip(sized, ladder):
            if m in keep:
                out.append(Planned(c, b, OK))
            elif m not in fits:
                out.append(Planned(c, b, PRUNED, f"estimate {_gib(b)} > budget {_gib(budget or 0)}"))
    if prune_dominated:
        out = _mark_dominated(out)
    return grid_order(out)


def _mark_dominated(rows: list[Planned]) -> list[Planned]:
    """Note [dominated candidates]."""
    fitting = [r.candidate for r in rows if r.status == OK]
    out = []
    for r in rows:
        c = r.candidate
        faster = [
            f
            for f in fitting
            if f.tier < c.tier and f.micro_batch == c.micro_batch and f.gas == c.gas and f.knobs == c.knobs
        ]
        if r.status == OK and faster:
            best = min(faster, key=lambda f: (f.tier, f.stage))
            r = Planned(
                c,
                r.device_bytes,
                DOMINATED,
                f"{best.name} fits the same micro batch and moves less ({_moves(best)} vs {_moves(c)})",
                best,
            )
        out.append(r)
    return out


def _moves(c: Candidate) -> str:
    offload, traffic = c.tier
    return f"{traffic}x the model per step" + (", offloaded" if offload else "")


def grid_order(rows: list[Planned]) -> list[Planned]:
    """Fastest expected first: tier, then the largest micro batch, then the lowest stage."""
    return sorted(
        rows,
        key=lambda r: (
            r.candidate.tier,
            -r.candidate.micro_batch,
            r.candidate.stage,
            r.candidate.offload_optimizer,
            r.candidate.offload_param,
            repr(r.candidate.knobs),
        ),
    )


def min_memory(space: TuningSpace) -> Candidate:
    """The candidate needing the least device memory: the highest stage, the most offload, the smallest
    micro batch (DeepSpeed's model-information run uses stage 3 at micro batch 1)."""
    smallest = min(space.micro_batches) if space.micro_batches else space.min_micro_batch
    return with_micro_batch(max(variants(space), key=lambda v: (v.tier, v.stage)), smallest)
