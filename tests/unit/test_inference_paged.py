"""The paged-KV-cache server against transformers' own greedy `generate`, request by request.

A tiny Llama with grouped-query attention (4 query heads, 2 kv heads). Requests of mixed prompt and
output lengths join while others are decoding (continuous batching); a cache too small for all of them
at once forces preemption by recompute. Each request's tokens must equal `generate` on that prompt
alone. Block waste (allocated-but-empty KV slots over allocated slots, summed over steps) < 4%.
"""

from __future__ import annotations

import pytest
import torch

from zerospeed.inference.paged import PagedServer

V = 61
PROMPTS = (5, 40, 9, 70, 3, 25, 57, 14)
NEW = (60, 30, 81, 20, 48, 50, 33, 70)


def build_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=1,
    )
    return LlamaForCausalLM(cfg).eval()


def make_prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, V, (n,), generator=g).tolist() for n in PROMPTS]


def generate_each(model, prompts):
    """transformers' greedy `generate` on each prompt alone (on the model's device)."""
    out = []
    for p, n in zip(prompts, NEW):
        ids = model.generate(
            torch.tensor([p], device=model.device), max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out.append(ids[0, len(p) :].tolist())
    return out


@pytest.fixture(scope="module")
def model():
    return build_model()


@pytest.fixture(scope="module")
def prompts():
    return make_prompts()


@pytest.fixture(scope="module")
def reference(model, prompts):
    return generate_each(model, prompts)


def serve(model, prompts, num_blocks):
    server = PagedServer(model, block_size=4, num_blocks=num_blocks, max_batch_tokens=128)
    ids = [server.add_request(p, n) for p, n in zip(prompts[:3], NEW[:3])]
    streamed: dict[int, list[int]] = {}
    later = list(zip(prompts[3:], NEW[3:]))
    while server.has_unfinished():
        for event in server.step():
            streamed.setdefault(event.request_id, []).append(event.token)
        if later and server.steps % 6 == 0:  # a new request joins every 6 steps
            ids.append(server.add_request(*later.pop(0)))
    return server, ids, streamed


@pytest.mark.timeout(60)
def test_paged_server_matches_generate_with_requests_joining(model, prompts, reference):
    server, ids, streamed = serve(model, prompts, num_blocks=256)
    for i, rid in enumerate(ids):
        assert server.output(rid) == reference[i], f"request {i}"
        assert streamed[rid] == reference[i]
    assert server.scheduler.preemptions == 0
    assert server.kv_waste() < 0.04, f"KV block waste {server.kv_waste():.2%}"
    assert server.scheduler.allocator.num_free == 256  # every block came back


@pytest.mark.timeout(60)
def test_paged_server_preempts_and_recomputes(model, prompts, reference):
    server, ids, _ = serve(model, prompts, num_blocks=60)  # 240 slots for ~700 tokens of requests
    assert server.scheduler.preemptions > 0
    for i, rid in enumerate(ids):
        assert server.output(rid) == reference[i], f"request {i}"


def test_other_architectures_are_refused_by_name():
    from transformers import GPT2Config, GPT2LMHeadModel

    with pytest.raises(TypeError, match="the paged server runs Llama-family models .* GPT2LMHeadModel"):
        PagedServer(GPT2LMHeadModel(GPT2Config(vocab_size=11, n_embd=8, n_layer=1, n_head=2)))
