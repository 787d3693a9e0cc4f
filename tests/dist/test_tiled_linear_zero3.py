"""TiledLinear trained at ZeRO stage 3 on 2 ranks equals the same model with one `nn.Linear` in one plain
PyTorch process (fp32, AdamW), and stage 3 never holds the whole layer gathered: one tile at a time
(Note [tiles are units] in zerospeed/zero/stage3/tiling.py).

What is gathered is counted from the parameters themselves (a released stage-3 parameter points at an
empty tensor): the distinct storages behind the layer's non-empty parameters, sampled inside every
tile's forward and backward. The engine's own counter (`Residency.live`) and the all-gather payloads
(`comm.STATS`) are recorded beside it. The same run with a plain `nn.Linear` in its place shows the
contrast (the whole layer gathered at once)."""

import pytest
import torch

from harness import reference_train, run_distributed, split_global_batch

IN, HIDDEN, OUT, IN_SPLITS, OUT_SPLITS = 45, 70, 3, 3, 4  # uneven: 45 = 15 x 3, 70 = 18 + 18 + 17 + 17
WORLD, MICRO, STEPS = 2, 4, 4
ADAMW = {"lr": 1e-2, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
LAYER_BYTES = (IN * HIDDEN + HIDDEN) * 4
CFG = {
    "train_micro_batch_size_per_gpu": MICRO,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "optimizer": {"type": "AdamW", "params": ADAMW},
    "zero_optimization": {
        "stage": 3,
        # gather each unit when it is used and release it after: no look-ahead, no reuse window
        "stage3_prefetch_bucket_size": 0,
        "stage3_max_reuse_distance": 0,
        "stage3_param_persistence_threshold": 0,
    },
}


def _model(tiled: str | None):
    """The plain model (None), or with its first layer tiled into "linear" (nn.Linear) or "wrapper" tiles
    (DeepSpeed's LinearModuleForZeroStage3, Note [the linear wrapper])."""
    from zerospeed.zero.stage3.linear import LinearModuleForZeroStage3
    from zerospeed.zero.stage3.tiling import TiledLinear

    torch.manual_seed(0)
    big, head = torch.nn.Linear(IN, HIDDEN), torch.nn.Linear(HIDDEN, OUT)
    layer = big
    if tiled:
        cls = LinearModuleForZeroStage3 if tiled == "wrapper" else torch.nn.Linear
        layer = TiledLinear(IN, HIDDEN, in_splits=IN_SPLITS, out_splits=OUT_SPLITS, linear_cls=cls, init_linear=big)
    return torch.nn.Sequential(layer, torch.nn.Tanh(), head)


def _loss(model, x, y):
    return (model(x) - y).square().mean()


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        (torch.randn(WORLD * MICRO, IN, generator=g), torch.randn(WORLD * MICRO, OUT, generator=g))
        for _ in range(STEPS)
    ]


def _gathered_bytes(layer):
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in layer.parameters() if p.numel()}
    return sum(storages.values())


def _train(tiled: str | None):
    import zerospeed
    from zerospeed import comm
    from zerospeed.zero import GatheredParameters

    model = _model(tiled)
    engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=CFG)
    layer = engine.module[0]
    units = [t for row in layer.linears for t in row] if tiled else [layer]
    peak = {"census": 0, "engine": 0}

    def sample(*_):
        peak["census"] = max(peak["census"], _gathered_bytes(layer))
        peak["engine"] = max(peak["engine"], engine.zero.residency.live * 4)  # fp32: 4 bytes an element

    for unit in units:
        unit.register_forward_pre_hook(sample)  # runs after stage 3's pre-hook has gathered the unit
        unit.weight.register_hook(lambda g: sample())  # inside the unit's backward, before its release
    rank = torch.distributed.get_rank()
    losses = []
    comm.STATS.reset()
    for x, y in _batches():
        ((mx, my),) = split_global_batch((x, y), WORLD, 1, rank)
        loss = _loss(engine, mx, my)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    gathers = comm.STATS.snapshot()["all_gather"]
    with GatheredParameters(list(engine.module.parameters())):
        final = [p.detach().clone() for p in engine.module.parameters()]
    if tiled:
        final = [_whole(layer, final)] + final[-2:]
    return {"losses": losses, "final": final, "peak": peak, "gathers": gathers}


def _whole(layer, tensors):
    """The tiles' gathered values (in parameter order) put back into one [HIDDEN, IN] weight and bias."""
    it = iter(tensors)
    rows, biases = [], []
    for row in layer.linears:
        pieces = []
        for tile in row:
            pieces.append(next(it))
            if tile.bias is not None:
                biases.append(next(it))
        rows.append(torch.cat(pieces, dim=1))
    return torch.cat(rows, dim=0), torch.cat(biases)


def _init_probe():
    """Built under zero.Init the tiles are sharded as they are made; `init_linear` still copies rank 0's
    values of the source layer into them (a collective)."""
    from zerospeed import zero
    from zerospeed.zero.stage3.tiling import TiledLinear

    torch.manual_seed(torch.distributed.get_rank())  # different sources on each rank: rank 0's must win
    src = torch.nn.Linear(IN, HIDDEN)
    with zero.Init(config_dict_or_path=CFG):
        layer = TiledLinear(IN, HIDDEN, in_splits=IN_SPLITS, out_splits=OUT_SPLITS, init_linear=src)
    sharded = all(p.numel() == 0 for p in layer.parameters())
    with zero.GatheredParameters(list(layer.parameters())):
        w, b = _whole(layer, [p.detach().clone() for p in layer.parameters()])
    return {"sharded": sharded, "weight": w, "bias": b}


def _reference():
    model = _model(None)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = reference_train(model, opt, _batches(), world_size=WORLD, grad_accum=1, loss_fn=_loss, clip=1.0)
    return losses, [p.detach() for p in model.parameters()]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("tiles", ["linear", "wrapper"])
def test_tiled_linear_zero3_equals_plain_linear_and_gathers_one_tile_at_a_time(tiles):
    tiled = run_distributed(_train, WORLD, tiles, timeout=150)
    plain = run_distributed(_train, WORLD, None, timeout=150)
    ref_losses, ref_final = _reference()
    ref_final = [(ref_final[0], ref_final[1])] + ref_final[2:]
    for r in tiled:
        rank_losses = r["losses"]
        # each rank's loss is that of its micro-batch; the reference's the mean over both ranks
        assert len(rank_losses) == STEPS
        (w, b), *head = r["final"]
        torch.testing.assert_close(w, ref_final[0][0], rtol=0, atol=1e-5)
        torch.testing.assert_close(b, ref_final[0][1], rtol=0, atol=1e-5)
        for got, want in zip(head, ref_final[1:]):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    mean = [sum(r["losses"][s] for r in tiled) / WORLD for s in range(STEPS)]
    assert max(abs(a - b) for a, b in zip(mean, ref_losses)) <= 1e-5, (mean, ref_losses)
    tile_bytes = max(t * 4 for t in _tile_numels())
    for r, p in zip(tiled, plain):
        print(
            f"peak gathered bytes: tiled {r['peak']} vs whole layer {LAYER_BYTES} (plain Linear {p['peak']}); "
            f"all-gathers tiled {r['gathers']['calls']} calls {r['gathers']['payload_bytes']} B, "
            f"plain {p['gathers']['calls']} calls {p['gathers']['payload_bytes']} B"
        )
        # one tile (padded to a multiple of 4 x world elements) at a time, never the whole layer
        assert 0 < r["peak"]["census"] <= tile_bytes + 4 * 4 * WORLD < LAYER_BYTES
        assert p["peak"]["census"] >= LAYER_BYTES  # the contrast: nn.Linear is one unit
        assert r["peak"]["engine"] <= tile_bytes + 4 * 4 * WORLD


def _tile_numels():
    from zerospeed.zero.stage3.tiling import tile_bounds

    ins, outs = tile_bounds(IN, IN_SPLITS), tile_bounds(HIDDEN, OUT_SPLITS)
    return [
        (o1 - o0) * (i1 - i0) + ((o1 - o0) if k == IN_SPLITS - 1 else 0)
        for o0, o1 in zip(outs, outs[1:])
        for k, (i0, i1) in enumerate(zip(ins, ins[1:]))
    ]


@pytest.mark.timeout(120)
def test_init_linear_under_zero_init_copies_rank_0s_layer():
    torch.manual_seed(0)
    src = torch.nn.Linear(IN, HIDDEN)  # rank 0's source (seed 0)
    for r in run_distributed(_init_probe, WORLD, timeout=100):
        assert r["sharded"]
        torch.testing.assert_close(r["weight"], src.weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(r["bias"], src.bias.detach(), rtol=0, atol=0)
