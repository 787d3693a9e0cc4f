"""The compression library, end to end: size on disk, held-out perplexity and CPU inference time of each
method against the fp32 model it started from.

    python benchmarks/compression.py [--layers 4 --width 128 --heads 4 --seq 64 --batch 16
                                      --teacher-steps 600 --steps 200 --lkd-steps 100]

No pretrained checkpoint is reachable offline, so the script first trains the fp32 teacher: the test
GPT (`zoo.models.GPT`, byte vocabulary 256) on the standard library's sources, the first
`--train-bytes` bytes; the held-out text is the `--heldout-bytes` after them. Then, each from a copy of
the teacher (DeepSpeed's `compression_training` blocks, built below):

- QAT int8: 8-bit symmetric weight QAT on every block Linear, `--steps` AdamW steps of cross-entropy.
- ZeroQuant int8: post-training W8A8, group-wise weights (`quantize_groups` = width) and token-wise
  dynamic activations on every block Linear, then ZeroQuant's layer-by-layer distillation
  (`layerwise_distill`, `--lkd-steps` per block), no labels.
- 50% sparse + row-pruned: l1 sparse pruning (dense_ratio 0.5) of the attention Linears and l1 row
  pruning (0.5) of `mlp.fc` with `mlp.proj`'s columns, `--steps` steps of fine-tuning.
- layer reduction: a student with half the blocks initialised from the teacher's odd blocks
  (`layer_reduction`, `student_initialization`), `--steps` steps of cross-entropy + distillation loss.
- XTC ternary: 2-bit (ternary) weights on every block Linear, `--steps` steps of cross-entropy +
  distillation loss from the teacher.

A control row fine-tunes the fp32 teacher the same `--steps` steps without compression: the teacher is
not trained to convergence, so the extra steps alone lower the perplexity; compare the methods with it.
Each is cleaned (`redundancy_clean`) and written with `save_compressed` (fp32 models with
safetensors' `save_model`); the table reports the file's bytes, the held-out perplexity and the median
time of a forward pass over `--infer-batch` windows (`torch.inference_mode`, this process's threads).
The ZeroQuant model is timed twice: as stored (`QuantizedLinear` dequantizes and runs a float matmul) and
with `integer_matmul` (its int8 codes times the int8 activations through `torch._int_mm`). A last row
times PyTorch's own dynamic int8 Linear (fbgemm) on the fp32 teacher: the speed of PyTorch's other int8
kernel on this CPU.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def _groups(name: str, params: dict, modules: list[str], related=None, **shared) -> dict:
    group = {"params": params, "modules": modules}
    if related:
        group["related_modules"] = related
    return {
        name: {"shared_parameters": {"enabled": True, "schedule_offset": 0, **shared}, "different_groups": {"g": group}}
    }


def _config(*blocks: dict, **extra) -> dict:
    out = dict(extra)
    for b in blocks:
        out.update(b)
    return {"compression_training": out}


class Data:
    def __init__(self, args):
        from zoo.data import ByteSequenceDataset, stdlib_corpus

        corpus = stdlib_corpus(args.train_bytes + args.heldout_bytes + 1)
        self.train = ByteSequenceDataset(corpus[: args.train_bytes + 1], args.seq)
        held = corpus[args.train_bytes :]
        n = (held.numel() - 1) // args.seq
        self.windows = held[: n * args.seq].reshape(n, args.seq)
        self.targets = held[1 : n * args.seq + 1].reshape(n, args.seq)
        self.g = torch.Generator().manual_seed(2)
        self.batch = args.batch

    def sample(self):
        idx = torch.randint(0, len(self.train), (self.batch,), generator=self.g)
        return tuple(torch.stack(t) for t in zip(*(self.train[int(i)] for i in idx)))


def _train(model, data: Data, steps: int, lr: float, teacher=None) -> None:
    """AdamW with warm-up and cosine decay; cross-entropy, plus the distillation loss when a teacher is given."""
    from zerospeed.compression import compression_scheduler, distillation_loss

    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.01)
    warm = max(1, steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warm, 0.5 * (1 + math.cos(math.pi * min(1.0, s / steps))))
    )
    schedule = compression_scheduler(model)
    model.train()
    for _ in range(steps):
        x, y = data.sample()
        logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        if teacher is not None:
            with torch.no_grad():
                target = teacher(x)
            loss = 0.5 * loss + 0.5 * distillation_loss(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        schedule.step()
    model.eval()


@torch.inference_mode()
def _perplexity(model, data: Data, chunk: int = 32) -> float:
    nll = 0.0
    for i in range(0, len(data.windows), chunk):
        logits = model(data.windows[i : i + chunk]).float()
        nll += float(F.cross_entropy(logits.flatten(0, 1), data.targets[i : i + chunk].flatten(), reduction="sum"))
    return math.exp(nll / data.targets.numel())


@torch.inference_mode()
def _forward_ms(model, data: Data, batch: int, repeats: int = 15) -> float:
    x = data.windows[:batch]
    model(x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model(x)
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


BLOCK_LINEAR = re.compile(r"blocks\.\d+\.(attn|mlp)\.(qkv|proj|fc)\.")


def _block_linear_bytes(model) -> int:
    """Bytes of the block Linears' stored tensors (weights or codes, scales, biases)."""
    return sum(t.numel() * t.element_size() for k, t in model.state_dict().items() if BLOCK_LINEAR.match(k))


def _file_bytes(model, compressed: bool, folder: Path, name: str) -> int:
    from safetensors.torch import save_model

    from zerospeed.compression import save_compressed

    path = folder / f"{name}.safetensors"
    if compressed:
        return save_compressed(model, path)
    save_model(model, str(path))
    return path.stat().st_size


def main() -> None:
    from zerospeed.compression import init_compression, layerwise_distill, redundancy_clean
    from zoo.models import GPT, GPTConfig

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--teacher-steps", type=int, default=600)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lkd-steps", type=int, default=100)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--ft-lr", type=float, default=5e-4)
    parser.add_argument("--infer-batch", type=int, default=16)
    parser.add_argument("--train-bytes", type=int, default=1_500_000)
    parser.add_argument("--heldout-bytes", type=int, default=32_768)
    args = parser.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    data = Data(args)

    def gpt(layers=args.layers):
        return GPT(
            GPTConfig(
                vocab_size=256, block_size=args.seq, n_layer=layers, n_head=args.heads, n_embd=args.width, bias=True
            )
        )

    torch.manual_seed(0)
    teacher = gpt()
    start = time.perf_counter()
    _train(teacher, data, args.teacher_steps, args.lr)
    teacher_s = time.perf_counter() - start
    teacher.requires_grad_(False)
    rows = []
    folder = Path(tempfile.mkdtemp(prefix="zs-compression-"))

    def record(name, model, compressed, seconds):
        rows.append(
            (
                name,
                _file_bytes(model, compressed, folder, name.split()[0]),
                _block_linear_bytes(model),
                _perplexity(model, data),
                _forward_ms(model, data, args.infer_batch),
                seconds,
            )
        )

    record("fp32", teacher, False, teacher_s)
    # the control: the fine-tuning alone, no compression (the teacher is not trained to convergence, so
    # the methods' extra steps help it too)
    start = time.perf_counter()
    control = copy.deepcopy(teacher).requires_grad_(True)
    _train(control, data, args.steps, args.ft_lr)
    record("fp32 + the same fine-tuning (control)", control, False, time.perf_counter() - start)
    all_blocks = [r"blocks\.\d+\.(attn|mlp)\.(qkv|proj|fc)"]

    def compressed_copy(config, steps, distill=False):
        start = time.perf_counter()
        model = copy.deepcopy(teacher).requires_grad_(True)
        init_compression(model, config)
        if steps:
            _train(model, data, steps, args.ft_lr, teacher if distill else None)
        return model, start

    # QAT int8
    cfg = _config(_groups("weight_quantization", {"start_bits": 8, "target_bits": 8}, all_blocks))
    model, start = compressed_copy(cfg, args.steps)
    redundancy_clean(model, cfg)
    record("QAT int8", model, True, time.perf_counter() - start)

    # ZeroQuant: W8 group-wise + A8 token-wise, post-training, then layer-by-layer distillation
    cfg = _config(
        _groups("weight_quantization", {"start_bits": 8, "target_bits": 8}, all_blocks, quantize_groups=args.width),
        _groups("activation_quantization", {"bits": 8}, all_blocks, range_calibration="dynamic"),
    )
    model, start = compressed_copy(cfg, 0)
    ptq = copy.deepcopy(model)
    redundancy_clean(ptq, cfg)
    record("ZeroQuant int8 PTQ only", ptq, True, time.perf_counter() - start)
    layerwise_distill(model, teacher, "blocks", [data.sample()[0] for _ in range(8)], args.lkd_steps, lr=1e-4)
    redundancy_clean(model, cfg)
    record("ZeroQuant int8 (PTQ + LKD)", model, True, time.perf_counter() - start)
    from zerospeed.compression.basic_layer import QuantizedLinear

    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            m.integer_matmul = True  # Note [integer matmul]: int8 x int8 -> int32 through torch._int_mm
    record("ZeroQuant int8, integer matmul", model, True, None)

    # 50% sparse attention + 50% row-pruned MLP
    cfg = _config(
        _groups("sparse_pruning", {"dense_ratio": 0.5}, [r"attn\.(qkv|proj)"], method="l1"),
        _groups("row_pruning", {"dense_ratio": 0.5}, [r"mlp\.fc"], [[r"mlp\.proj"]], method="l1"),
    )
    model, start = compressed_copy(cfg, args.steps)
    redundancy_clean(model, cfg)
    record("50% sparse + row-pruned", model, True, time.perf_counter() - start)

    # layer reduction with distillation
    start = time.perf_counter()
    keep = list(range(1, args.layers, 2))
    cfg = _config(
        layer_reduction={
            "enabled": True,
            "keep_number_layer": len(keep),
            "module_name_prefix": "blocks",
            "teacher_layer": keep,
            "other_module_name": ["wte", "wpe", "ln_f"],
        }
    )
    torch.manual_seed(1)
    student = gpt(len(keep))
    init_compression(student, cfg, teacher_model=teacher)
    _train(student, data, args.steps, args.ft_lr, teacher)
    record(f"layer reduction {args.layers} -> {len(keep)} + KD", student, False, time.perf_counter() - start)

    # XTC: ternary weights with distillation
    cfg = _config(
        _groups("weight_quantization", {"start_bits": 2, "target_bits": 2}, all_blocks, quantize_groups=args.width)
    )
    model, start = compressed_copy(cfg, args.steps, distill=True)
    redundancy_clean(model, cfg)
    record("XTC ternary + KD", model, True, time.perf_counter() - start)

    # PyTorch's own int8 kernels, for the speed they give here
    dyn = torch.ao.quantization.quantize_dynamic(copy.deepcopy(teacher), {torch.nn.Linear}, dtype=torch.qint8)
    rows.append(
        (
            "torch dynamic int8 Linear (fbgemm), fp32 teacher",
            None,
            None,
            _perplexity(dyn, data),
            _forward_ms(dyn, data, args.infer_batch),
            None,
        )
    )

    params = sum(p.numel() for p in teacher.parameters())
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}; GPT {args.layers} x {args.width} ({args.heads} heads), byte vocab 256, "
        f"{params / 1e6:.2f} M params; teacher trained {args.teacher_steps} steps x {args.batch} x {args.seq} bytes; "
        f"fine-tuning {args.steps} steps, LKD {args.lkd_steps} steps per block; held out {len(data.windows)} x "
        f"{args.seq} bytes; forward timed on {args.infer_batch} x {args.seq}\n"
    )
    print(
        "| method | file | vs fp32 | block Linears stored | vs fp32 | held-out perplexity | vs fp32 | "
        "forward (ms) | vs fp32 | compress (s) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    base_bytes, base_block, base_ppl, base_ms = rows[0][1:5]
    for name, size, block, ppl, ms, seconds in rows:
        size_s = f"{size / 1024:.0f} KiB" if size else "—"
        ratio = f"{base_bytes / size:.2f}x smaller" if size and size != base_bytes else "—"
        block_s = f"{block / 1024:.0f} KiB" if block else "—"
        block_ratio = f"{base_block / block:.2f}x smaller" if block and block != base_block else "—"
        print(
            f"| {name} | {size_s} | {ratio} | {block_s} | {block_ratio} | {ppl:.3f} | "
            f"{100 * (ppl / base_ppl - 1):+.1f}% | {ms:.1f} | {ms / base_ms:.2f}x | "
            f"{'—' if seconds is None else f'{seconds:.0f}'} |"
        )


if __name__ == "__main__":
    main()
