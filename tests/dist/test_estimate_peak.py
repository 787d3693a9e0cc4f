"""The estimator's predicted peak (`zerospeed.estimate.peak`) against the measured peak of a real run.

Measured independently of zerospeed: the torch profiler's allocator events (`harness.
alloc_peak`: every allocation and free the CPU allocator makes, their running-sum maximum — what a
GPU's max_memory_allocated reports) over a steady training step (the first allocates Adam's
states). Two GPT sizes (one dominated by the blocks, one by the vocabulary head), ZeRO stages 0-3, with
and without activation checkpointing, at 2 and 4 ranks: one process launch per world size.
`overlap_comm` is off so that how many reduce-scatters gloo has in flight does not depend on thread
timing (with overlap the estimate is the bound of Note [bounded in-flight buckets]).

    python tests/dist/test_estimate_peak.py      # prints the predicted-vs-measured table
"""

import gc

import pytest
import torch

from harness import per_world, run_distributed

MIB = 1 << 20
SIZES = {  # name: (GPTConfig kwargs, micro batch, sequence length)
    "blocks": (dict(vocab_size=1024, block_size=64, n_layer=4, n_head=4, n_embd=256), 4, 64),
    "head": (dict(vocab_size=2048, block_size=128, n_layer=2, n_head=3, n_embd=192), 4, 128),
}
TOLERANCE = 0.10
# The measured peak is not repeatable to the byte on every rank: whether a finished collective's buffers
# (gloo's copy of a reduce-scatter's input, the bucket it sent) are freed by this thread after the wait or
# by gloo's worker thread (unrecorded, taken as freed when the call returned: Note [frees on other
# threads] in harness.alloc_peak) is a race, worth a bucket or two (1.5-3.5 MiB here, up to 10%
# on one rank). Each configuration is therefore held to 10% on its quietest rank and to 15% on every rank.
EVERY_RANK = 0.15


def _gpt(kw, ckpt):
    from zerospeed import checkpointing
    from zoo.models import GPT, GPTConfig

    class Checkpointed(torch.nn.Module):
        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x):
            return checkpointing.checkpoint(self.block, x)

    torch.manual_seed(0)
    model = GPT(GPTConfig(**kw))
    if ckpt:
        model.blocks = torch.nn.ModuleList(Checkpointed(b) for b in model.blocks)
    return model


def _measure(kw, micro_batch, seq, stage, ckpt, offload=False):
    """The steady step's peak bytes allocated: the smaller of the second and third steps' peaks (the
    first allocates Adam's states), so that a buffer gloo's worker thread happens to free late does
    not count as the step's unless it does so in both."""
    import zerospeed
    from harness.alloc_peak import AllocationTrace

    g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    with AllocationTrace(released=True) as trace:
        model = _gpt(kw, ckpt)
        cfg = {
            "train_micro_batch_size_per_gpu": micro_batch,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
            "zero_optimization": {"stage": stage, "overlap_comm": False},
        }
        if offload:
            cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        engine, *rest = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        del model, rest
        for step in range(3):
            x = torch.randint(0, kw["vocab_size"], (micro_batch, seq), generator=g)
            with trace.window(f"step{step}"):
                loss = engine(x, x)
                engine.backward(loss)
                engine.step()
            del loss
        del engine
    return {"peak": min(trace.peak("step1"), trace.peak("step2")), "start": trace.at_start("step1")}


def _predict(kw, micro_batch, seq, stage, ckpt, world, offload=False):
    from zerospeed.estimate.formulas import Option
    from zerospeed.estimate.layout import TransformerShape
    from zerospeed.estimate.peak import EngineKnobs, Workload, peak_terms, precision_for_peak

    shape = TransformerShape(kw["n_layer"], kw["n_embd"], kw["vocab_size"], kw["n_head"], positions=kw["block_size"])
    return peak_terms(
        shape,
        world,
        Option(stage, offload_optimizer=offload),
        precision_for_peak("fp32", "adamw"),
        Workload(micro_batch, seq, ckpt),
        EngineKnobs(overlap_comm=False, host_is_device=True),
    )


def _all_configs():
    world = torch.distributed.get_world_size()
    rows = []
    for name, (kw, mb, seq) in SIZES.items():
        # activation checkpointing's terms do not depend on the world size: measured at 2 ranks only
        for ckpt in (False, True) if world == 2 else (False,):
            for stage in (0, 1, 2, 3):
                m = _measure(kw, mb, seq, stage, ckpt)
                rows.append(dict(size=name, stage=stage, ckpt=ckpt, world=world, **m))
    return rows


def _offload_configs():
    """CPU optimizer offload at stages 1-3, both sizes: on this CPU-only machine the host is the device
    (Note [peak: offload on a CPU-only machine])."""
    world = torch.distributed.get_world_size()
    return [
        dict(
            size=name,
            stage=stage,
            ckpt=False,
            world=world,
            offload=True,
            **_measure(kw, mb, seq, stage, False, offload=True),
        )
        for name, (kw, mb, seq) in SIZES.items()
        for stage in (1, 2, 3)
    ]


def _table(per_rank):
    out = []
    for rows in zip(*per_rank):
        r0 = rows[0]
        kw, mb, seq = SIZES[r0["size"]]
        p = _predict(kw, mb, seq, r0["stage"], r0["ckpt"], r0["world"], r0.get("offload", False))
        out.append(dict(r0, measured=[r["peak"] for r in rows], predicted=p.total, phase=p.phase, dominant=p.dominant))
    return out


def _check(out):
    def off(r, m):
        return abs(r["predicted"] - m) / m

    bad = [
        r
        for r in out
        if min(off(r, m) for m in r["measured"]) > TOLERANCE or max(off(r, m) for m in r["measured"]) > EVERY_RANK
    ]
    assert not bad, "\n".join(_format(bad))


def _format(out):
    lines = [
        "| ranks | model | ckpt | stage | predicted MiB | measured MiB (per rank) | predicted/measured | "
        "peak phase | dominant |",
        "|---:|---|---|---:|---:|---:|---:|---|---|",
    ]
    for r in out:
        ms = r["measured"]
        lines.append(
            f"| {r['world']} | {r['size']} | {'yes' if r['ckpt'] else 'no'} | "
            f"{r['stage']}{' (offload)' if r.get('offload') else ''} | "
            f"{r['predicted'] / MIB:.1f} | {', '.join(f'{m / MIB:.1f}' for m in ms)} | "
            f"{min(r['predicted'] / m for m in ms):.3f}-{max(r['predicted'] / m for m in ms):.3f} | "
            f"{r['phase']} | {r['dominant']} |"
        )
    return lines


@pytest.fixture(scope="module")
def measured():
    """world -> the predicted-vs-measured table, one process launch per world size when first needed."""
    return per_world(_all_configs, timeout=280, then=_table)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_predicted_peak_within_10_percent(world, measured):
    _check(measured(world))


@pytest.mark.timeout(300)
def test_predicted_peak_with_cpu_optimizer_offload_within_10_percent():
    _check(_table(run_distributed(_offload_configs, 2, timeout=280)))


@pytest.mark.timeout(300)
def test_memory_budget_stage3_fits_stage0_does_not(measured):
    """A budget just above the predicted stage-3 peak (blocks model, 2 ranks) — by the estimator's own
    tolerance, as a user sizing a device by it would leave: stage 3 trains within it; the estimator says
    stage 0 would not fit, and its run indeed exceeds the budget. Held like every configuration above
    (EVERY_RANK): the quietest rank within the budget, every rank within the 15% that the race of
    Note [frees on other threads] leaves."""
    rows = {r["stage"]: r for r in measured(2) if r["size"] == "blocks" and not r["ckpt"]}
    budget = (1 + TOLERANCE) * rows[3]["predicted"]
    assert min(rows[3]["measured"]) <= budget, (budget, rows[3])  # stage 3 trains within the budget
    assert max(rows[3]["measured"]) <= (1 + EVERY_RANK) * rows[3]["predicted"], rows[3]
    assert rows[0]["predicted"] > budget, (budget, rows[0])  # the estimator says stage 0 would not fit
    assert min(rows[0]["measured"]) > budget, (budget, rows[0])  # and indeed it exceeds the budget


# transformers' GPT-2 in bf16: its loss upcasts the logits to fp32 (Workload.loss_upcast); a vocabulary
# large enough for the head to set the peak, so the upcast's terms are what is checked
HF_GPT2 = dict(n_layer=2, n_embd=256, n_head=4, vocab_size=8192, n_positions=128)
HF_STAGES = (0, 3)  # the two ends (bf16 on a CPU is slow); stages 1 and 2 run in fp32 above


def _measure_hf_bf16():
    """Per stage of HF_STAGES: the steady step's allocator peak of transformers' GPT-2 trained in bf16."""
    import transformers

    import zerospeed
    from harness.alloc_peak import AllocationTrace

    out = {}
    for stage in HF_STAGES:
        gc.collect()  # the previous stage's engine and model: freed before this trace, not inside it
        g = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
        with AllocationTrace(released=True) as trace:
            torch.manual_seed(0)
            model = transformers.GPT2LMHeadModel(
                transformers.GPT2Config(
                    **HF_GPT2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0
                )
            )
            cfg = {
                "train_micro_batch_size_per_gpu": 4,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
                "bf16": {"enabled": True},
                "zero_optimization": {"stage": stage, "overlap_comm": False},
            }
            engine, *_ = zerospeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
            del model
            for step in range(3):
                x = torch.randint(0, HF_GPT2["vocab_size"], (4, 128), generator=g)
                with trace.window(f"step{step}"):
                    loss = engine(input_ids=x, labels=x).loss
                    engine.backward(loss)
                    engine.step()
                del loss
            del engine, _  # the optimizer too: it holds the shards and Adam's states
        out[stage] = min(trace.peak("step1"), trace.peak("step2"))
    return out


@pytest.mark.timeout(300)
def test_bf16_transformers_peak_within_10_percent():
    from zerospeed.estimate.census import census_of_config
    from zerospeed.estimate.formulas import Option
    from zerospeed.estimate.peak import EngineKnobs, Workload, peak_terms, precision_for_peak

    shape = census_of_config(HF_GPT2).shape
    ranks = run_distributed(_measure_hf_bf16, 2, timeout=280)
    bad = []
    for stage in HF_STAGES:
        p = peak_terms(
            shape,
            2,
            Option(stage),
            precision_for_peak("bf16", "adamw"),
            Workload(4, 128, act_bytes=2, mlp_activation="gelu_new", loss_upcast=True),
            EngineKnobs(overlap_comm=False),
        ).total
        off = [abs(p - r[stage]) / r[stage] for r in ranks]
        if min(off) > TOLERANCE or max(off) > EVERY_RANK:
            bad.append((stage, p / MIB, [r[stage] / MIB for r in ranks]))
    assert not bad, bad  # (stage, predicted MiB, measured MiB per rank)


if __name__ == "__main__":
    import sys
    import time

    for world in (int(w) for w in (sys.argv[1:] or ["2", "4"])):
        t = time.time()
        out = _table(run_distributed(_all_configs, world, timeout=600))
        if world == 2:
            out += _table(run_distributed(_offload_configs, world, timeout=600))
        print("\n".join(_format(out)), f"\n({time.time() - t:.1f} s)", flush=True)
