"""ZeRO-3 leaf modules (Note [leaf modules], zero/stage3/strategy.py) against plain single-process PyTorch:
a mixture-of-experts block whose ranks route their tokens to different experts trains only as a leaf
(without one the ranks gather different experts, which stage 3 refuses), and the units are exactly the
leaves and the modules outside them, whether flagged by `stage3_module_granularity_threshold`, by the
`leaf_module` config keys or by `zerospeed.utils.set_z3_leaf_modules`."""

import pytest
import torch
from torch import nn

import zerospeed
from harness import reference_train, run_distributed
from harness.reference import engine_global_step
from zerospeed import comm
from zerospeed.utils import set_z3_leaf_modules, z3_leaf_parameter

MICRO, GAS, STEPS, T, WORLD = 2, 2, 4, 6, 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        self.norm = nn.LayerNorm(16)

    def forward(self, h):
        h = h + torch.tanh(self.attn(self.norm(h)))
        return h + self.mlp(h)


class Experts(nn.Module):
    """Each token goes to one expert picked from its id (ids below 50 to experts 0-1, the rest to 2-3),
    weighted by a learned gate: a rank whose tokens are all low ids never runs experts 2 and 3."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(16, 4)
        self.experts = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, h, ids):
        route = ids % 2 + 2 * (ids >= 50)
        weight = torch.softmax(self.gate(h), dim=-1)
        out = torch.zeros_like(h)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                out = out.index_put((mask,), expert(h[mask]) * weight[mask][:, e : e + 1])
        return h + out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(100, 16)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.moe = Experts()
        self.head = nn.Linear(16, 3)
        self.blocks[1].norm.requires_grad_(False)  # a frozen unit inside a leaf

    def forward(self, ids, y):
        h = self.emb(ids)
        for b in self.blocks:
            h = b(h)
        return nn.functional.mse_loss(self.head(self.moe(h, ids)).mean(1), y)


def batches():
    """Global batches whose block b of MICRO samples (rank b % WORLD's, by split_global_batch) holds low ids
    on even b and high ids on odd b: rank 0 routes to experts 0-1 only, rank 1 to 2-3 only."""
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        ids = torch.cat([torch.randint(0, 50, (MICRO, T), generator=g) + 50 * (b % 2) for b in range(WORLD * GAS)])
        out.append((ids, torch.randn(WORLD * GAS * MICRO, 3, generator=g)))
    return out


def _config(**zero):
    return {
        "train_micro_batch_size_per_gpu": MICRO,
        "gradient_clipping": 0.0,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, **zero},
    }


def _train(how):
    torch.manual_seed(0)
    model = Net()
    if how == "api":
        set_z3_leaf_modules(model, [Experts])
    cfg = {
        "threshold": _config(stage3_module_granularity_threshold=280),
        "config": _config(leaf_module={"classes": ["Experts"], "names": ["blocks.1"]}),
        "api": _config(),
        "none": _config(),
    }[how]
    engine, *_ = zerospeed.initialize(model=model, config=cfg)
    rank = comm.get_rank()
    try:
        losses = [engine_global_step(engine, b, WORLD, GAS, rank) for b in batches()]
    except RuntimeError as e:
        return str(e)
    units = [n for n, m in engine.module.named_modules() if id(m) in engine.zero.uses]
    marked = sorted(n for n, p in engine.module.named_parameters() if z3_leaf_parameter(p))
    state = {k: v.float().clone() for k, v in engine.zero.full_state_dict().items()}
    return losses, units, marked, state


class TiedInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.top = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 10))
        self.top[1].weight = self.emb.weight  # owned by emb, outside the leaf


def _tied_inside():
    model = TiedInside()
    set_z3_leaf_modules(model, [nn.Sequential])
    try:
        zerospeed.initialize(model=model, config=_config())
    except ValueError as e:
        return str(e)
    return "built"


def _every_way():
    out = {how: _train(how) for how in ("threshold", "config", "api")}  # one spawn
    out["tied"] = _tied_inside()
    out["none"] = _train("none")  # last: it ends in a refused gather
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_every_way, WORLD, timeout=200)


def _reference():
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    losses = reference_train(ref, opt, batches(), world_size=WORLD, grad_accum=GAS)
    return losses, ref.state_dict()


UNITS = {
    "threshold": ["emb", "blocks.0", "blocks.1", "moe", "head"],
    "config": ["emb", "blocks.0.attn", "blocks.0.mlp.0", "blocks.0.mlp.2", "blocks.0.norm", "blocks.1", "moe", "head"],
    "api": [
        "emb",
        "blocks.0.attn",
        "blocks.0.mlp.0",
        "blocks.0.mlp.2",
        "blocks.0.norm",
        "blocks.1.attn",
        "blocks.1.mlp.0",
        "blocks.1.mlp.2",
        "blocks.1.norm",
        "moe",
        "head",
    ],
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["threshold", "config", "api"])
def test_leaf_modules_train_like_pytorch_with_hooks_only_on_the_units(how, runs):
    ref_losses, ref_state = _reference()
    for rank, result in enumerate(runs):
        assert not isinstance(result[how], str), f"rank {rank}: {result[how]}"
        losses, units, marked, state = result[how]
        assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-5, (losses, ref_losses)
        assert units == UNITS[how]
        leaves = [u for u in units if u in ("blocks.0", "blocks.1", "moe")]
        assert marked == sorted(n for n in ref_state if any(n.startswith(f"{leaf}.") for leaf in leaves))
        if rank == 0:
            for k, v in ref_state.items():
                assert torch.allclose(state[k], v, atol=1e-5), k


@pytest.mark.timeout(240)
def test_without_a_leaf_the_divergent_routing_is_refused(runs):
    for result in runs:
        assert isinstance(result["none"], str) and "ranks gathered different parameters" in result["none"]


@pytest.mark.timeout(240)
def test_a_tie_from_inside_a_leaf_to_outside_is_refused_naming_both(runs):
    for result in runs:
        assert result["tied"].startswith("top.1.weight lies inside the ZeRO-3 leaf module 'top'"), result["tied"]


if __name__ == "__main__":
    print(run_distributed(_every_way, WORLD, timeout=200)[0]["threshold"][:3])
