"""A plain single-process PyTorch trainer that reproduces a data-parallel run's global batches.

Parity tests train the same model on the same global batches twice: once through zerospeed on N
ranks, once here, and compare losses and final weights.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch


def split_global_batch(
    batch: Sequence[torch.Tensor], world_size: int, grad_accum: int, rank: int
) -> list[tuple[torch.Tensor, ...]]:
    """Rank `rank`'s micro-batches of one global batch (leading dim = world * grad_accum * micro).

    Convention: micro-step m of rank r takes the (m * world_size + r)-th slice of size micro.
    """
    total = batch[0].shape[0]
    if total % (world_size * grad_accum):
        raise ValueError(f"global batch {total} not divisible by world {world_size} x accumulation {grad_accum}")
    micro = total // (world_size * grad_accum)
    out = []
    for m in range(grad_accum):
        start = (m * world_size + rank) * micro
        out.append(tuple(t[start : start + micro] for t in batch))
    return out


def reference_train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    global_batches: Sequence[Sequence[torch.Tensor]],
    *,
    world_size: int,
    grad_accum: int,
    loss_fn: Callable[..., torch.Tensor] | None = None,
    scheduler=None,
    clip: float = 0.0,
    set_to_none: bool = True,
) -> list[float]:
    """Train on each global batch as one optimizer step; return the mean micro-batch loss per step.

    Every micro-batch of every (virtual) rank contributes loss / (world_size * grad_accum) to the
    gradient, which is what averaging over ranks and dividing by the accumulation steps gives.
    """
    loss_fn = loss_fn or (lambda m, *b: m(*b))
    n_micro = world_size * grad_accum
    losses = []
    for batch in global_batches:
        optimizer.zero_grad(set_to_none=set_to_none)
        total = 0.0
        for rank in range(world_size):
            for micro in split_global_batch(batch, world_size, grad_accum, rank):
                loss = loss_fn(model, *micro)
                (loss / n_micro).backward()
                total += loss.item()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / n_micro)
    return losses


@torch.no_grad()
def fake_quantize_stage3_units(
    model: torch.nn.Module, world: int, settings: Callable[[str, torch.nn.Module], tuple | None]
) -> list[tuple[str, int, tuple | None]]:
    """Write into a plain model's frozen weights the values stage 3 computes with when it stores their
    shards block-quantized: each module's own frozen parameters (the first module registering a tied
    one owns it) flattened in order and zero-padded to a multiple of 4 x `world` (the flat-layout
    formula), each of the `world` equal chunks quantized on its own by `settings(name, module)` =
    (bits, block, symmetric) and dequantized. Returns (module name, chunk elements, settings or None)
    per frozen unit, in module order."""
    from zerospeed.precision.quantize import dequantize_blocks, quantize_blocks

    seen, units = set(), []
    for name, m in model.named_modules():
        ps = [p for p in m.parameters(recurse=False) if not p.requires_grad and id(p) not in seen]
        seen |= {id(p) for p in ps}
        if not ps:
            continue
        flat = torch.cat([p.detach().reshape(-1).float() for p in ps])
        padded = -(-flat.numel() // (4 * world)) * 4 * world
        chosen = settings(name, m)
        units.append((name, padded // world, chosen))
        if not chosen:
            continue
        flat = torch.cat([flat, flat.new_zeros(padded - flat.numel())])
        deq = torch.cat([dequantize_blocks(quantize_blocks(c, *chosen)) for c in flat.chunk(world)])
        offset = 0
        for p in ps:
            p.copy_(deq[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
    return units


def engine_global_step(
    engine, batch: Sequence[torch.Tensor], world_size: int, grad_accum: int, rank: int, *extra
) -> float:
    """One optimizer step of a zerospeed engine over this rank's micro-batches of a global batch (the
    `split_global_batch` convention; `extra` follows each micro-batch into the forward); returns the
    micro-batch loss averaged over the accumulation steps and the ranks (collective)."""
    from zerospeed import comm

    total = 0.0
    for micro in split_global_batch(batch, world_size, grad_accum, rank):
        loss = engine(*micro, *extra)
        engine.backward(loss)
        engine.step()
        total += loss.item()
    t = torch.tensor([total / grad_accum])
    comm.all_reduce(t, op="avg")
    return t.item()


@contextlib.contextmanager
def single_threaded():
    """Inside, torch computes with one thread, as every rank of `run_distributed` does. A reference that
    must match the ranks bit for bit (16-bit training) needs it: a reduction split over threads (a
    LayerNorm weight's gradient, a matmul) sums its fp32 partials in another order, and after rounding
    to bf16 an element can land one ulp apart."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
