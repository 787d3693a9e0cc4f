"""The legacy curriculum-learning scheduler (`curriculum_learning` in the config; DeepSpeed's
`deepspeed.runtime.data_pipeline.curriculum_scheduler.CurriculumScheduler`).

A difficulty — for `curriculum_type: "seqlen"` the sequence length the model trains on — grows from
`min_difficulty` to `max_difficulty` with the global step. The engine asks for step t + 1's difficulty
before each training forward and, for "seqlen", passes it to the model as `curriculum_seqlen=`; the
model truncates its batch (Megatron-DeepSpeed's GPT does `tokens[:, :curriculum_seqlen]`). Schedules,
as functions of the global step t:

    fixed_linear    the fixed_root formula with degree 1
    fixed_root      d = floor(min + (max - min) * (t / total_curriculum_step) ** (1 / root_degree)),
                    then d -= d % difficulty_step, and d = min(d, max)
    fixed_discrete  difficulty[i] for the first i with t <= max_step[i]; difficulty[-1] after the
                    last max_step (one more difficulty than max_steps)
    custom          a function of t given with `set_custom_get_difficulty`

Once the difficulty reaches `max_difficulty` it stays there (`update_difficulty` stops asking). The
state is a function of the step, so a resumed run recomputes it from `global_steps`.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import logger

SCHEDULES = ("fixed_linear", "fixed_root", "fixed_discrete", "custom")
_NEEDS = {
    "fixed_linear": ("total_curriculum_step", "difficulty_step"),
    "fixed_root": ("total_curriculum_step", "difficulty_step", "root_degree"),
    "fixed_discrete": ("difficulty", "max_step"),
    "custom": (),
}


class CurriculumScheduler:
    """`config`: the `curriculum_learning` block as a dict (min_difficulty, max_difficulty,
    schedule_type, schedule_config). Errors name the key at fault."""

    def __init__(self, config: dict):
        for key in ("min_difficulty", "max_difficulty", "schedule_type"):
            if config.get(key) is None:
                raise ConfigError(f"curriculum_learning.{key} is required when curriculum learning is enabled")
        kind = config["schedule_type"]
        if kind not in SCHEDULES:
            raise ConfigError(f"curriculum_learning.schedule_type={kind!r}: expected one of {SCHEDULES}")
        schedule = dict(config.get("schedule_config") or {})
        for key in _NEEDS[kind]:
            if key not in schedule:
                raise ConfigError(f"curriculum_learning.schedule_config.{key} is required by schedule_type {kind!r}")
        if kind == "fixed_discrete" and (
            not schedule["max_step"] or len(schedule["difficulty"]) != len(schedule["max_step"]) + 1
        ):
            raise ConfigError(
                "curriculum_learning.schedule_config: fixed_discrete needs one more difficulty than "
                f"max_step (got {len(schedule['difficulty'])} and {len(schedule['max_step'])})"
            )
        if kind in ("fixed_linear", "fixed_root") and schedule["difficulty_step"] % 8:
            logger.warning(
                "curriculum_learning.schedule_config.difficulty_step=%s is not a multiple of 8: with "
                "the seqlen metric, sequence lengths that are not keep 16-bit tensor cores idle",
                schedule["difficulty_step"],
            )
        self.state = {
            "min_difficulty": config["min_difficulty"],
            "max_difficulty": config["max_difficulty"],
            "current_difficulty": config["min_difficulty"],
            "schedule_type": kind,
            "schedule_config": schedule,
        }
        self.custom_get_difficulty: Callable[[int], int] | None = None

    # -- DeepSpeed's accessors ------------------------------------------------------------------------
    def get_current_difficulty(self) -> int:
        return self.state["current_difficulty"]

    def set_current_difficulty(self, difficulty: int) -> None:
        self.state["current_difficulty"] = difficulty

    def set_custom_get_difficulty(self, schedule_function: Callable[[int], int]) -> None:
        self.custom_get_difficulty = schedule_function

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state

    # -- the schedule ----------------------------------------------------------------------------------
    def get_difficulty(self, global_steps: int) -> int:
        """The schedule's difficulty at `global_steps` (module docstring)."""
        kind, s = self.state["schedule_type"], self.state["schedule_config"]
        if kind == "fixed_discrete":
            return next(
                (d for d, last in zip(s["difficulty"], s["max_step"]) if global_steps <= last), s["difficulty"][-1]
            )
        if kind == "custom":
            if self.custom_get_difficulty is None:
                raise RuntimeError(
                    "curriculum_learning.schedule_type 'custom' needs a schedule: call "
                    "engine.curriculum_scheduler_legacy.set_custom_get_difficulty(fn) first"
                )
            return self.custom_get_difficulty(global_steps)
        degree = 1 if kind == "fixed_linear" else s["root_degree"]
        lo, hi = self.state["min_difficulty"], self.state["max_difficulty"]
        d = math.floor((float(global_steps) / s["total_curriculum_step"]) ** (1.0 / degree) * (hi - lo) + lo)
        return min(d - d % s["difficulty_step"], hi)

    def update_difficulty(self, global_steps: int) -> int:
        """Move to `global_steps`'s difficulty unless the maximum is reached; the current difficulty."""
        if self.state["current_difficulty"] < self.state["max_difficulty"]:
            self.state["current_difficulty"] = self.get_difficulty(global_steps)
        return self.state["current_difficulty"]
