"""ZeRO-Inference: generation through `init_inference(zero={"stage": 3, "offload_param": ...})` on two ranks
(each holding half of every parameter, in CPU memory or in files on "NVMe"), token-identical to
transformers' own `generate` on the whole model, for a left-padded batch (also on one rank, where a
gather is a copy into a recycled buffer). The persistence threshold is 0,
so every module's weights really are gathered for each forward (and dropped after it)."""

from __future__ import annotations

import pytest
import torch

from harness import run_distributed

V, NEW, PAD = 61, 6, 0


def make():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=1,
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, PAD
    return model


def batch():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, V, (2, 6), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :2], mask[0, :2] = PAD, 0
    return ids, mask


def generate(model):
    ids, mask = batch()
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False)


def _served(nvme_dir):
    import zerospeed

    out = {}
    for device in ("cpu", "nvme"):
        offload = {"device": device, **({"nvme_path": nvme_dir} if device == "nvme" else {})}
        model = make()
        engine = zerospeed.init_inference(
            model,
            dtype=torch.float32,
            zero={"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0},
        )
        local = sum(p.numel() for p in model.parameters())  # this rank's shards outside a forward
        out[device] = (generate(engine), local)
    return out


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [2, 1])  # 1: Note [one-rank gathers] and [reused full buffers]
def test_zero_inference_matches_transformers(tmp_path, world):
    model = make()
    want, full = generate(model), sum(p.numel() for p in model.parameters())
    for rank, res in enumerate(run_distributed(_served, world, str(tmp_path), timeout=120)):
        for device, (tokens, local) in res.items():
            assert torch.equal(tokens, want), f"rank {rank} offload {device}:\n{tokens}\n!=\n{want}"
            assert local == 0, f"rank {rank} offload {device}: {local} of {full} parameter elements stay resident"
