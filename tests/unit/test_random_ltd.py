"""Random-LTD (data/random_ltd): the fixed_linear schedule and the layer-token count by
hand; the layer wrapper against the plain layer run on the kept tokens by indexing (outputs, gradients,
both hidden-state layouts, the decoder / encoder mask cuts); the helpers; the config's refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import zerospeed
from zerospeed.config.parse import parse_config
from zerospeed.data.random_ltd import (
    RandomLayerTokenDrop,
    RandomLTDScheduler,
    convert_to_random_ltd,
    remove_random_ltd_state_dict,
    save_without_random_ltd,
)
from zerospeed.data.random_ltd.helper import bind_random_ltd_layers
from zerospeed.utils.errors import ConfigError


def ltd_config(min_value=6, max_value=20, require_steps=7, seq_per_step=4, ids=(1, 3), total=4, **over):
    return {
        "enabled": True,
        "total_layer_num": total,
        "random_ltd_layer_num": len(ids),
        "random_ltd_layer_id": list(ids),
        "model_mask_name": None,
        "model_type": "decoder",
        "hidden_state_order": "batch_seq_dim",
        "global_batch_size": 8,
        "micro_batch_size": 2,
        "random_ltd_schedule": {
            "min_value": min_value,
            "max_value": max_value,
            "schedule_type": "fixed_linear",
            "schedule_config": {"require_steps": require_steps, "seq_per_step": seq_per_step},
        },
        **over,
    }


# -- the schedule -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "schedule, want",
    [
        # floor(6 + 14 t / 7) = 6 + 2t, down to a multiple of 4 (t=0: 6 -> 4, below min_value), at most 20
        ((6, 20, 7, 4), {0: 4, 1: 8, 2: 8, 3: 12, 4: 12, 5: 16, 6: 16, 7: 20, 8: 20, 100: 20}),
        # floor(5 + 10 t / 3): t=1 8.33 -> 8, t=2 11.67 -> 11 -> 10, t=3 15 -> 14, t=4 18.3 -> 18 -> 15 (the cap)
        ((5, 15, 3, 2), {0: 4, 1: 8, 2: 10, 3: 14, 4: 15, 9: 15}),
    ],
)
def test_fixed_linear_by_hand(schedule, want):
    lo, hi, steps, per = schedule
    sched = RandomLTDScheduler(ltd_config(lo, hi, steps, per))
    assert {t: sched.get_value(t) for t in want} == want
    assert sched.get_current_seq() == lo  # before the first update: min_value itself


def test_update_seq_counts_layer_tokens_once_per_step_and_stops_at_the_maximum():
    sched = RandomLTDScheduler(ltd_config())  # 4 layers, 2 dropping, global batch 8, max 20
    seen = []
    for step in (0, 0, 1, 2, 2, 3):  # a step's second forward (gradient accumulation) counts nothing
        sched.update_seq(step)
        seen.append(sched.get_current_seq())
    assert seen == [4, 4, 8, 8, 8, 12]
    # 8 * (r * 2 + 20 * 2) for r = 4, 8, 8, 12
    assert sched.state["consumed_layer_tokens"] == 384 + 448 + 448 + 512
    assert sched.state_dict() == {
        "consumed_layer_tokens": 1792,
        "current_steps": 3,
        "current_value": 12,
        "min_value": 6,
        "max_value": 20,
    }
    sched.set_current_seq(20)
    sched.update_seq(4)  # at max_value the schedule is no longer asked (it would say 12)
    assert sched.get_current_seq() == 20 and sched.state["consumed_layer_tokens"] == 1792 + 8 * 80
    fresh = RandomLTDScheduler(ltd_config())
    fresh.load_state_dict(sched.state_dict())
    assert fresh.state_dict() == sched.state_dict() and fresh.get_random_ltd_layer_num() == 2
    assert RandomLTDScheduler(ltd_config()).get_total_layer_tokens(4) == 1792


# -- the layer ----------------------------------------------------------------------------------------
class SeqMix(nn.Module):
    """A per-token map plus a running mean over the sequence (dim `seq_dim`): its output at a token
    depends on which tokens came before it, as attention's does."""

    def __init__(self, hidden=5, seq_dim=1, tuple_out=False):
        super().__init__()
        self.lin, self.seq_dim, self.tuple_out = nn.Linear(hidden, hidden), seq_dim, tuple_out
        self.masks = []

    def forward(self, x, attention_mask=None):
        self.masks.append(attention_mask)
        steps = torch.arange(1, x.size(self.seq_dim) + 1, dtype=x.dtype)
        steps = steps.view(-1, 1, 1) if self.seq_dim == 0 else steps.view(1, -1, 1)
        y = torch.tanh(self.lin(x) + x.cumsum(self.seq_dim) / steps)
        if attention_mask is not None:  # something the mask changes
            y = y + attention_mask.float().mean()
        return (y, "extra") if self.tuple_out else y


def wrapped(layer, reserved, ids=(0,), layer_id=0, scheduler=None, **over):
    config = ltd_config(ids=ids, total=len(ids), min_value=reserved, max_value=64, **over)
    scheduler = scheduler or RandomLTDScheduler(config)
    wrapper = RandomLayerTokenDrop(layer)
    wrapper.init_config(config, scheduler, layer_id)
    return wrapper.train(), scheduler


def by_indexing(layer, x, kept, seq_dim=1, **kwargs):
    """The plain layer on each sample's kept tokens, written back by indexing; the rest as they were."""
    xs = x if seq_dim == 1 else x.transpose(0, 1)
    sub = torch.stack([xs[b, kept[b]] for b in range(xs.size(0))])
    y = layer(sub if seq_dim == 1 else sub.transpose(0, 1), **kwargs)
    ys = y if seq_dim == 1 else y.transpose(0, 1)
    out = xs.clone()
    for b in range(xs.size(0)):
        out[b, kept[b]] = ys[b]
    return out if seq_dim == 1 else out.transpose(0, 1)


@pytest.mark.parametrize("order, seq_dim", [("batch_seq_dim", 1), ("seq_batch_dim", 0)])
def test_kept_tokens_go_through_the_layer_and_dropped_ones_pass_unchanged(order, seq_dim):
    torch.manual_seed(0)
    B, S, H, R = 3, 10, 5, 4
    layer = SeqMix(H, seq_dim)
    ltd, sched = wrapped(layer, R, hidden_state_order=order)
    x = torch.randn((B, S, H) if seq_dim == 1 else (S, B, H), requires_grad=True)
    out = ltd(x)
    kept = sched.state["sample_idx"][0]  # DeepSpeed's key: [layers, batch, reserved]
    assert sched.state["sample_idx"].shape == (1, B, R)
    for b in range(B):
        assert kept[b].tolist() == sorted(set(kept[b].tolist())) and 0 <= kept[b].min() and kept[b].max() < S
    x_ref = x.detach().clone().requires_grad_(True)
    want = by_indexing(layer, x_ref, kept, seq_dim)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    xs, outs = (x, out) if seq_dim == 1 else (x.transpose(0, 1), out.transpose(0, 1))
    for b in range(B):
        dropped = [s for s in range(S) if s not in kept[b].tolist()]
        assert torch.equal(outs[b, dropped], xs[b, dropped])
    # gradients: the input's and the layer's, against autograd through the indexing reference
    weights = torch.randn_like(out)
    (out * weights).sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
    layer.zero_grad()
    (want * weights).sum().backward()
    for g, w in zip(got, [x_ref.grad] + [p.grad for p in layer.parameters()]):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_full_length_eval_and_unbound_layers_are_the_plain_layer():
    torch.manual_seed(1)
    layer = SeqMix()
    x = torch.randn(2, 6, 5)
    plain = layer(x)
    full, _ = wrapped(layer, reserved=6)
    assert torch.equal(full(x), plain)
    short, sched = wrapped(layer, reserved=3)
    assert torch.equal(short.eval()(x), plain) and "sample_idx" not in sched.state
    assert torch.equal(RandomLayerTokenDrop(layer).train()(x), plain)
    with pytest.raises(TypeError, match="pass them by keyword"):
        RandomLayerTokenDrop(layer)(x, None)


def test_tuple_outputs_and_a_second_layer_reuse_layer_zeros_draw():
    torch.manual_seed(2)
    first, second = SeqMix(tuple_out=True), SeqMix()
    ltd0, sched = wrapped(first, 3, ids=(0, 1), layer_id=0)
    ltd1, _ = wrapped(second, 3, ids=(0, 1), layer_id=1, scheduler=sched)
    x = torch.randn(2, 7, 5)
    h, extra = ltd0(x)
    out = ltd1(h)
    drawn = sched.state["sample_idx"]
    assert drawn.shape == (2, 2, 3) and extra == "extra"
    torch.testing.assert_close(h, by_indexing(lambda t: first(t)[0], x, drawn[0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, by_indexing(second, h, drawn[1]), rtol=1e-6, atol=1e-6)


def test_positions_are_drawn_uniformly():
    torch.manual_seed(3)
    ltd, sched = wrapped(SeqMix(), reserved=4)
    counts = torch.zeros(8)
    for _ in range(100):
        ltd(torch.zeros(4, 8, 5))
        counts += torch.bincount(sched.state["sample_idx"].flatten(), minlength=8)
    assert counts.sum() == 100 * 4 * 4
    assert ((counts / 400 - 0.5).abs() < 0.1).all(), counts  # each position kept half the time (r / S)


def test_decoder_mask_is_its_leading_block():
    torch.manual_seed(4)
    B, S, R = 2, 8, 5
    layer = SeqMix()
    ltd, sched = wrapped(layer, R, model_mask_name="attention_mask")
    causal = torch.tril(torch.ones(S, S, dtype=torch.bool)).expand(B, 1, S, S)
    x = torch.randn(B, S, 5)
    out = ltd(x, attention_mask=causal)
    assert torch.equal(layer.masks[-1], causal[:, :, :R, :R])
    kept = sched.state["sample_idx"][0]
    torch.testing.assert_close(
        out, by_indexing(layer, x, kept, attention_mask=causal[:, :, :R, :R]), rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("shape", [(2, 1, 9, 9), (2, 1, 1, 9)])
def test_encoder_mask_keeps_each_samples_rows_and_columns(shape):
    torch.manual_seed(5)
    R = 4
    layer = SeqMix()
    ltd, sched = wrapped(layer, R, model_mask_name="attention_mask", model_type="encoder")
    mask = torch.rand(shape) > 0.3
    ltd(torch.randn(2, 9, 5), attention_mask=mask)
    kept = sched.state["sample_idx"][0]
    for b in range(2):
        rows = mask[b][:, kept[b]] if shape[2] > 1 else mask[b]
        assert torch.equal(layer.masks[-1][b], rows[:, :, kept[b]])


# -- the helpers --------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class Stack(nn.Module):
    def __init__(self, n=4):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))
        self.head = nn.Linear(4, 2)


def test_convert_wraps_every_layer_and_binding_takes_exactly_the_configured_ids():
    torch.manual_seed(6)
    model = Stack()
    plain_sd = model.state_dict()
    assert convert_to_random_ltd(model, Block) is model
    assert [type(m) for m in model.layers] == [RandomLayerTokenDrop] * 4 and isinstance(model.head, nn.Linear)
    convert_to_random_ltd(model, Block)  # a second call does not wrap the wrapped layers again
    assert all(isinstance(m.random_ltd_layer, Block) for m in model.layers)
    config = ltd_config(ids=(3, 1), total=4)
    sched = RandomLTDScheduler(config)
    bind_random_ltd_layers(model, config, sched)
    assert [m.random_ltd_scheduler is sched for m in model.layers] == [False, True, False, True]
    assert (model.layers[1].random_ltd_layer_id, model.layers[3].random_ltd_layer_id) == (0, 1)
    sd = remove_random_ltd_state_dict(model.state_dict())
    assert list(sd) == list(plain_sd) and all(torch.equal(sd[k], plain_sd[k]) for k in sd)
    assert list(save_without_random_ltd(model)) == list(plain_sd)
    with pytest.raises(ValueError, match=r"random_ltd_layer_num=2 but 1 .*not found: \[7\]"):
        bind_random_ltd_layers(model, ltd_config(ids=(1, 7), total=8), sched)


def test_ids_match_a_whole_name_component():
    holder = nn.Module()
    holder.gpt3 = Stack()  # DeepSpeed's substring test would bind id 3 to "gpt3.layers.0"
    convert_to_random_ltd(holder, Block)
    config = ltd_config(ids=(3,), total=4)
    bind_random_ltd_layers(holder, config, RandomLTDScheduler(config))
    assert [m.random_ltd_scheduler is not None for m in holder.gpt3.layers] == [False, False, False, True]


# -- the engine -----------------------------------------------------------------------------------------
RANDOM_LTD = {
    "enabled": True,
    "total_layer_num": 4,
    "random_ltd_layer_num": 2,
    "random_ltd_layer_id": [1, 2],
    "model_mask_name": None,
    "model_type": "decoder",
    "hidden_state_order": "batch_seq_dim",
    "random_ltd_schedule": {
        "min_value": 2,
        "max_value": 6,
        "schedule_type": "fixed_linear",
        "schedule_config": {"require_steps": 2, "seq_per_step": 2},
    },
}


def efficiency(random_ltd=RANDOM_LTD, **over):
    return {"enabled": True, "data_routing": {"enabled": True, "random_ltd": random_ltd}, **over}


class TokenModel(Stack):
    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def test_engine_api_moves_the_schedule_before_training_forwards_only():
    torch.manual_seed(7)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "data_efficiency": efficiency(),
    }
    engine, *_ = zerospeed.initialize(model=TokenModel(), config=config)
    assert engine.random_ltd_enabled() and engine.random_ltd_scheduler.get_current_seq() == 2
    assert engine.random_ltd_config()["global_batch_size"] == 4 and engine.random_ltd_config()["micro_batch_size"] == 2
    convert_to_random_ltd(engine, Block)
    bound = [m.random_ltd_scheduler is engine.random_ltd_scheduler for m in engine.module.layers]
    assert bound == [False, True, True, False]
    kept = []
    for _ in range(3 * 2):  # 3 steps of 2 micro-batches, sequences of 6 tokens
        engine.backward(engine(torch.randn(2, 6, 4)))
        engine.step()
        kept.append(engine.random_ltd_scheduler.get_current_seq())
    # step t: floor(2 + 4 t / 2) = 2 + 2t -> 2, 4, 6 (already multiples of 2)
    assert kept == [2, 2, 4, 4, 6, 6]
    assert engine.random_ltd_scheduler.state["consumed_layer_tokens"] == 4 * ((2 + 4 + 6) * 2 + 3 * 6 * 2)
    engine.eval()
    engine(torch.randn(2, 6, 4))
    assert engine.random_ltd_scheduler.state["current_steps"] == 2  # evaluation does not move it


def test_the_scheduler_resumes_from_the_checkpoint(tmp_path):
    """The checkpoint carries the scheduler's state (DeepSpeed's `random_ltd` entry of the model states);
    `module_state_dict()` gives the plain model's names."""
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "data_efficiency": efficiency(),
    }

    def engine():
        torch.manual_seed(8)
        e, *_ = zerospeed.initialize(model=TokenModel(), config=config)
        return convert_to_random_ltd(e, Block)

    first = engine()
    for _ in range(2):
        first.backward(first(torch.randn(2, 6, 4)))
        first.step()
    first.save_checkpoint(tmp_path)
    second = engine()
    assert second.random_ltd_scheduler.state_dict() != first.random_ltd_scheduler.state_dict()
    second.load_checkpoint(tmp_path)
    assert second.random_ltd_scheduler.state_dict() == first.random_ltd_scheduler.state_dict()
    assert list(second.module_state_dict()) == list(remove_random_ltd_state_dict(second.module.state_dict()))
    assert not any("random_ltd_layer" in k for k in second.module_state_dict())
    for a, b in zip(first.module.state_dict().values(), second.module.state_dict().values()):
        assert torch.equal(a, b)


def test_refusals_name_the_key():
    # (the data_sampling switches are built now: tests/unit/test_data_sampling.py)
    base = {"train_batch_size": 1}
    lr = {**RANDOM_LTD, "layer_token_lr_schedule": {"enabled": True}}
    with pytest.raises(ConfigError, match=r"random_ltd\.layer_token_lr_schedule\.enabled=true"):
        parse_config({**base, "data_efficiency": efficiency(lr)})
    with pytest.raises(
        ConfigError,
        match=r"random_ltd: enabled is true but model_type, random_ltd_schedule\."
        r"schedule_config\.seq_per_step are not set",
    ):
        parse_config(
            {
                **base,
                "data_efficiency": efficiency(
                    {
                        **RANDOM_LTD,
                        "model_type": None,
                        "random_ltd_schedule": {
                            **RANDOM_LTD["random_ltd_schedule"],
                            "schedule_config": {"require_steps": 2},
                        },
                    }
                ),
            }
        )
    with pytest.raises(ConfigError, match=r"random_ltd_layer_num \(3\) must equal the length of random_ltd_layer_id"):
        parse_config({**base, "data_efficiency": efficiency({**RANDOM_LTD, "random_ltd_layer_num": 3})})
    with pytest.raises(ConfigError, match=r"random_ltd\.random_ltd_schedule\.kind: unknown key"):
        parse_config(
            {
                **base,
                "data_efficiency": efficiency(
                    {**RANDOM_LTD, "random_ltd_schedule": {**RANDOM_LTD["random_ltd_schedule"], "kind": 1}}
                ),
            }
        )
    assert parse_config({**base, "data_efficiency": efficiency()}).data_efficiency.data_routing.random_ltd.enabled


def test_random_ltd_layers_need_the_config_and_the_pipeline_engine_refuses_it():
    engine, *_ = zerospeed.initialize(model=TokenModel(), config={"train_micro_batch_size_per_gpu": 1})
    assert not engine.random_ltd_enabled()
    with pytest.raises(ConfigError, match="random_ltd.enabled=true"):
        convert_to_random_ltd(engine, Block)
    from zerospeed.parallel.pipeline import PipelineModule

    module = PipelineModule([nn.Linear(2, 2)], num_stages=1, loss_fn=nn.MSELoss())
    with pytest.raises(ConfigError, match="random_ltd.enabled=true with a PipelineModule"):
        zerospeed.initialize(
            model=module, config={"train_micro_batch_size_per_gpu": 1, "data_efficiency": efficiency()}
        )
