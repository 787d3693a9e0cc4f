"""Inference on this machine: tokens/s and per-token latency of generation, memory per rank, for plain
transformers `generate`, `zerospeed.init_inference` at tp = 1 and 2, the paged-KV-cache server and
ZeRO-Inference (stage 3, parameters offloaded to CPU or to NVMe swap files).

    python benchmarks/inference.py [--layers 4 --width 256 --heads 8 --kv-heads 4 --vocab 8192
                                    --prompt 128 --new 128 --batches 1 8 --repeats 2]

One invocation prints a markdown table. Model: a transformers Llama built from a config (fp32, sdpa),
greedy decoding, KV cache on everywhere, prompts of `--prompt` random tokens (no padding), exactly
`--new` tokens generated (no EOS). Every variant runs in its own fresh process(es).

- first token s: a `max_new_tokens=1` run (prefill and one step); total s: the full run (median over
  repeats, after one warm-up); tokens/s = batch x new / total; per-token ms = (total - first) / (new - 1).
- peak RSS MiB / rank: the process's peak resident memory (model, cache, activations and the Python
  runtime; the process starts fresh for each variant).
- ZeRO-Inference: the model's parameters live in CPU memory, sharded (over one rank here), and every
  module is gathered for each forward (persistence threshold 0): per-token time vs the time to copy the
  stored parameter bytes once on this machine (a plain tensor copy of that size) — the ratio the issue
  asks for. nvme: the shards in swap files under `--nvme-path`, read with O_DIRECT for every token; its
  "read once" is one O_DIRECT read of those files with the engine's own reader. int8 / int4: every linear layer's
  shard stored block-quantized (group 64, asymmetric), so
  fewer bytes to read and a dequantization per gather (Note [quantized ZeRO-Inference shards]).
- paged server: all requests added at once; per-token ms = mean step time after the first step.
- the last table times transformers `generate` and `init_inference` at tp = 1 alternately in one process
  (separate processes differ by several % from run to run on this machine).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

import torch


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.width,
        intermediate_size=4 * args.width,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.prompt + args.new,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


def _prompts(args, batch):
    g = torch.Generator().manual_seed(1)
    return torch.randint(2, args.vocab, (batch, args.prompt), generator=g)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed_generate(generate, ids, args) -> dict:
    generate(ids, 2)  # warm-up
    first = statistics.median(_time(lambda: generate(ids, 1)) for _ in range(args.repeats))
    total = statistics.median(_time(lambda: generate(ids, args.new)) for _ in range(args.repeats))
    return {
        "first": first,
        "total": total,
        "tok_s": ids.shape[0] * args.new / total,
        "per_token_ms": 1e3 * (total - first) / max(1, args.new - 1),
    }


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _threads(ranks: int) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))


def _plain(args, batch):
    _threads(1)
    model = _model(args)
    with torch.no_grad():
        res = _timed_generate(
            lambda ids, n: model.generate(ids, max_new_tokens=n, do_sample=False), _prompts(args, batch), args
        )
    return {**res, "rss": _peak_rss_mib()}


def _engine(args, batch, tp, zero, bits=None, leaves=False, nvme=False):
    import zerospeed

    _threads(tp)
    config = {"dtype": torch.float32, "tensor_parallel": {"tp_size": tp}}
    if zero:
        offload = {"device": "nvme", "nvme_path": args.nvme_path} if nvme else {"device": "cpu"}
        config["zero"] = {"stage": 3, "offload_param": offload, "stage3_param_persistence_threshold": 0}
    if leaves:  # Note [leaf modules]: each decoder layer one unit, gathered by one hook and one collective
        config["zero"]["leaf_module"] = {"classes": ["LlamaDecoderLayer"]}
    if bits:  # Note [quantized ZeRO-Inference shards]: every linear layer's stored shard
        config["quant"] = {"weight": {"quantized_initialization": {"num_bits": bits, "group_size": 64}}}
    model = _model(args)
    engine = zerospeed.init_inference(model, config)
    # what one token reads: every shard as stored (quantized ones as codes + scales)
    model_bytes = (
        engine.zero_engine.zero.memory_breakdown(None)["parameters"]
        if zero
        else sum(p.numel() * p.element_size() for p in model.parameters())
    )
    res = _timed_generate(
        lambda ids, n: engine.generate(ids, max_new_tokens=n, do_sample=False), _prompts(args, batch), args
    )
    res["rss"] = _peak_rss_mib()
    res["param_mib"] = model_bytes / 2**20
    if nvme:  # one O_DIRECT read of the swap files with the engine's own reader
        from workers import nvme_read_once_ms

        files = engine.zero_engine.swap_files()
        res["read_model_ms"] = nvme_read_once_ms(files)
        res["param_mib"] = sum(nbytes for _, _, nbytes in files) / 2**20  # on the disk, not in memory
    elif zero:  # Note: the time to move the model's bytes once, by a plain copy of that many bytes
        src = torch.empty(model_bytes // 4)
        dst = torch.empty_like(src)
        res["read_model_ms"] = 1e3 * statistics.median(_time(lambda: dst.copy_(src)) for _ in range(5))
    return res


def _interleaved(args, batch):
    """transformers `generate` and `init_inference` (tp 1) on copies of the same model in one process, timed
    alternately: the same-process comparison (separate processes differ by a few % run to run here)."""
    import zerospeed

    _threads(1)
    plain, served = _model(args), _model(args)
    engine = zerospeed.init_inference(served, {"dtype": torch.float32})
    ids = _prompts(args, batch)
    runs = {"plain": [], "engine": []}
    with torch.no_grad():
        plain.generate(ids, max_new_tokens=2, do_sample=False)
    engine.generate(ids, max_new_tokens=2, do_sample=False)
    for _ in range(args.repeats):
        with torch.no_grad():
            runs["plain"].append(_time(lambda: plain.generate(ids, max_new_tokens=args.new, do_sample=False)))
        runs["engine"].append(_time(lambda: engine.generate(ids, max_new_tokens=args.new, do_sample=False)))
    return {k: statistics.median(v) for k, v in runs.items()}


def _paged(args, batch):
    from zerospeed.inference.paged import PagedServer

    _threads(1)
    model = _model(args)
    ids = _prompts(args, batch)
    block = 16
    blocks = batch * -(-(args.prompt + args.new) // block)

    def run(n):
        server = PagedServer(model, block_size=block, num_blocks=blocks, max_batch_tokens=batch * args.prompt)
        for row in ids:
            server.add_request(row, n)
        steps = []
        while server.has_unfinished():
            steps.append(_time(server.step))
        return steps, server.kv_waste()

    run(2)
    steps, waste = run(args.new)
    total = sum(steps)
    return {
        "first": steps[0],
        "total": total,
        "tok_s": batch * args.new / total,
        "per_token_ms": 1e3 * statistics.mean(steps[1:]) if len(steps) > 1 else 0.0,
        "rss": _peak_rss_mib(),
        "waste": waste,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--only",
        nargs="*",
        default=[],
        help="run only the variants whose names contain one of these (transformers always runs)",
    )
    parser.add_argument(
        "--nvme-path",
        default="/tmp/zerospeed_nvme_inference",
        help="swap files of the offload_param nvme variant (a disk that supports O_DIRECT)",
    )
    parser.add_argument("--no-interleaved", action="store_true", help="skip the same-process comparison")
    args = parser.parse_args()
    os.makedirs(args.nvme_path, exist_ok=True)
    from harness import run_distributed

    rows, interleaved = [], []
    for batch in args.batches:
        runs = {
            "transformers generate": lambda: run_distributed(_plain, 1, args, batch, timeout=3600),
            "zerospeed init_inference, tp = 1": lambda: run_distributed(
                _engine, 1, args, batch, 1, False, timeout=3600
            ),
            "zerospeed init_inference, tp = 2": lambda: run_distributed(
                _engine, 2, args, batch, 2, False, timeout=3600
            ),
            "zerospeed paged server": lambda: run_distributed(_paged, 1, args, batch, timeout=3600),
            "ZeRO-Inference, offload_param cpu": lambda: run_distributed(
                _engine, 1, args, batch, 1, True, timeout=3600
            ),
            "ZeRO-Inference, leaf decoder layers, offload_param cpu": lambda: run_distributed(
                _engine, 1, args, batch, 1, True, None, True, timeout=3600
            ),
            "ZeRO-Inference, offload_param nvme": lambda: run_distributed(
                _engine, 1, args, batch, 1, True, None, False, True, timeout=3600
            ),
            "ZeRO-Inference int8, offload_param cpu": lambda: run_distributed(
                _engine, 1, args, batch, 1, True, 8, timeout=3600
            ),
            "ZeRO-Inference int4, offload_param cpu": lambda: run_distributed(
                _engine, 1, args, batch, 1, True, 4, timeout=3600
            ),
        }
        variants = {
            name: run()
            for name, run in runs.items()
            if name == "transformers generate" or not args.only or any(o in name for o in args.only)
        }
        base = variants["transformers generate"][0]["tok_s"]
        for name, results in variants.items():
            r = min(results, key=lambda x: x["tok_s"])  # the slowest rank
            note = ""
            if "read_model_ms" in r:
                note = (
                    f"parameters {r['param_mib']:.1f} MiB; per token / read them once = "
                    f"{r['per_token_ms'] / r['read_model_ms']:.1f}"
                )
            if "waste" in r:
                note = f"KV block waste {r['waste']:.1%}"
            rows.append((batch, name, r, r["tok_s"] / base, max(x["rss"] for x in results), note))
        if not args.no_interleaved:
            same = run_distributed(_interleaved, 1, args, batch, timeout=3600)[0]
            interleaved.append((batch, same["plain"], same["engine"]))
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; Llama {args.layers} "
        f"layers x {args.width}, {args.heads} heads ({args.kv_heads} kv), vocab {args.vocab}, fp32, greedy, "
        f"prompt {args.prompt}, new {args.new}\n"
    )
    print(
        "| batch | variant | first token s | total s | tokens/s | vs transformers | per-token ms | "
        "peak RSS MiB / rank | note |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for batch, name, r, ratio, rss, note in rows:
        print(
            f"| {batch} | {name} | {r['first']:.3f} | {r['total']:.3f} | {r['tok_s']:.1f} | {ratio:.2f} | "
            f"{r['per_token_ms']:.2f} | {rss:.0f} | {note} |"
        )
    if args.no_interleaved:
        return
    print("\nSame process, alternating runs (tp = 1):\n")
    print("| batch | transformers generate s | init_inference generate s | zerospeed tokens/s vs transformers |")
    print("|---|---|---|---|")
    for batch, plain_s, engine_s in interleaved:
        print(f"| {batch} | {plain_s:.3f} | {engine_s:.3f} | {plain_s / engine_s:.2f} |")


if __name__ == "__main__":
    main()
