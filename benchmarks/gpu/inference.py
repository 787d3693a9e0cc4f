"""Inference on one GPU: transformers `generate` vs `zerospeed.init_inference` (tp = 1), and ZeRO-Inference's
per-token time against the time to read the model once from where it lives (pinned host memory over PCIe).

    python benchmarks/gpu/inference.py [--layers 24 --width 2048 --prompt 128 --new 128 --zero-new 32]
    python benchmarks/gpu/inference.py --smoke      # a tiny model on whatever device there is (a check)

One process, one GPU. Model: a transformers Llama built from a config (GQA, untied head, sdpa), bf16,
random weights, prompts of `--prompt` random tokens, greedy, KV cache on, exactly `--new` tokens (no EOS).

- transformers vs init_inference: the same weights on the GPU, timed alternately in this process
  (`--repeats` each, median, after one full-length warm-up run each); per-token ms =
  (total - first token) / (new - 1).
- ZeRO-Inference: stage 3 with `offload_param: cpu` (pinned) and persistence threshold 0, so every
  weight crosses PCIe for every token; variants: each Linear its own unit (the default), each decoder
  layer one unit (`leaf_module`), and the Linears' stored shards int8 / int4 (group 64). "read once" is
  the median time of one host-to-device copy of the stored bytes from pinned memory (CUDA events): the
  floor for a token that must read the model. The ratio per-token / read-once is what #17 asks for.
- `nvme` (not in the default variants): `offload_param: nvme` under `--nvme-path`; its "read once" is one
  O_DIRECT read of the swap files into pinned memory with the engine's own reader.
- tokens: whether each variant generated exactly transformers' tokens (bf16; the quantized ones are
  expected to differ).
"""

from __future__ import annotations

import argparse
import copy
import gc
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from workers import nvme_read_once_ms  # noqa: E402  (benchmarks/workers.py)


def _model(args, device):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new,
        attn_implementation="sdpa",
        tie_word_embeddings=False,
    )
    with torch.device(device):
        model = LlamaForCausalLM(cfg)
    model = model.to(torch.bfloat16).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _time(fn) -> tuple[float, object]:
    """(seconds, result) of `fn()`, the device synchronised on both sides."""
    _sync()
    start = time.perf_counter()
    out = fn()
    _sync()
    return time.perf_counter() - start, out


def _gen(model, ids, n):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=n, do_sample=False)


def _per_token(models: dict, ids, new: int, repeats: int) -> dict:
    """Each model's first-token and total time (medians, runs alternating between the models)."""
    first = {k: [] for k in models}
    total = {k: [] for k in models}
    tokens = {}
    for m in models.values():  # warm-up over every length the timed runs reach: kernels and their
        _gen(m, ids, new)  # heuristics are picked per shape (one such run made transformers 3x slower)
    for _ in range(repeats):
        for name, m in models.items():
            first[name].append(_time(lambda: _gen(m, ids, 1))[0])
            seconds, out = _time(lambda: _gen(m, ids, new))
            total[name].append(seconds)
            tokens[name] = out.cpu()
    out = {}
    for name in models:
        f, t = statistics.median(first[name]), statistics.median(total[name])
        out[name] = {
            "first_s": f,
            "total_s": t,
            "tok_s": ids.shape[0] * new / t,
            "per_token_ms": 1e3 * (t - f) / max(1, new - 1),
            "tokens": tokens[name],
        }
    return out


def read_once_ms(nbytes: int, pinned: bool = True) -> float:
    """Median time of one host-to-device copy of `nbytes` (from pinned memory unless told otherwise)."""
    if not torch.cuda.is_available():
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        return 1e3 * statistics.median(_time(lambda: dst.copy_(src))[0] for _ in range(5))
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(6):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=pinned)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[1:])


def _zero_engine(args, base, variant: str, device):
    import zerospeed

    offload = (
        {"device": "nvme", "nvme_path": args.nvme_path, "pin_memory": True}
        if variant == "nvme"
        else {"device": "cpu", "pin_memory": True}
    )
    zero = {"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0}
    config = {"dtype": torch.bfloat16, "zero": zero}
    if variant == "leaf":
        zero["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
    if variant in ("int8", "int4"):
        config["quant"] = {"weight": {"quantized_initialization": {"num_bits": int(variant[3:]), "group_size": 64}}}
    model = copy.deepcopy(base)
    engine = zerospeed.init_inference(model, config)
    stored = engine.zero_engine.zero.memory_breakdown(None)["parameters"]
    return engine, stored


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=5504)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--zero-new", type=int, default=32, help="tokens generated in the ZeRO-Inference runs")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--zero-variants",
        default="units,leaf,int8,int4",
        help="of units, leaf, int8, int4 (offload_param cpu) and nvme (offload_param nvme, --nvme-path)",
    )
    p.add_argument("--nvme-path", default="/tmp/zerospeed_nvme_inference")
    p.add_argument("--smoke", action="store_true", help="a tiny model on whatever device there is")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.width, args.ffn, args.heads, args.kv_heads, args.vocab = 2, 64, 128, 4, 2, 256
        args.prompt, args.new, args.zero_new, args.repeats = 8, 6, 4, 1
    elif not torch.cuda.is_available():
        sys.exit("benchmarks/gpu/inference.py needs a CUDA device (or --smoke)")
    os.environ.update(
        {
            "RANK": "0",
            "LOCAL_RANK": "0",
            "WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": os.environ.get("MASTER_PORT", "29544"),
        }
    )
    import zerospeed

    zerospeed.init_distributed()
    if "nvme" in args.zero_variants.split(","):
        os.makedirs(args.nvme_path, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = _model(args, device)
    model_bytes = sum(t.numel() * t.element_size() for t in base.parameters())
    rows, zero_rows = [], []
    for batch in args.batches:
        ids = torch.randint(2, args.vocab, (batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
        served = zerospeed.init_inference(copy.deepcopy(base), {"dtype": torch.bfloat16})
        res = _per_token({"transformers": base, "init_inference": served}, ids, args.new, args.repeats)
        same = torch.equal(res["init_inference"]["tokens"], res["transformers"]["tokens"])
        rows.append((batch, res, same))
        print(
            f"[inference] batch {batch}: {res['transformers']['per_token_ms']:.2f} vs "
            f"{res['init_inference']['per_token_ms']:.2f} ms/token, same tokens {same}",
            file=sys.stderr,
            flush=True,
        )
        del served
        want = _gen(base, ids, args.zero_new).cpu()
        for variant in args.zero_variants.split(","):
            engine, stored = _zero_engine(args, base, variant, device)
            r = _per_token({variant: engine}, ids, args.zero_new, args.repeats)[variant]
            read = nvme_read_once_ms(engine.zero_engine.swap_files()) if variant == "nvme" else read_once_ms(stored)
            zero_rows.append((batch, variant, r, stored, read, torch.equal(r["tokens"], want)))
            print(
                f"[inference] ZeRO-Inference {variant} batch {batch}: {r['per_token_ms']:.2f} ms/token, read "
                f"{stored / 2**20:.0f} MiB once {read:.2f} ms",
                file=sys.stderr,
                flush=True,
            )
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (--smoke on the CPU)"
    print(
        f"\nGPU: {name}; torch {torch.__version__}; Llama {args.layers} x {args.width} (ffn {args.ffn}, "
        f"{args.heads} heads, {args.kv_heads} kv), vocab {args.vocab}, {model_bytes / 2**30:.2f} GiB bf16; prompt "
        f"{args.prompt}, greedy, median of {args.repeats}\n"
    )
    print(
        "| batch | transformers ms/token | init_inference ms/token | init_inference / transformers tokens/s | "
        "same tokens | first token s (tf / ours) |"
    )
    print("|---|---|---|---|---|---|")
    for batch, res, same in rows:
        t, o = res["transformers"], res["init_inference"]
        print(
            f"| {batch} | {t['per_token_ms']:.2f} | {o['per_token_ms']:.2f} | {o['tok_s'] / t['tok_s']:.3f} | "
            f"{same} | {t['first_s']:.3f} / {o['first_s']:.3f} |"
        )
    print(
        f"\nZeRO-Inference, offload_param cpu (pinned; nvme: swap files under {args.nvme_path}), {args.zero_new} "
        "new tokens:\n"
    )
    print(
        "| batch | variant | stored MiB | read once ms (pinned H2D; nvme: O_DIRECT file read) | per-token ms | "
        "per token / read once | "
        "tokens/s | same tokens as transformers |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch, variant, r, stored, read, same in zero_rows:
        print(
            f"| {batch} | {variant} | {stored / 2**20:.0f} | {read:.2f} | {r['per_token_ms']:.2f} | "
            f"{r['per_token_ms'] / read:.2f} | {r['tok_s']:.1f} | {same} |"
        )
    if torch.cuda.is_available():
        print(
            f"\npageable H2D of the bf16 model: {read_once_ms(model_bytes, pinned=False):.2f} ms; pinned "
            f"{read_once_ms(model_bytes):.2f} ms ({model_bytes / 2**30:.2f} GiB)"
        )


if __name__ == "__main__":
    main()
