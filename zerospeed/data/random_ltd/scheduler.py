"""The random-LTD schedule (DeepSpeed's `deepspeed.runtime.data_pipeline.data_routing.scheduler`): how
many tokens each random-LTD layer keeps — the *reserved length* — at global step t.

`fixed_linear`, the one schedule DeepSpeed has (`random_ltd_schedule` in the config):

    r(t) = floor(min_value + (max_value - min_value) * t / require_steps)
    r(t) -= r(t) % seq_per_step          (a multiple of seq_per_step: may fall below min_value)
    r(t) = min(r(t), max_value)

Once the reserved length reaches `max_value` it stays there (`update_seq` stops asking). The engine
calls `update_seq(global_steps)` before every training forward (Note [forward schedules]); the first
call of a step also counts the layer-tokens that step consumes:

    consumed_layer_tokens += global_batch_size * (r * random_ltd_layer_num
                                                  + max_value * (total_layer_num - random_ltd_layer_num))

`state` keeps DeepSpeed's keys (min_value, max_value, current_value, schedule_config, schedule_type,
consumed_layer_tokens, current_steps; while training also sample_idx, the token positions layer 0 drew
for every random-LTD layer). `state_dict()` carries the five scalars DeepSpeed checkpoints.
"""

from __future__ import annotations

import math

CONSUMED_LAYER_TOKENS, CURRENT_STEPS, CURRENT_VALUE = "consumed_layer_tokens", "current_steps", "current_value"
MIN_VALUE, MAX_VALUE, SAMPLE_INDEX = "min_value", "max_value", "sample_idx"
_CHECKPOINTED = (CONSUMED_LAYER_TOKENS, CURRENT_STEPS, CURRENT_VALUE, MIN_VALUE, MAX_VALUE)


class BaseScheduler:
    """The schedule as a function of the step (DeepSpeed's base class)."""

    def __init__(self):
        self.state: dict = {}

    def get_value(self, global_steps: int) -> int:
        """The reserved length of step `global_steps` (module docstring)."""
        if self.state["schedule_type"] != "fixed_linear":
            raise ValueError(
                f"random_ltd_schedule.schedule_type={self.state['schedule_type']!r}: only "
                "'fixed_linear' exists (as in DeepSpeed)"
            )
        lo, hi = self.state[MIN_VALUE], self.state[MAX_VALUE]
        ramp = self.state["schedule_config"]
        # DeepSpeed's float order: (t / require_steps) ** 1, times the span, plus min, floored
        value = math.floor(float(global_steps) / ramp["require_steps"] * (hi - lo) + lo)
        return min(value - value % ramp["seq_per_step"], hi)


class RandomLTDScheduler(BaseScheduler):
    """`config`: the `random_ltd` block as a dict, with `global_batch_size` (the engine's train_batch_size)."""

    def __init__(self, config: dict):
        super().__init__()
        self.model_layer_num = config["total_layer_num"]
        self.random_ltd_layer_num = config["random_ltd_layer_num"]
        self.config_schedule = config["random_ltd_schedule"]
        self.global_batch_size = config["global_batch_size"]
        self.reset_to_init()

    def reset_to_init(self) -> None:
        """Back to step 0's state: the reserved length at min_value, nothing consumed."""
        schedule = self.config_schedule
        self.state.update(
            {
                MIN_VALUE: schedule[MIN_VALUE],
                MAX_VALUE: schedule[MAX_VALUE],
                CURRENT_VALUE: schedule[MIN_VALUE],
                "schedule_config": schedule["schedule_config"],
                "schedule_type": schedule["schedule_type"],
                CONSUMED_LAYER_TOKENS: 0,
                CURRENT_STEPS: -1,
            }
        )

    # -- DeepSpeed's accessors ------------------------------------------------------------------------
    def get_current_seq(self) -> int:
        return self.state[CURRENT_VALUE]

    def set_current_seq(self, seq_length: int) -> None:
        self.state[CURRENT_VALUE] = seq_length

    def get_random_ltd_layer_num(self) -> int:
        return self.random_ltd_layer_num

    def get_state(self) -> dict:
        return self.state

    def set_state(self, state: dict) -> None:
        self.state = state

    # -- the schedule ----------------------------------------------------------------------------------
    def update_seq(self, global_steps: int) -> None:
        """Move to step `global_steps`'s reserved length unless max_value is reached; count the step's
        layer-tokens the first time it is seen."""
        if self.state[CURRENT_VALUE] < self.state[MAX_VALUE]:
            self.state[CURRENT_VALUE] = self.get_value(global_steps)
        if global_steps != self.state[CURRENT_STEPS]:
            dropping, full = self.random_ltd_layer_num, self.model_layer_num - self.random_ltd_layer_num
            self.state[CONSUMED_LAYER_TOKENS] += self.global_batch_size * (
                self.state[CURRENT_VALUE] * dropping + self.state[MAX_VALUE] * full
            )
            self.state[CURRENT_STEPS] = global_steps

    def get_total_layer_tokens(self, train_iters: int) -> int:
        """Run `update_seq` over steps 0 .. train_iters - 1 (from the current state, as DeepSpeed does)
        and return the consumed layer-tokens."""
        for step in range(train_iters):
            self.update_seq(step)
        return self.state[CONSUMED_LAYER_TOKENS]

    def state_dict(self) -> dict:
        return {key: self.state[key] for key in _CHECKPOINTED}

    def load_state_dict(self, state_dict: dict) -> None:
        self.state.update({key: state_dict[key] for key in _CHECKPOINTED})
