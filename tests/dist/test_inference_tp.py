"""Tensor-parallel inference through `zerospeed.init_inference` against transformers' own `generate`.

GPT-2 (fused c_attn, tied head), a Llama with grouped-query attention (4 query heads, 2 kv heads: at
tp=4 each kv head is replicated on two ranks) and a Qwen2 (biased q/k/v, tied head, 1 kv head) are
sharded by AutoTP at tp = 1, 2 and 4 (vocabulary 37, split unevenly). A left-padded batch of prompts of
lengths 3, 5 and 7 is generated greedily (fp32, KV cache on) and must be token-identical to the
unsharded model's `generate`; the full logits of the padded batch (and the loss computed on them) must
agree within 1e-5. GPT-2 is also
sharded by a DeepSpeed `injection_policy` (manual TP) over a given `tp_group`. The Llama run sets
`replace_with_kernel_inject` (accepted, no kernels), runs beam search (3 beams, must equal
transformers') and samples (top-k, temperature 2: the tp ranks must draw the same tokens). The sharded
Llama and Qwen2 also serve four requests through the paged-KV-cache server, one joining every two steps
(continuous batching): each request's tokens must equal the unsharded model's `generate` on that prompt
alone. Every rank returns its own result: the tp ranks must agree too.
"""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed
from zoo.data import left_padded_prompts

V, NEW, PAD = 37, 6, 0
LENGTHS = (3, 5, 7)


def make(arch: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = GPT2Config(
            vocab_size=V,
            n_positions=32,
            n_embd=16,
            n_layer=2,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = GPT2LMHeadModel(cfg)
    elif arch == "qwen2":  # biased q/k/v, tied embeddings, 1 kv head
        cfg = Qwen2Config(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=1,
            max_position_embeddings=32,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = Qwen2ForCausalLM(cfg)
    else:
        cfg = LlamaConfig(
            vocab_size=V,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=32,
            bos_token_id=1,
            eos_token_id=1,
        )
        model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = None  # generate every row to full length
    model.generation_config.pad_token_id = PAD
    return model.eval()


def batch():
    """Left-padded prompts of different lengths: (input_ids [3, 7], attention_mask)."""
    return left_padded_prompts(LENGTHS, V, PAD, seed=3)


def run(model, ids, mask):
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=ids)
    tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)
    return torch.cat([out.logits.flatten(), out.loss.reshape(1)]), tokens  # the loss: on the full logits


def beams(model):
    ids, mask = batch()
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=3, do_sample=False)


PAGED_PROMPTS, PAGED_NEW = (6, 2, 9, 4), (7, 10, 5, 8)


def paged_prompts():
    g = torch.Generator().manual_seed(11)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in PAGED_PROMPTS]


def paged_reference(model):
    out = []
    for prompt, new in zip(paged_prompts(), PAGED_NEW, strict=True):
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
        out.append(ids[0, len(prompt) :].tolist())
    return out


def paged(engine):
    """The paged server over `engine`: two requests at first, then one more every two steps."""
    from zerospeed.inference.paged import PagedServer

    server = PagedServer(engine, block_size=4, num_blocks=16)
    waiting = list(zip(paged_prompts(), PAGED_NEW, strict=True))
    ids = [server.add_request(*waiting.pop(0)) for _ in range(2)]
    while server.has_unfinished():
        server.step()
        if waiting and server.steps % 2 == 0:
            ids.append(server.add_request(*waiting.pop(0)))
    return [server.output(rid) for rid in ids], server.cache.keys[0].shape[1]


def _served(archs):
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    import zerospeed
    from zerospeed import comm

    out = {}
    for arch in archs:
        extra = {}
        if arch == "gpt2-policy":  # DeepSpeed's manual TP: the row-parallel layers of each block, by class
            extra = {"injection_policy": {GPT2Block: ("attn.c_proj", "mlp.c_proj")}}
        if arch == "llama":  # accepted; there are no kernels to inject, AutoTP shards the model
            extra = {"replace_with_kernel_inject": True}
        model = make(arch.split("-")[0])
        torch.manual_seed(100 + comm.get_rank())  # the ranks' random streams differ until init_inference
        tp = {"tp_size": comm.get_world_size()}
        if arch == "gpt2-policy":  # an existing group, as DeepSpeed's tensor_parallel.tp_group
            tp = {"tp_group": comm.ParallelMesh.build(tp=comm.get_world_size()).group("tp")}
        engine = zerospeed.init_inference(model, tensor_parallel=tp, dtype=torch.float32, **extra)
        layers = engine.shard_report.layers if engine.shard_report else {}
        layouts = [layers.get(f"transformer.h.0.{n}") for n in ("attn.c_attn", "attn.c_proj")]
        out[arch] = (*run(engine, *batch()), layouts)
        if arch in ("llama", "qwen2"):
            out[f"paged {arch}"] = paged(engine)
        if arch == "llama":  # beam search reorders the (head-sharded) cache; Note [tp sampling]: same draws
            out["beams"] = beams(engine)
            out["sampled"] = engine.generate(
                *batch()[:1], attention_mask=batch()[1], max_new_tokens=NEW, do_sample=True, top_k=10, temperature=2.0
            )
    return out


ARCHS = ("gpt2", "llama", "qwen2", "gpt2-policy")


@pytest.fixture(scope="module")
def reference():
    return {
        **{arch: run(make(arch.split("-")[0]), *batch()) for arch in ARCHS},
        "beams": beams(make("llama")),
        **{f"paged {arch}": paged_reference(make(arch)) for arch in ("llama", "qwen2")},
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_generation_matches_transformers(reference, tp):
    results = [_served(ARCHS)] if tp == 1 else run_distributed(_served, tp, ARCHS, timeout=120)
    for rank, res in enumerate(results):
        for arch in ARCHS:
            want_logits, want_tokens = reference[arch]
            logits, tokens, layouts = res[arch]
            if arch.startswith("gpt2") and tp > 1:
                assert layouts == ["column", "row"], f"{arch} tp={tp}: {layouts}"
            assert logits.shape == want_logits.shape, f"{arch} tp={tp} rank {rank}: logits not full"  # [B*T*V + 1]
            gap = (logits - want_logits).abs().max().item()
            assert gap <= 1e-5, f"{arch} tp={tp} rank {rank}: max |dlogit| {gap:.2e}"
            assert torch.equal(tokens, want_tokens), f"{arch} tp={tp} rank {rank}:\n{tokens}\n!=\n{want_tokens}"
        for arch, kv_heads in (("llama", 2), ("qwen2", 1)):  # the rank's own kv heads (replicated past kv_heads)
            served, cached_heads = res[f"paged {arch}"]
            assert served == reference[f"paged {arch}"], f"paged {arch} tp={tp} rank {rank}"
            assert cached_heads == max(1, kv_heads // tp), f"paged {arch} tp={tp}: caches {cached_heads} kv heads"
        assert torch.equal(res["sampled"], results[0]["sampled"]), f"tp={tp}: rank {rank} sampled other tokens"
        assert torch.equal(res["beams"], reference["beams"]), f"tp={tp} rank {rank}: beam search differs"
