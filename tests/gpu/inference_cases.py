"""What tests/gpu/test_gpu_inference.py runs in its spawned ranks: generation on this rank's device through
`init_inference` (tp = 1) and ZeRO-Inference (parameters in pinned host memory, or in swap files), against
transformers' own `generate` on the whole model on the same device (fp32, TF32 off). Device-agnostic,
like gpu_cases.py: on the CPU under gloo it is the CPU check of the same functions."""

from __future__ import annotations

import sys
from pathlib import Path

import gpu_cases as gc
import torch
from test_inference_zero import batch, make

# the unit tests' references (dense attention, the paged server's model and prompts) are imported from there
UNIT_TESTS = str(Path(__file__).resolve().parents[1] / "unit")
if UNIT_TESTS not in sys.path:
    sys.path.insert(0, UNIT_TESTS)

NEW = 8


def _generate(model, dev):
    ids, mask = batch()
    return model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=NEW, do_sample=False).cpu()


def served_ranks(nvme_dir: str) -> dict:
    """Greedy tokens and last-step logits of transformers on the device, and of each zerospeed route."""
    import zerospeed

    gc.exact_fp32()
    dev = gc.device()
    ref = make().to(dev)
    ids, mask = batch()
    out = {"want": _generate(ref, dev), "want_logits": ref(ids.to(dev), attention_mask=mask.to(dev)).logits.cpu()}
    routes = {
        "tp1": {"dtype": torch.float32},
        "zero_cpu": {
            "dtype": torch.float32,
            "zero": {
                "stage": 3,
                "offload_param": {"device": "cpu", "pin_memory": True},
                "stage3_param_persistence_threshold": 0,
            },
        },
        "zero_nvme": {
            "dtype": torch.float32,
            "zero": {
                "stage": 3,
                "offload_param": {"device": "nvme", "nvme_path": nvme_dir, "pin_memory": True},
                "stage3_param_persistence_threshold": 0,
            },
        },
    }
    for name, config in routes.items():
        model = make()
        engine = zerospeed.init_inference(model, config)
        logits = engine(ids.to(dev), attention_mask=mask.to(dev)).logits
        # where the weights live between forwards: the device (tp1) or the host (ZeRO: empty parameters)
        out[name] = {
            "tokens": _generate(engine, dev),
            "logits": logits.cpu(),
            "logits_device": logits.device.type,
            "resident": sum(p.numel() for p in model.parameters()),
            "param_devices": sorted({p.device.type for p in model.parameters()}),
        }
        if engine.zero_engine is not None:
            shards = [fp.shard for fp in engine.zero_engine.zero.flat if fp.swap is None]
            out[name]["shards"] = sorted({(s.device.type, s.is_pinned()) for s in shards})
    return out


# -- sparse attention's kernels on the device (ops.sparse_attention) -----------------------------------------


def sparse_attention_ranks(seq_len: int = 1024, block: int = 64) -> dict:
    """Fixed and BigBird layouts through `kernel="flex"` (compiled flex_attention, forward and backward)
    and `kernel="gather"` on this device, and the dense masked reference in float64 on the same inputs:
    the relative error of each output and of the q / k / v gradients."""
    import random

    from test_sparse_attention_kernel import dense_reference

    from zerospeed.ops.sparse_attention import BigBirdSparsityConfig, FixedSparsityConfig, block_sparse_attention

    gc.exact_fp32()
    dev, heads, dim = gc.device(), 4, 64
    random.seed(0)
    configs = {
        "fixed": FixedSparsityConfig(heads, block=block, num_local_blocks=4),
        "bigbird": BigBirdSparsityConfig(heads, block=block, num_random_blocks=2),
    }
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(2, heads, seq_len, dim, generator=gen) for _ in range(3)]
    weight = torch.randn(2, heads, seq_len, dim, generator=gen)
    out = {}
    for name, config in configs.items():
        layout = config.make_layout(seq_len)
        q, k, v = (t.double().requires_grad_() for t in base)
        ref = dense_reference(q, k, v, layout, block)
        want = [ref.detach(), *torch.autograd.grad((ref * weight.double()).sum(), (q, k, v))]
        for kernel in ("flex", "gather") if dev.type == "cuda" else ("gather",):  # (no flex backward on CPU)
            q, k, v = (t.to(dev).requires_grad_() for t in base)
            got = block_sparse_attention(q, k, v, layout.to(dev), block, kernel=kernel)
            got = [got.detach(), *torch.autograd.grad((got * weight.to(dev)).sum(), (q, k, v))]
            out[(name, kernel)] = [float((g.double().cpu() - w).norm() / w.norm()) for g, w in zip(got, want)]
    return out


def paged_ranks() -> dict:
    """The paged-KV-cache server on this rank's device (tests/unit/test_inference_paged.py's model, prompts
    and schedule: requests joining every 6 steps) and transformers' `generate` on each prompt alone there."""
    from test_inference_paged import build_model, generate_each, make_prompts, serve

    gc.exact_fp32()
    model = build_model().to(gc.device())
    prompts = make_prompts()
    want = generate_each(model, prompts)
    server, ids, streamed = serve(model, prompts, num_blocks=256)
    return {
        "want": want,
        "got": [server.output(rid) for rid in ids],
        "streamed": [streamed[rid] for rid in ids],
        "waste": server.kv_waste(),
        "cache_device": server.cache.keys[0].device.type,
    }
