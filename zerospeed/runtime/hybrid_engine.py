"""DeepSpeed's hybrid engine (`hybrid_engine.enabled`, DeepSpeed-Chat's RLHF actor): one engine that trains
and generates with the same weights.

There are no inference kernels to switch to here: generation is the model's own `generate` (a
transformers model's, so every sampling option keeps its meaning) on the training weights. What the
hybrid engine adds is at ZeRO-3:

Note [pinned generation]: with `pin_parameters` (DeepSpeed's default, its "gather all layers"), `generate`
all-gathers every unit once, keeps them gathered for the whole generation and releases them after it.
A token then costs no collective, where the per-module hooks would gather every unit again for each
token. The ranks also no longer need to run the same number of forwards: one rank may stop at its EOS
while another goes on. Without pinning, every token's forward gathers, so the ranks must generate in
lockstep (transformers' `synced_gpus=True`). The price of pinning is the whole model gathered on every
rank during generation, as in DeepSpeed.

Like DeepSpeed's: rank 0's random state is given to every rank at start-up. `eval()` / `train()` log
the time split of the last round since the previous `eval()`: end-to-end, gathering, generating,
training. `inference_tp_size > 1` (tensor-sliced generation) is refused. `max_out_tokens`,
`release_inference_cache`, `tp_gather_partition_size` and `enable_cuda_graph` configure DeepSpeed's
kernel workspace and have no effect here. LoRA layers are not fused for generation (the model's own
forward computes them).
"""

from __future__ import annotations

import contextlib
import time

import torch

from zerospeed import comm
from zerospeed.runtime.engine import Engine
from zerospeed.utils.errors import ConfigError
from zerospeed.utils.logging import get_logger

logger = get_logger(__name__)


class DeepSpeedHybridEngine(Engine):
    """A training `Engine` that also generates (`engine.generate`) on its own weights."""

    def __init__(self, module: torch.nn.Module, config, plans, **kwargs):
        hybrid = config.hybrid_engine
        if hybrid.inference_tp_size > 1:
            raise ConfigError(
                f"hybrid_engine.inference_tp_size={hybrid.inference_tp_size}: tensor-sliced generation "
                "is not built; generate at the training layout (inference_tp_size: 1), or serve "
                "the weights with zerospeed.init_inference(tensor_parallel=...)"
            )
        super().__init__(module, config, plans, **kwargs)
        _share_rank0_rng(self.accelerator)
        self.pin_parameters = bool(hybrid.pin_parameters)
        self._t_start: float | None = None
        self._training_start: float | None = None
        self._training_latency = self._generate_latency = self._gather_latency = 0.0

    def generate(self, *inputs, **kwargs):
        """The model's `generate` on the engine's weights (at ZeRO-3 with `pin_parameters`: every unit
        gathered once for the whole call, Note [pinned generation])."""
        generate = getattr(self.module, "generate", None)
        if generate is None:
            raise AttributeError(
                f"engine.generate: the model ({type(self.module).__name__}) has no generate "
                "method; give the hybrid engine a transformers model (or one with generate)"
            )
        t0 = time.perf_counter()
        with self._pinned() if self.pin_parameters else contextlib.nullcontext():
            self._gather_latency = time.perf_counter() - t0
            out = generate(*inputs, **kwargs)
        self._generate_latency = time.perf_counter() - t0 - self._gather_latency
        return out

    @contextlib.contextmanager
    def _pinned(self):
        pin = getattr(self.zero, "pinned_gathered", None)
        if pin is None:  # stages 0-2: the weights are whole on every rank already
            yield
            return
        with pin():
            yield

    def step(self, lr_kwargs: dict | None = None) -> None:
        super().step(lr_kwargs)
        if self._training_start is not None:
            now = time.perf_counter()
            self._training_latency += now - self._training_start
            self._training_start = now

    def eval(self):
        """Inference mode; also logs the last round's time split (DeepSpeed's hybrid-engine report)."""
        now = time.perf_counter()
        if self._t_start is not None:
            total = now - self._t_start
            other = total - self._generate_latency - self._training_latency - self._gather_latency
            logger.info(
                "hybrid engine: E2E latency=%.2fs | gather latency=%.2fs (%.1f%%) | generate time=%.2fs "
                "(%.1f%%) | training time=%.2fs (%.1f%%) | others=%.2fs (%.1f%%)",
                total,
                self._gather_latency,
                100 * self._gather_latency / total,
                self._generate_latency,
                100 * self._generate_latency / total,
                self._training_latency,
                100 * self._training_latency / total,
                other,
                100 * other / total,
            )
        self._t_start = now
        self._training_latency = 0.0
        return super().eval()

    def train(self, mode: bool = True):
        out = super().train(mode)
        if mode:
            self._training_start = time.perf_counter()
        return out


def _share_rank0_rng(accelerator) -> None:
    """Every rank continues from rank 0's random state (DeepSpeed's hybrid engine does so at start-up)."""
    host, device = comm.broadcast_object((torch.get_rng_state(), accelerator.get_rng_state()), src=0)
    torch.set_rng_state(host)
    accelerator.set_rng_state(device)


HybridEngine = DeepSpeedHybridEngine
