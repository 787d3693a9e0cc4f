"""The estimator and the flops profiler under tensor parallelism, against real tp = 2 shards.

One spawn of two gloo ranks shards a tiny transformers GPT-2 (fused c_attn, tied head, biases) and a
Llama (gated MLP, GQA with 1 kv head: replicated on both ranks, untied head) with AutoTP, then:

- memory: the bytes of the distinct storages behind each rank's parameters equal the estimator's
  per-rank parameter bytes (`layout.stage_params` at tp 2; vocabulary 37 splits 19 / 18, so rank 1 holds
  one row less of each vocabulary-parallel matrix), and the model's total is the one-process count;
- flops: every column- and row-parallel layer's MACs on each rank are the one-process layer's / 2, and
  the model totals (`get_model_*`, one all-reduce over the tp group) equal the one-process profile,
  except the vocabulary-parallel embedding's id shift (B*T FLOPs, counted once: it reads replicated ids);
- the engine's flops profiler (`"tensor_parallel": {"autotp_size": 2}`, `flops_profiler` on) profiles
  on both ranks and rank 0 writes the per-rank and whole-model numbers.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh
from zerospeed.estimate import Precision, census_of_config, stage_bytes
from zerospeed.estimate.layout import stage_params
from zerospeed.profiling import FlopsProfiler

pytest.importorskip("transformers")

V, B, T, H = 37, 2, 8, 16


def make(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=V,
            n_positions=T,
            n_embd=16,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = GPT2LMHeadModel(cfg)
    else:
        cfg = LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=T,
            bos_token_id=0,
            eos_token_id=0,
        )
        model = LlamaForCausalLM(cfg)
    model.config._attn_implementation = "eager"
    return model.eval()


def ids():
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(1))


def profile(model, group=None):
    """(per-layer MACs of the sharded layers by name, per-rank totals, model totals)."""
    prof = FlopsProfiler(model, tp_group=group)
    with torch.no_grad():
        prof.start_profile()
        model(ids())
        prof.stop_profile()
    by_name = {s.name: s.macs for s in prof.module_stats()}
    return by_name, (prof.get_total_flops(), prof.get_total_macs()), prof.model_totals()


def parameter_storage_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters (a census, not the shapes)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def _sharded(archs):
    from zerospeed.parallel.tensor import ColumnParallelLinear, RowParallelLinear, shard_model

    group = ParallelMesh.build(tp=comm.get_world_size()).group("tp")
    out = {}
    for arch in archs:
        model = make(arch)
        shard_model(model, group)
        layers = [n for n, m in model.named_modules() if isinstance(m, (ColumnParallelLinear, RowParallelLinear))]
        macs, local, totals = profile(model, group)
        out[arch] = {
            "param_bytes": parameter_storage_bytes(model),
            "layers": layers,
            "macs": macs,
            "local": local,
            "totals": totals,
            "local_params": sum(p.numel() for p in model.parameters()),
        }
    return out


ARCHS = ("gpt2", "llama")


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    path = tmp_path_factory.mktemp("profile") / "flops.txt"
    results = run_distributed(_sharded_and_engine, 2, ARCHS, str(path), timeout=150)
    results[0]["engine_report"] = path.read_text()
    return results


@pytest.mark.timeout(200)
@pytest.mark.parametrize("arch", ARCHS)
def test_per_rank_parameter_bytes_match_a_census_of_the_shards(ranks, arch):
    model = make(arch)
    census = census_of_config(model.config.to_dict())
    assert census.total_params == sum(p.numel() for p in model.parameters())
    fp32 = Precision.of("fp32", "sgd")
    predicted = stage_bytes(stage_params(census.shape, tp=2)[0], 1, 0, fp32)["parameters"]
    vocab_matrices = 1 if model.config.tie_word_embeddings else 2  # rank 1: one vocabulary row fewer each
    hidden = census.hidden
    assert ranks[0][arch]["param_bytes"] == predicted
    assert ranks[1][arch]["param_bytes"] == predicted - 4 * vocab_matrices * hidden
    assert ranks[0][arch]["totals"][2] == census.total_params  # model params: shards summed, replicas once


@pytest.mark.timeout(200)
@pytest.mark.parametrize("arch", ARCHS)
def test_profiler_per_rank_and_model_flops(ranks, arch):
    ref_macs, (ref_flops, ref_total_macs), _ = profile(make(arch))
    for rank, res in enumerate(ranks):
        r = res[arch]
        assert r["layers"], "AutoTP sharded nothing"
        for name in r["layers"]:
            if name.endswith("lm_head"):  # the vocabulary splits 19 / 18
                want = B * T * H * (19 if rank == 0 else 18)
            elif arch == "llama" and name.endswith(("k_proj", "v_proj")):  # 1 kv head, on both ranks
                want = ref_macs[name]
            else:
                want = ref_macs[name] // 2
            assert r["macs"][name] == want, f"{arch} rank {rank} {name}"
        flops, macs, params = r["totals"]
        assert macs == ref_total_macs, f"{arch} rank {rank}"
        assert flops == ref_flops + B * T  # + the embedding's id shift (ids - vocab_start), once
        assert r["local"][1] < ref_total_macs and params > r["local_params"]


def _engine_profile(path: str) -> str:
    import zerospeed

    config = {
        "train_micro_batch_size_per_gpu": B,
        "tensor_parallel": {"autotp_size": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
        "flops_profiler": {"enabled": True, "profile_step": 1, "detailed": False, "output_file": path},
    }
    engine, *_ = zerospeed.initialize(model=make("gpt2").train(), config=config)
    for _ in range(2):
        loss = engine(ids(), labels=ids()).loss
        engine.backward(loss)
        engine.step()
    return engine.global_rank


def _sharded_and_engine(archs, path):
    out = _sharded(archs)
    _engine_profile(path)
    return out


@pytest.mark.timeout(200)
def test_engine_flops_profiler_reports_per_rank_and_model(ranks):
    from zerospeed.profiling.report import human

    text = ranks[0]["engine_report"]
    _, (_, ref_macs), _ = profile(make("gpt2"))  # the loss adds FLOPs but no MACs
    assert "tensor-parallel size:          2" in text
    assert f"forward MACs of model:         {human(ref_macs)}MACs" in text
    total = census_of_config(make("gpt2").config.to_dict()).total_params
    assert f"params of model:               {human(total)}" in text
    assert "forward FLOPs per rank:" in text and "params per rank:               3.84 K" in text
