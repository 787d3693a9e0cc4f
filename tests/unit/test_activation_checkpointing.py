"""zerospeed.activation: gradients equal to no checkpointing (dropout included, so the RNG replay
is exercised), each option's observable effect (host copies, one reused buffer, profile counts),
configuration and its errors, and the activation-memory claim measured by the independent census."""

from __future__ import annotations

import contextlib
import json
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.census import live_tensor_bytes
from zerospeed import checkpointing
from zerospeed.accelerator import get_accelerator
from zerospeed.activation import function as ckpt_function
from zerospeed.activation.arena import ContiguousArena
from zerospeed.activation.partition import chunk_bounds, chunk_numel, copy_partition
from zerospeed.activation.stash import SavedInput
from zerospeed.config import ConfigError, parse_config
from zoo.models import Block, GPTConfig

DEV = get_accelerator().torch_device()
D, B, T, N_BLOCKS = 32, 4, 8, 4


@pytest.fixture(autouse=True)
def fresh_configuration():
    checkpointing.unconfigure()
    yield
    checkpointing.unconfigure()


class DropBlock(nn.Module):
    """Pre-LN residual MLP with two dropouts (p=0.3): its output depends on the random stream."""

    def __init__(self, d: int = D, p: float = 0.3):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.p = p

    def forward(self, x):
        h = F.dropout(F.gelu(self.fc1(self.ln(x))), self.p, self.training)
        return x + F.dropout(self.fc2(h), self.p, self.training)


def make_stack(n: int = N_BLOCKS) -> nn.ModuleList:
    torch.manual_seed(0)
    return nn.ModuleList(DropBlock() for _ in range(n)).to(DEV)


def make_input(requires_grad: bool = True) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(B, T, D, generator=g).to(DEV).requires_grad_(requires_grad)


def zero_grads(blocks, x):
    for p in blocks.parameters():
        p.grad = None
    x.grad = None


def run(blocks, x, checkpointed: bool, seed: int = 123):
    """One forward + backward from a fixed seed; returns (loss, grads of the params and of x)."""
    torch.manual_seed(seed)
    zero_grads(blocks, x)
    h = x
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h) if checkpointed else blk(h)
    loss = (h * h).mean()
    loss.backward()
    grads = [p.grad.clone() for p in blocks.parameters()]
    if x.requires_grad:
        grads.append(x.grad.clone())
    return loss.detach(), grads


def assert_grads_equal(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=0)


POLICIES = {
    "plain": {},
    "cpu": {"checkpoint_in_cpu": True},
    "contiguous": {"contiguous_checkpointing": True, "num_checkpoints": N_BLOCKS},
    "cpu+contiguous": {"checkpoint_in_cpu": True, "contiguous_checkpointing": True, "num_checkpoints": N_BLOCKS},
    "partition-without-mpu": {"partition_activations": True},
    "sync+profile": {"synchronize": True, "profile": True},
}


@pytest.mark.parametrize("policy", list(POLICIES))
def test_gradients_equal_no_checkpointing_with_dropout(policy):
    blocks, x = make_stack(), make_input()
    ref_loss, ref = run(blocks, x, checkpointed=False)
    checkpointing.configure(**POLICIES[policy])
    for _ in range(2):  # the second step reuses whatever the first one set up
        loss, got = run(blocks, x, checkpointed=True)
        assert torch.equal(loss, ref_loss)
        assert_grads_equal(got, ref)


def test_input_without_grad_still_trains_the_parameters():
    blocks, x = make_stack(), make_input(requires_grad=False)
    _, ref = run(blocks, x, checkpointed=False)
    _, got = run(blocks, x, checkpointed=True)
    assert_grads_equal(got, ref)


class MaskRecorder(nn.Module):
    """Dropout that records the mask it drew, at every call (forward and recompute)."""

    def __init__(self):
        super().__init__()
        self.masks: list[torch.Tensor] = []

    def forward(self, x):
        y = F.dropout(x, 0.3, True)
        self.masks.append((y != 0).clone())
        return y * 2.0


def test_recompute_draws_the_same_dropout_mask():
    rec = MaskRecorder()
    x = torch.rand(64, 64, device=DEV) + 0.5  # no exact zeros: the mask is y != 0
    x.requires_grad_(True)
    checkpointing.checkpoint(rec, x).sum().backward()
    assert len(rec.masks) == 2  # the forward and the recompute
    assert torch.equal(rec.masks[0], rec.masks[1])
    # the gradient is 2/(1-p) where kept, 0 where dropped: the recompute's mask is the one applied
    torch.testing.assert_close(x.grad, rec.masks[0].float() * 2.0 / 0.7)


def test_without_rng_replay_masks_and_gradients_differ(monkeypatch):
    """Negative control: with the replay disabled (test-only), the same checks fail."""
    monkeypatch.setattr(ckpt_function, "replay", lambda snapshot: contextlib.nullcontext())
    rec = MaskRecorder()
    x = (torch.rand(64, 64, device=DEV) + 0.5).requires_grad_(True)
    checkpointing.checkpoint(rec, x).sum().backward()
    assert not torch.equal(rec.masks[0], rec.masks[1])
    blocks, x = make_stack(), make_input()
    _, ref = run(blocks, x, checkpointed=False)
    _, got = run(blocks, x, checkpointed=True)
    assert any(not torch.allclose(g, w, atol=1e-6, rtol=0) for g, w in zip(got, ref))


def test_outer_random_stream_is_untouched_by_the_recompute():
    blocks, x = make_stack(), make_input()
    run(blocks, x, checkpointed=False)
    after_plain = torch.rand(8, device=DEV)
    run(blocks, x, checkpointed=True)
    after_checkpointed = torch.rand(8, device=DEV)
    assert torch.equal(after_plain, after_checkpointed)


def test_model_parallel_tracker_stream_is_replayed_and_forked():
    tracker = checkpointing.get_cuda_rng_tracker()
    masks = []

    def fn(x):
        with tracker.fork():
            y = F.dropout(x, 0.5, True)
        masks.append(y != 0)
        return y

    def seeded_input():
        checkpointing.model_parallel_cuda_manual_seed(7)
        return (torch.rand(32, 32, device=DEV) + 0.5).requires_grad_(True)

    seeded_input()
    untouched = torch.rand(4, device=DEV)
    checkpointing.checkpoint(fn, seeded_input()).sum().backward()
    assert len(masks) == 2 and torch.equal(masks[0], masks[1])
    # the fork drew from the tracker's stream only: the default stream continues as if fn never ran
    assert torch.equal(torch.rand(4, device=DEV), untouched)
    with tracker.fork():
        again = F.dropout(torch.ones(32, 32, device=DEV), 0.5, True) != 0
    assert not torch.equal(again, masks[0])  # the tracker's stream moved on after the forward
    with pytest.raises(ValueError, match="no stream 'other'"), tracker.fork("other"):
        pass


def test_multiple_and_non_tensor_outputs_and_arguments():
    lin = nn.Linear(D, D).to(DEV)

    def fn(x, scale, tag, ids):
        y = lin(x) * scale
        return y, tag, ids + 1, y.sum(dim=-1)

    x, ids = make_input(), torch.arange(4, device=DEV)
    a, tag, ids1, s = checkpointing.checkpoint(fn, x, 3.0, "hello", ids)
    assert tag == "hello" and torch.equal(ids1, ids + 1) and not ids1.requires_grad
    (a.sum() + 2 * s.sum()).backward()
    got = [lin.weight.grad.clone(), x.grad.clone()]
    lin.weight.grad = x.grad = None
    a, _, _, s = fn(x, 3.0, "hello", ids)
    (a.sum() + 2 * s.sum()).backward()
    assert_grads_equal(got, [lin.weight.grad, x.grad])


def test_single_element_sequence_and_keyword_arguments():
    lin = nn.Linear(D, D).to(DEV)
    x = make_input()
    out = checkpointing.checkpoint(lambda x, *, bias: [lin(x) + bias], x, bias=torch.ones(D, device=DEV))
    assert isinstance(out, tuple) and len(out) == 1
    out[0].sum().backward()
    assert x.grad is not None and lin.weight.grad is not None


def test_outputs_without_tensors_come_back_unchanged():
    x = make_input()
    assert checkpointing.checkpoint(lambda x: None, x) is None
    assert checkpointing.checkpoint(lambda x: ("a", 1), x) == ("a", 1)


def test_recompute_runs_under_the_forward_autocast():
    lin = nn.Linear(D, D).to(DEV)
    x = make_input()
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        y = checkpointing.checkpoint(lin, x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    got = [lin.weight.grad.clone(), x.grad.clone()]
    lin.weight.grad = x.grad = None
    with torch.autocast(DEV.type, dtype=torch.bfloat16):
        y = lin(x)
    y.float().sum().backward()
    assert_grads_equal(got, [lin.weight.grad, x.grad])


def test_under_no_grad_it_is_a_plain_call():
    blocks, x = make_stack(1), make_input()
    with torch.no_grad():
        y = checkpointing.checkpoint(blocks[0], x)
    assert y.grad_fn is None and not y.requires_grad


def test_in_place_change_of_a_kept_input_is_reported():
    lin = nn.Linear(D, D).to(DEV)
    x = make_input(requires_grad=False).clone()
    y = checkpointing.checkpoint(lin, x)
    x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified in place"):
        y.sum().backward()


def test_autograd_grad_is_refused_with_the_fix():
    lin = nn.Linear(D, D).to(DEV)
    x = make_input()
    y = checkpointing.checkpoint(lin, x)
    with pytest.raises(RuntimeError, match=r"call \.backward\(\)"):
        torch.autograd.grad(y.sum(), x)


def saved_activations(output: torch.Tensor) -> list[SavedInput]:
    """What the checkpoint that produced `output` keeps for its recompute (the grad_fn is its ctx)."""
    return [s for s in output.grad_fn.saved if isinstance(s, SavedInput)]


def test_cpu_checkpointing_keeps_inputs_in_host_memory():
    checkpointing.configure(checkpoint_in_cpu=True)
    blocks, x = make_stack(), make_input()
    _, ref = run(blocks, x, checkpointed=False)
    zero_grads(blocks, x)
    torch.manual_seed(123)
    h, kept = x, []
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h)
        kept += saved_activations(h)
    assert len(kept) == N_BLOCKS
    for s in kept:
        assert s.data.device.type == "cpu" and s.device == x.device
        if DEV.type != "cpu":  # an offloaded copy, pinned so the copy back can be asynchronous
            assert not s.by_reference and s.data.is_pinned()
    (h * h).mean().backward()
    assert_grads_equal([p.grad for p in blocks.parameters()] + [x.grad], ref)


def test_contiguous_buffer_is_allocated_once_and_reused():
    checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=N_BLOCKS)
    blocks, x = make_stack(), make_input()
    _, ref = run(blocks, x, checkpointed=False)
    buffers = []
    for _ in range(3):
        torch.manual_seed(123)
        zero_grads(blocks, x)
        h, kept = x, []
        for blk in blocks:
            h = checkpointing.checkpoint(blk, h)
            kept += saved_activations(h)
        buffer = checkpointing.contiguous_buffer()
        assert buffer.numel() == N_BLOCKS * x.numel() * x.element_size()  # number_checkpoints slots
        # every kept input is a view into the one buffer: no per-step storage
        assert {s.data.untyped_storage().data_ptr() for s in kept} == {buffer.untyped_storage().data_ptr()}
        # holding every step's buffer: a reallocated one could not reuse the old address
        buffers.append(buffer)
        (h * h).mean().backward()
        assert_grads_equal([p.grad for p in blocks.parameters()] + [x.grad], ref)
    assert len({b.data_ptr() for b in buffers}) == 1


def test_contiguous_buffer_too_small_grows_once():
    checkpointing.configure(contiguous_checkpointing=True, num_checkpoints=2)  # the stack has 4 blocks
    blocks, x = make_stack(), make_input()
    _, ref = run(blocks, x, checkpointed=False)
    pointers = []
    for _ in range(3):
        _, got = run(blocks, x, checkpointed=True)
        assert_grads_equal(got, ref)
        pointers.append(checkpointing.contiguous_buffer().data_ptr())
    arena = next(iter(checkpointing._STATE.runtime.stasher.arenas.values()))
    assert arena.grow_count == 1 and arena.overflow_allocations == 2  # step 1 only: blocks 3 and 4
    assert arena.capacity == N_BLOCKS * x.numel() * x.element_size()
    assert pointers[1] == pointers[2]


def test_arena_slots_come_back_when_a_graph_is_dropped_without_backward():
    arena = ContiguousArena(2, lambda n: torch.empty(n, dtype=torch.uint8))
    a, b = arena.take(100, torch.float32), arena.take(100, torch.float32)
    start = arena.buffer.data_ptr()
    assert a.tensor.data_ptr() == start and b.tensor.data_ptr() == start + 512  # 400 B aligned to 256
    a.release()
    del b  # never released explicitly: collected like a freed autograd graph
    c = arena.take(100, torch.float32)
    assert c.tensor.data_ptr() == start and arena.grow_count == 0


def test_profile_counts_forwards_recomputes_and_backwards(caplog):
    checkpointing.configure(profile=True)
    blocks, x = make_stack(), make_input()
    for _ in range(2):
        run(blocks, x, checkpointed=True)
    with caplog.at_level(logging.INFO, logger="zerospeed.activation"):
        report = checkpointing.profile_report()
    for phase in ("forward", "recompute", "backward"):
        assert report[phase]["calls"] == 2 * N_BLOCKS
        assert report[phase]["seconds"] > 0
    assert report["backward"]["seconds"] >= report["recompute"]["seconds"]
    assert "recompute 8 calls" in caplog.text


def test_profile_off_counts_nothing():
    run(make_stack(), make_input(), checkpointed=True)
    assert all(v["calls"] == 0 for v in checkpointing.profile_report(log=False).values())


# -- configuration --------------------------------------------------------------------------------

SECTION = {
    "partition_activations": True,
    "cpu_checkpointing": True,
    "contiguous_memory_optimization": True,
    "number_checkpoints": 12,
    "synchronize_checkpoint_boundary": True,
    "profile": True,
}


def test_configure_from_dict_path_and_parsed_config(tmp_path):
    assert not checkpointing.is_configured()
    want = checkpointing.CheckpointingPolicy(**SECTION)
    checkpointing.configure(deepspeed_config={"train_batch_size": 8, "activation_checkpointing": SECTION})
    assert checkpointing.is_configured() and checkpointing.current_policy() == want
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps({"activation_checkpointing": SECTION}))
    checkpointing.configure(deepspeed_config=str(path))
    assert checkpointing.current_policy() == want
    parsed = parse_config({"train_batch_size": 8, "activation_checkpointing": SECTION}, check_features=False)
    checkpointing.configure(deepspeed_config=parsed)
    assert checkpointing.current_policy() == want
    checkpointing.unconfigure()
    assert not checkpointing.is_configured()
    assert checkpointing.current_policy() == checkpointing.CheckpointingPolicy()


def test_keywords_override_the_config():
    checkpointing.configure(
        deepspeed_config={"activation_checkpointing": SECTION},
        partition_activations=False,
        checkpoint_in_cpu=False,
        num_checkpoints=3,
        synchronize=False,
        profile=False,
    )
    assert checkpointing.current_policy() == checkpointing.CheckpointingPolicy(
        contiguous_memory_optimization=True, number_checkpoints=3
    )


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            {"deepspeed_config": {"activation_checkpointing": {"partition_activation": True}}},
            "activation_checkpointing.partition_activation: unknown key — did you mean partition_activations",
        ),
        (
            {"deepspeed_config": {"activation_checkpointing": {"number_checkpoints": 0}}},
            "activation_checkpointing.number_checkpoints: expected a positive integer",
        ),
        (
            {"contiguous_checkpointing": True},
            "contiguous_memory_optimization=true needs activation_checkpointing.number_checkpoints",
        ),
        (
            {"deepspeed_config": {"activation_checkpointing": {"contiguous_memory_optimization": True}}},
            "configure\\(num_checkpoints=N\\)",
        ),
        ({"num_checkpoints": 0}, "configure\\(num_checkpoints=0\\).*number_checkpoints.*positive integer"),
        ({"checkpoint_in_cpu": "yes"}, "configure\\(checkpoint_in_cpu='yes'\\).*cpu_checkpointing"),
        ({"deepspeed_config": "/no/such/ds_config.json"}, "neither a file that exists"),
        ({"mpu_": object()}, "lacks get_model_parallel_group"),
    ],
)
def test_bad_configuration_names_the_key_and_the_fix(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        checkpointing.configure(**kwargs)
    assert not checkpointing.is_configured()


def test_partition_without_model_parallel_group_warns_once(caplog):
    class SoloMpu:
        def get_model_parallel_group(self):
            return None

        def get_model_parallel_rank(self):
            return 0

        def get_model_parallel_world_size(self):
            return 1

    with caplog.at_level(logging.WARNING, logger="zerospeed.activation"):
        checkpointing.configure(partition_activations=True)
        checkpointing.configure(SoloMpu(), partition_activations=True)
        for _ in range(2):
            run(make_stack(), make_input(), checkpointed=True)
    warnings = [r for r in caplog.records if "partition_activations=true has no effect" in r.getMessage()]
    assert len(warnings) == 1
    assert "no model-parallel group" in warnings[0].getMessage()


def test_deepspeed_shortcuts_keep_the_rest_of_the_policy():
    checkpointing.configure(checkpoint_in_cpu=True, profile=True)
    checkpointing.set_num_layers(5)
    checkpointing.partition_activations_in_checkpoint(True)
    assert checkpointing.current_policy() == checkpointing.CheckpointingPolicy(
        partition_activations=True, cpu_checkpointing=True, number_checkpoints=5, profile=True
    )


# -- partition math ------------------------------------------------------------------------------


def test_partition_chunks_cover_the_tensor_exactly():
    assert [chunk_numel(n, 4) for n in (0, 1, 4, 10, 12)] == [0, 1, 1, 3, 3]
    assert [chunk_bounds(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [chunk_bounds(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
    flat = torch.arange(1.0, 11.0)
    assert copy_partition(flat, 4, 3, torch.full((3,), -1.0)).tolist() == [10.0, 0.0, 0.0]
    assert copy_partition(flat, 4, 1, torch.full((3,), -1.0)).tolist() == [4.0, 5.0, 6.0]
    with pytest.raises(ValueError, match="rank 4 is outside a group of 4"):
        chunk_bounds(10, 4, 4)


# -- memory: the census at the end of forward ----------------------------------------------------

MEM_BLOCKS, MEM_BATCH, MEM_SEQ, MEM_HIDDEN = 16, 8, 256, 128


def forward_bytes(blocks: nn.ModuleList, x: torch.Tensor, checkpointed: bool) -> int:
    """Bytes of tensor storage the forward leaves alive for backward (independent census)."""
    before = live_tensor_bytes()
    h = x
    for blk in blocks:
        h = checkpointing.checkpoint(blk, h) if checkpointed else blk(h)
    loss = h.pow(2).mean()
    held = live_tensor_bytes() - before
    del h, loss
    return held


def test_checkpointing_keeps_one_block_input_per_block():
    torch.manual_seed(0)
    cfg = GPTConfig(block_size=MEM_SEQ, n_layer=MEM_BLOCKS, n_head=4, n_embd=MEM_HIDDEN)
    blocks = nn.ModuleList(Block(cfg) for _ in range(MEM_BLOCKS)).to(DEV)
    x = torch.randn(MEM_BATCH, MEM_SEQ, MEM_HIDDEN, device=DEV, requires_grad=True)
    one_input = x.numel() * x.element_size()  # 1 MiB
    plain = forward_bytes(blocks, x, checkpointed=False)
    kept = forward_bytes(blocks, x, checkpointed=True)
    print(
        f"\nend-of-forward census: no checkpointing {plain / 2**20:.1f} MiB, "
        f"checkpointing {kept / 2**20:.1f} MiB, one block input {one_input / 2**20:.1f} MiB"
    )
    # inputs of blocks 2..16 plus the last output (block 1's input is x, alive before), the loss, and
    # per checkpoint the host RNG state for the replay (5056 B)
    assert MEM_BLOCKS * one_input <= kept <= MEM_BLOCKS * (one_input + 8 * 1024) + 1024
    assert plain >= 5 * kept
