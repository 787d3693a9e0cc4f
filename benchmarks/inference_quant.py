"""Weight-only int8 / int4 quantization on a trained model: held-out perplexity and logit error.

    python benchmarks/inference_quant.py [--layers 4 --width 128 --ffn 384 --heads 4 --steps 500
                                          --batch 16 --seq 128 --group-size 64]

No pretrained checkpoint is reachable offline, so the script first trains one: a transformers Llama
(byte vocabulary 256, fp32) on the standard library's sources (`zoo.data.stdlib_corpus`),
the first `--train-bytes` bytes of it, for `--steps` AdamW steps in this process. The held-out text is
the corpus bytes after those (other files, never trained on). Then the same trained weights are served
three ways — fp32 `init_inference`, and `init_inference` with `quant.weight.quantized_initialization`
int8 and int4 (every linear layer, the output head included; group-wise along the input features,
asymmetric, `--group-size` columns per group) — and each is scored on the held-out windows:

- perplexity: exp(mean next-byte cross-entropy) over every held-out window of `--seq` bytes;
- logits: max |logit - fp32 logit| over every position and vocabulary entry of those windows, also as a
  fraction of max |fp32 logit|; and how often the argmax (greedy) byte differs from fp32's;
- memory: bytes of the quantized layers' stored weights (codes + scales + minimums) vs their fp32 weights.

One invocation prints a markdown table.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import time

import torch


def _model(args):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=args.width,
        intermediate_size=args.ffn,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def _train(model, tokens: torch.Tensor, args) -> float:
    from zoo.data import ByteSequenceDataset

    data = ByteSequenceDataset(tokens, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    warm = max(1, args.steps // 10)  # linear warm-up, then cosine decay to 0
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))
    )
    g = torch.Generator().manual_seed(2)
    model.train()
    loss = torch.tensor(float("nan"))
    for _ in range(args.steps):
        idx = torch.randint(0, len(data), (args.batch,), generator=g)
        x, y = (torch.stack(t) for t in zip(*(data[int(i)] for i in idx)))
        loss = torch.nn.functional.cross_entropy(model(x).logits.flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    return float(loss.detach())


def _score(engine, windows_NT: torch.Tensor, targets_NT: torch.Tensor, chunk: int = 32):
    """(perplexity, logits [N, T, V]) of the served model on the held-out windows."""
    nll, logits = 0.0, []
    for i in range(0, len(windows_NT), chunk):
        out = engine(windows_NT[i : i + chunk]).logits.float()
        nll += float(
            torch.nn.functional.cross_entropy(out.flatten(0, 1), targets_NT[i : i + chunk].flatten(), reduction="sum")
        )
        logits.append(out)
    return math.exp(nll / targets_NT.numel()), torch.cat(logits)


def _quantized_bytes(engine) -> tuple[int, int]:
    from zerospeed.compression.weight_quant import QuantizedLinear

    layers = [m for m in engine.module.modules() if isinstance(m, QuantizedLinear)]
    return (sum(m.quantized().nbytes for m in layers), sum(4 * m.in_features * m.out_features for m in layers))


def main() -> None:
    import zerospeed
    from zoo.data import stdlib_corpus

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--ffn", type=int, default=384)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--train-bytes", type=int, default=1_800_000)
    parser.add_argument("--heldout-bytes", type=int, default=32_768)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)

    corpus = stdlib_corpus(args.train_bytes + args.heldout_bytes + 1)
    train, held = corpus[: args.train_bytes], corpus[args.train_bytes :]
    n = (held.numel() - 1) // args.seq
    windows = held[: n * args.seq].reshape(n, args.seq)
    targets = held[1 : n * args.seq + 1].reshape(n, args.seq)

    model = _model(args)
    start = time.perf_counter()
    train_loss = _train(model, train, args)
    train_s = time.perf_counter() - start
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}

    rows, base_logits, base_ppl = [], None, None
    for name, bits in (("fp32", None), ("int8", 8), ("int4", 4)):
        served = _model(args)
        served.load_state_dict(state)
        config = {"dtype": torch.float32}
        if bits:
            config["quant"] = {
                "weight": {"quantized_initialization": {"num_bits": bits, "group_size": args.group_size}}
            }
        engine = zerospeed.init_inference(served, config)
        ppl, logits = _score(engine, windows, targets)
        if base_logits is None:
            base_logits, base_ppl = logits, ppl
            rows.append((name, ppl, "—", "—", "—", "—", "—"))
            continue
        diff = float((logits - base_logits).abs().max())
        rel = diff / float(base_logits.abs().max())
        flips = float((logits.argmax(-1) != base_logits.argmax(-1)).float().mean())
        qbytes, fbytes = _quantized_bytes(engine)
        rows.append(
            (
                name,
                ppl,
                f"{100 * (ppl / base_ppl - 1):+.2f}%",
                f"{diff:.4f}",
                f"{100 * rel:.2f}%",
                f"{100 * flips:.2f}%",
                f"{fbytes / qbytes:.2f}x ({len(engine.quantized)} layers)",
            )
        )

    params = sum(p.numel() for p in model.parameters())
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}; Llama {args.layers} layers "
        f"x {args.width} (ffn {args.ffn}, {args.heads} heads), byte vocab 256, {params / 1e6:.2f} M params; trained "
        f"{args.steps} steps x {args.batch} x {args.seq} bytes on the first {args.train_bytes} stdlib-corpus bytes in "
        f"{train_s:.0f} s (last train loss {train_loss:.3f}); held out: the next {n} x {args.seq} bytes; "
        f"group size {args.group_size}, asymmetric\n"
    )
    print(
        "| weights | held-out perplexity | vs fp32 | max abs logit diff | of max abs logit | argmax differs | "
        "quantized layers smaller |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, ppl, delta, diff, rel, flips, mem in rows:
        print(f"| {name} | {ppl:.4f} | {delta} | {diff} | {rel} | {flips} | {mem} |")


if __name__ == "__main__":
    main()
