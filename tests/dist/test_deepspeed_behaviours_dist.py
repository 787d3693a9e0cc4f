"""DeepSpeed behaviours that need ranks (issue 49), each against plain single-process PyTorch or DeepSpeed's
documented semantics:

- ZeRO-3 trains a model whose forward reads another module's weight (`F.linear(h, self.b.weight)` where
  `self.b` never runs) and one whose module returns its own bias for the caller to use (DeepSpeed's
  tests/unit/runtime/zero/test_zero_context_return.py pattern): losses equal plain PyTorch's, step by step;
- `torch.nn.utils.skip_init` inside `zero.Init(mem_efficient_linear=False)` shards every parameter, and the
  `ds_*` views: each rank's `ds_tensor` parts of a parameter add up to its `ds_numel` across the ranks;
- checkpoint tags that differ across ranks under `tag_validation: FAIL` raise an AssertionError on every
  rank (DeepSpeed: `assert valid, msg` in `_checkpoint_tag_validation`);
- `init_inference(tensor_parallel={"tp_size": 2})` on 2 ranks with no process group yet joins one itself
  (DeepSpeed's `InferenceEngine._create_model_parallel_group` calls `init_distributed`), and its logits equal
  the unsharded model's.

Every rank feeds the same batch, so data-parallel averaging leaves the single-process gradients unchanged.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from harness.deepspeed_models import SkipInitModel

STEPS = 5


class DanglingBias(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x), self.bias  # the caller adds the bias after this module's forward


class ReturnsItsBias(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l1 = torch.nn.Linear(8, 8)
        self.dangler = DanglingBias(8, 8)

    def forward(self, x):
        out, bias = self.dangler(self.l1(x))
        return (out + bias).pow(2).mean()


class ReadsAnotherWeight(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)  # never called: only its weight is used

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.a(x)), self.b.weight).pow(2).mean()


class OwnsOneAndReadsAnother(ReadsAnotherWeight):
    """The reading module owns a parameter itself, so its hooks run: the read registers with it."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        return torch.nn.functional.linear(torch.tanh(self.a(x)) * self.scale, self.b.weight).pow(2).mean()


MODELS = {
    "returns its bias": ReturnsItsBias,
    "reads another weight": ReadsAnotherWeight,
    "owns one": OwnsOneAndReadsAnother,
}


def _external_uses():
    import zerospeed

    out = {}
    for name, cls in MODELS.items():
        torch.manual_seed(0)
        model = cls()
        reference = cls()
        reference.load_state_dict(model.state_dict())
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "SGD", "params": {"lr": 0.5}},
            "zero_optimization": {  # every unit released right after each use: no reuse keeps one gathered
                "stage": 3,
                "stage3_param_persistence_threshold": 0,
                "stage3_max_reuse_distance": 0,
                "stage3_max_live_parameters": 0,
                "stage3_prefetch_bucket_size": 0,
            },
        }
        engine, *_ = zerospeed.initialize(model=model, config=config)
        losses = []
        for step in range(STEPS):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            loss = engine(x)
            engine.backward(loss)
            engine.step()
            expected = reference(x)
            optimizer.zero_grad()
            expected.backward()
            optimizer.step()
            losses.append((loss.item(), expected.item()))
        out[name] = losses
        engine.destroy()
    return out


@pytest.mark.timeout(120)
def test_zero3_trains_models_that_use_parameters_outside_their_module():
    for rank, result in enumerate(run_distributed(_external_uses, 2, timeout=100)):
        for name, losses in result.items():
            got, expected = zip(*losses)
            torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-6, msg=name)
            assert len(set(got)) == STEPS, (rank, name)  # it trains


def _skip_init_and_views():
    import zerospeed
    from zerospeed.zero.stage3.api import GatheredParameters, Init, ZeroParamStatus

    with Init(mem_efficient_linear=False):
        model = SkipInitModel()
    views = {n: (tuple(p.ds_shape), p.ds_numel, p.ds_tensor.numel(), p.ds_status) for n, p in model.named_parameters()}
    with GatheredParameters(list(model.parameters()), modifier_rank=0), torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.fill_(0.01 * (i + 1))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_clipping": 0.0,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3},
    }
    engine, *_ = zerospeed.initialize(model=model, config=config)
    losses = []
    for step in range(3):
        loss = engine(torch.randn(2, 10, generator=torch.Generator().manual_seed(step)))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return views, losses, ZeroParamStatus.NOT_AVAILABLE


@pytest.mark.timeout(120)
def test_skip_init_in_zero_init_and_the_ds_views():
    ranks = run_distributed(_skip_init_and_views, 2, timeout=100)
    reference = SkipInitModel()
    with torch.no_grad():
        for i, p in enumerate(reference.parameters()):
            p.fill_(0.01 * (i + 1))
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    expected = []
    for step in range(3):
        loss = reference(torch.randn(2, 10, generator=torch.Generator().manual_seed(step)))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        expected.append(loss.item())
    for name, p in reference.named_parameters():
        shapes = {r[0][name][0] for r in ranks}
        assert shapes == {tuple(p.shape)}, name
        assert all(r[0][name][1] == p.numel() for r in ranks), name
        assert sum(r[0][name][2] for r in ranks) == p.numel(), name  # the ranks' parts add up to the whole
        assert all(r[0][name][3] is r[2] for r in ranks), name  # sharded after zero.Init
    for _, losses, _ in ranks:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-5, atol=1e-6)


def _tag_mismatch(tmp: str):
    import zerospeed
    from zerospeed import comm

    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "checkpoint": {"tag_validation": "FAIL"},
    }
    engine, *_ = zerospeed.initialize(model=torch.nn.Linear(2, 2), config=config)
    try:
        engine.save_checkpoint(tmp, tag=f"step-on-rank{comm.get_rank()}")
    except AssertionError as e:
        return type(e).__name__, str(e)
    return None


@pytest.mark.timeout(120)
def test_checkpoint_tag_mismatch_is_an_assertion_error_on_every_rank(tmp_path):
    for result in run_distributed(_tag_mismatch, 2, str(tmp_path), timeout=100):
        assert result is not None and "tags differ across ranks" in result[1], result


def _inference_joins_the_group():
    from transformers import GPT2Config, GPT2LMHeadModel

    import zerospeed
    from zerospeed import comm

    comm.destroy()  # the harness joined one; DeepSpeed's tutorial script has none
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=37, n_positions=16, n_embd=16, n_layer=1, n_head=4, bos_token_id=1, eos_token_id=1)
    model = GPT2LMHeadModel(cfg).eval()
    ids = torch.randint(0, 37, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    engine = zerospeed.init_inference(model, tensor_parallel={"tp_size": 2}, dtype=torch.float32)
    with torch.no_grad():
        got = engine(input_ids=ids).logits
    return comm.get_world_size(), (got - expected).abs().max().item()


@pytest.mark.timeout(180)
def test_init_inference_joins_the_process_group_itself():
    for world, error in run_distributed(_inference_joins_the_group, 2, timeout=150):
        assert world == 2
        assert error < 1e-5


def _partitioned_tensor(rows, cols):
    from zerospeed.comm.partitioned import PartitionedTensor

    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)  # the same on every rank
    part = PartitionedTensor(full, group=None)
    again = PartitionedTensor.from_meta(part.to_meta(), part.local_data.clone(), group=None)
    return part.local_data, part.partition, part.to_meta().tolist(), part.full(), again.full()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rows,cols", [(6, 2), (7, 5)])
def test_partitioned_tensor_splits_and_gathers(rows, cols):
    """`deepspeed.runtime.utils.PartitionedTensor` over 3 ranks: rank r holds its contiguous slice of the
    flattened tensor (the first numel % 3 ranks one element more), `full()` is the original tensor, and
    `to_meta()` is DeepSpeed's layout `[ndim, *shape, world, rank, *bounds]`, from which `from_meta` rebuilds it."""
    full = torch.arange(rows * cols, dtype=torch.float32).reshape(rows, cols)
    flat, world = full.reshape(-1), 3
    base, extra = divmod(full.numel(), world)
    sizes = [base + (r < extra) for r in range(world)]
    bounds = [sum(sizes[:r]) for r in range(world + 1)]
    for rank, (local, partition, meta, gathered, rebuilt) in enumerate(
        run_distributed(_partitioned_tensor, world, rows, cols, timeout=100)
    ):
        assert partition == bounds
        assert torch.equal(local, flat[bounds[rank] : bounds[rank + 1]])
        assert meta == [2, rows, cols, world, rank, *bounds]
        assert torch.equal(gathered, full) and torch.equal(rebuilt, full)


def _local_pieces():
    import zerospeed
    from zerospeed import comm
    from zerospeed.utils import safe_get_local_fp32_param, safe_get_local_grad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 1), torch.nn.Linear(1, 1), torch.nn.Linear(1, 6))
    initial = [p.detach().clone() for p in model.parameters()]
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, *_ = zerospeed.initialize(model=model, config=config)
    engine.backward(engine(torch.ones(1, 6)).sum())
    pieces = [(safe_get_local_fp32_param(p), safe_get_local_grad(p)) for p in engine.module.parameters()]
    return comm.get_rank(), initial, [(w.detach().cpu(), g.detach().cpu()) for w, g in pieces]


@pytest.mark.timeout(120)
def test_local_getters_give_every_rank_a_tensor_at_zero3():
    """DeepSpeed gives each rank a piece of every parameter, and its tests expect `safe_get_local_*` to return a
    tensor for every trained parameter: a rank that holds none of one (a 1-element weight) gets an empty tensor,
    and the ranks' pieces concatenate to the initial weights (plain PyTorch's, same seed)."""
    ranks = run_distributed(_local_pieces, 2, timeout=100)
    initial = ranks[0][1]
    sizes = []
    for i, weight in enumerate(initial):
        pieces = [r[2][i] for r in ranks]
        assert all(w.dim() == 1 and g.numel() == w.numel() for w, g in pieces)
        torch.testing.assert_close(torch.cat([w for w, _ in pieces]), weight.reshape(-1))
        sizes += [w.numel() for w, _ in pieces]
    assert 0 in sizes  # the case the test is about occurs


def _clip_on_each_rank(max_norm):
    from zerospeed import comm
    from zerospeed.parallel.clipping import clip_grad_norm_

    rank = comm.get_rank()
    shared, expert = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    shared.grad, expert.grad = torch.tensor([3.0, 4.0]), torch.full((3,), float(rank + 1))
    norm = clip_grad_norm_([shared, expert], max_norm)
    return float(norm), shared.grad.clone(), expert.grad.clone()


@pytest.mark.timeout(120)
def test_clip_grad_norm_averages_the_ranks_norms():
    """`deepspeed.runtime.utils.clip_grad_norm_` with gradients that differ by rank (an expert's): each rank's
    L2 norm, averaged over the data-parallel group (the world here), and every rank clips by that mean
    (DeepSpeed's formula; its test_gather checks the ranks agree)."""
    norms = [(25 + 3 * (r + 1) ** 2) ** 0.5 for r in range(2)]
    mean = sum(norms) / 2
    for rank, (norm, shared, expert) in enumerate(run_distributed(_clip_on_each_rank, 2, 1.0, timeout=100)):
        assert norm == pytest.approx(mean, rel=1e-6)
        coef = 1.0 / (mean + 1e-6)
        torch.testing.assert_close(shared, torch.tensor([3.0, 4.0]) * coef)
        torch.testing.assert_close(expert, torch.full((3,), float(rank + 1)) * coef)
