"""AutoTP on transformers models against the same model in one plain PyTorch process.

GPT-2 (fused c_attn Conv1D, tied embedding/head, preset rules), Llama with grouped-query
attention where tp > num_key_value_heads (the kv heads are replicated, not left idle; rules from the
model's own base_model_tp_plan at tp=2, from a DeepSpeed-style partition_config at tp=4), and Qwen2
(biased q/k/v, tied embeddings, 1 kv head at tp=2). Every rank
starts from the same full model (same seed), shards it in place, trains 10 Adam steps with plain
torch.optim on its shards through `model(ids, labels=ids).loss` (vocab-parallel loss), and the
gathered weights must equal the reference's. Vocabulary 37 splits unevenly.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zerospeed import comm
from zerospeed.comm.mesh import ParallelMesh

V, B, T, STEPS = 37, 2, 8, 10

LLAMA_SPECS = {
    "use_default_specs": False,
    "layer_specs": [
        {"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"], "partition_type": "row"},
        {"patterns": [r".*\.[qkv]_proj\.weight$", r".*\.(gate|up)_proj\.weight$"], "partition_type": "column"},
    ],
}


def make(arch: str, kv_heads: int = 1):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

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
        cls = GPT2LMHeadModel
    elif arch == "qwen2":  # biased q/k/v projections, tied embeddings
        cfg = Qwen2Config(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            max_position_embeddings=T,
            tie_word_embeddings=True,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = Qwen2ForCausalLM
    else:
        cfg = LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            max_position_embeddings=T,
            bos_token_id=0,
            eos_token_id=0,
        )
        cls = LlamaForCausalLM
    cfg._attn_implementation = "eager"
    return cls(cfg)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (B, T), generator=g) for _ in range(STEPS)]


def train(model, group=None, sharded: bool = False):
    """(losses, state_dict) for the reference; a dict of results for a sharded model (group None = world)."""
    from zerospeed.parallel.tensor import full_state_dict
    from zerospeed.parallel.tensor.volume import model_step_bytes

    # Note: the key bias has an analytic gradient of zero (softmax ignores a constant shift), so its computed
    # gradient is rounding noise that differs between layouts; Adam's default eps (1e-8) would turn that
    # noise into full-size steps. eps = 1e-4 keeps such steps negligible and real ones Adam-like.
    opt = torch.optim.Adam(model.parameters(), lr=1e-2, eps=1e-4)
    losses, comm_bytes, logits_shape = [], None, None
    for step, ids in enumerate(_batches()):
        opt.zero_grad()
        comm.STATS.reset()
        out = model(ids, labels=ids)
        out.loss.backward()
        if step == 0:
            comm_bytes = {k: v["payload_bytes"] for k, v in comm.STATS.snapshot().items()}
            logits_shape = tuple(out.logits.shape)
        opt.step()
        losses.append(out.loss.item())
    if not sharded:
        return losses, model.state_dict()
    return {
        "losses": losses,
        "weights": full_state_dict(model, group),
        "comm": comm_bytes,
        "analytic": model_step_bytes(model, B * T, loss_tokens=B * T),
        "logits": logits_shape,
    }


def _all_cases(cases):
    from zerospeed.parallel.tensor import shard_model

    tp = comm.get_world_size()
    group = ParallelMesh.build(tp=tp).group("tp")
    out = {}
    for arch, kv, specs in cases:
        model = make(arch, kv)
        report = shard_model(model, group, partition_config=specs)
        local = sum(p.numel() for p in model.parameters())  # before training: a tied weight counted once
        out[(arch, kv)] = {**train(model, group, sharded=True), "report": report, "local_numel": local}
    return out


# (arch, kv heads, partition_config); the tp=4 case runs in test_tp_four_ranks.py, in one spawn with the
# Megatron GPT's (four processes on two cores are the expensive part).
CASES = {2: [("gpt2", 1, None), ("llama", 1, None), ("qwen2", 1, None)], 4: [("llama", 2, LLAMA_SPECS)]}


@pytest.fixture(scope="module")
def runs():
    return {2: run_distributed(_all_cases, 2, CASES[2], timeout=120)}


TP2 = [(2, a, k) for a, k, _ in CASES[2]]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tp,arch,kv", TP2)
def test_autotp_matches_plain_pytorch(runs, tp, arch, kv):
    check_parity(runs[tp], tp, arch, kv)


def check_parity(results, tp, arch, kv):
    ref_losses, ref_sd = train(make(arch, kv))
    for rank, res in enumerate(results):
        r = res[(arch, kv)]
        gap = max(abs(a - b) for a, b in zip(r["losses"], ref_losses, strict=True))
        assert gap <= 1e-5, f"{arch} tp={tp} rank {rank}: max |dloss| {gap:.2e}"
        for name, want in ref_sd.items():
            torch.testing.assert_close(r["weights"][name], want, rtol=1e-5, atol=1e-5, msg=f"{arch} tp={tp} {name}")
        vocab_local = V // tp + (1 if rank < V % tp else 0)
        assert r["logits"] == (B, T, vocab_local)  # the logits stay vocabulary-sharded


@pytest.mark.timeout(200)
def test_autotp_shards_what_it_should(runs):
    gpt2 = runs[2][0][("gpt2", 1)]["report"]
    assert gpt2.layers["lm_head"] == "vocab (tied)" and gpt2.layers["transformer.wte"] == "vocab"
    assert gpt2.attention["transformer.h.0.attn"] == {"num_heads": 2, "split_size": 8, "embed_dim": 8}
    llama2 = runs[2][0][("llama", 1)]["report"]
    assert llama2.attention["model.layers.0.self_attn"] == {"num_key_value_groups": 2}  # 2 q heads on 1 kv head
    assert llama2.layers["model.layers.1.mlp.down_proj"] == "row"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tp,arch,kv", TP2)
def test_autotp_comm_bytes_equal_the_formula(runs, tp, arch, kv):
    check_comm_bytes(runs[tp], tp, arch, kv)


def check_comm_bytes(results, tp, arch, kv):
    tokens, D, layers, head_dim = B * T, 16, 2, 4
    if arch == "gpt2":  # per layer: bwd before c_attn and c_fc, fwd after both c_proj; + wte fwd + tied head bwd
        want = (4 * layers + 2) * tokens * D * 4
    else:  # per layer: bwd before q, k, v, gate, up; fwd after o, down; + embedding + head
        want = (7 * layers + 2) * tokens * D * 4
        # + the replicated kv heads' weight gradients (k and v), summed over their replicas: one slot per kv head
        bias = head_dim if arch == "qwen2" else 0
        want += layers * 2 * kv * (head_dim * D + bias) * 4
    want += 3 * tokens * 4  # the vocab-parallel loss
    for res in results:
        r = res[(arch, kv)]
        assert r["comm"] == {"all_reduce": want}, (r["comm"], want)
        assert r["analytic"] == {"all_reduce": want}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("tp,arch,kv", TP2)
def test_each_rank_holds_its_share_of_the_parameters(runs, tp, arch, kv):
    check_parameter_share(runs[tp], tp, arch, kv)


def check_parameter_share(results, tp, arch, kv):
    """Summed over the tp ranks, the local parameters are the full model's sharded ones once, its
    replicated ones (norms, row biases, positions) tp times and the GQA kv heads tp / kv times."""
    full = dict(make(arch, kv).named_parameters())
    replicated = ("ln_", "norm", "wpe", "c_proj.bias")
    want = 0
    for name, p in full.items():
        if any(key in name for key in replicated):
            want += tp * p.numel()
        elif name.rsplit(".", 2)[-2] in ("k_proj", "v_proj") and tp > kv:
            want += (tp // kv) * p.numel()
        else:
            want += p.numel()
    assert sum(res[(arch, kv)]["local_numel"] for res in results) == want
