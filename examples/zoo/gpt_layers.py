"""The test GPT (`zoo.models.GPT`) as a pipeline layer list, for tests, the example and
the benchmark: token embedding (tied with the output head) | positions | blocks | final norm | head.

With `source` given, every layer starts from that model's weights, so a pipeline run can be compared
with the same GPT trained in one process. With `tp_group`, the layers are tensor-parallel (Megatron's
split: fused qkv and the MLP's first layer by columns — each rank its heads —, attention output and
the MLP's second layer by rows, the tied embedding / head by vocabulary) and the loss is
`TensorParallelLoss(tp_group)`, which never gathers the full logits.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed import comm
from zerospeed.parallel.pipeline.module import LayerSpec, TiedLayerSpec
from zerospeed.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from zerospeed.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from zerospeed.parallel.tensor.mappings import copy_to_tensor_region
from zerospeed.parallel.tensor.partition import fused_spec, vocab_spec
from zoo.models import GPT, Block, GPTConfig


def _init_or_copy(shape: tuple[int, ...], source: torch.Tensor | None) -> nn.Parameter:
    if source is not None:
        return nn.Parameter(source.detach().clone())
    return nn.Parameter(torch.randn(shape) * 0.02)


class TokenEmbedding(nn.Module):
    """idx (B, T) -> x (B, T, D); its weight doubles as the output head (TiedLayerSpec key "embed")."""

    def __init__(self, cfg: GPTConfig, source: GPT | None = None):
        super().__init__()
        self.weight = _init_or_copy((cfg.vocab_size, cfg.n_embd), source.wte.weight if source else None)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return F.embedding(idx_BT, self.weight)


class AddPositions(nn.Module):
    def __init__(self, cfg: GPTConfig, source: GPT | None = None):
        super().__init__()
        self.weight = _init_or_copy((cfg.block_size, cfg.n_embd), source.wpe.weight if source else None)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return x_BTD + self.weight[: x_BTD.shape[1]]


def _block(cfg: GPTConfig, index: int, source: GPT | None = None) -> nn.Module:
    return copy.deepcopy(source.blocks[index]) if source is not None else Block(cfg)


class PipeBlock(nn.Module):
    def __init__(self, cfg: GPTConfig, index: int, source: GPT | None = None):
        super().__init__()
        self.block = _block(cfg, index, source)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.block(x_BTD)


class FinalNorm(nn.Module):
    def __init__(self, cfg: GPTConfig, source: GPT | None = None):
        super().__init__()
        self.ln = copy.deepcopy(source.ln_f) if source is not None else nn.LayerNorm(cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.ln(x_BTD)


def lm_head(embedding: TokenEmbedding, x_BTD: torch.Tensor) -> torch.Tensor:
    return F.linear(x_BTD, embedding.weight)


def lm_loss(logits_BTV: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BTV.reshape(-1, logits_BTV.shape[-1]), targets_BT.reshape(-1))


class ParallelTokenEmbedding(nn.Module):
    """TokenEmbedding with its vocabulary split over `group` (tied with the head: key "embed",
    `tied_weight_attr="embed.weight"`)."""

    def __init__(self, cfg: GPTConfig, source: GPT | None, group):
        super().__init__()
        full = source.wte.weight.detach() if source is not None else torch.randn(cfg.vocab_size, cfg.n_embd) * 0.02
        self.embed = VocabParallelEmbedding.from_full(full, group=group)

    def forward(self, idx_BT: torch.Tensor) -> torch.Tensor:
        return self.embed(idx_BT)


class ParallelPipeBlock(nn.Module):
    """The test GPT's Block with its four linear layers split over `group` (2 all-reduces forward,
    2 backward)."""

    def __init__(self, cfg: GPTConfig, index: int, source: GPT | None, group):
        super().__init__()
        ref = _block(cfg, index, source)
        tp, D, H = comm.get_world_size(group), cfg.n_embd, cfg.n_head
        if H % tp:
            raise ValueError(f"n_head={H} does not divide over tp={tp}")
        self.local_heads, self.head_dim = H // tp, D // H
        self.ln_1, self.ln_2 = ref.ln_1, ref.ln_2
        qkv_specs = tuple(fused_spec([D, D, D], tp, r, unit=D // H) for r in range(tp))
        self.qkv = ColumnParallelLinear.from_linear(ref.attn.qkv, group=group, specs=qkv_specs, gather_output=False)
        self.attn_out = RowParallelLinear.from_linear(ref.attn.proj, group=group, input_is_parallel=True)
        self.fc = ColumnParallelLinear.from_linear(ref.mlp.fc, group=group, gather_output=False)
        self.mlp_out = RowParallelLinear.from_linear(ref.mlp.proj, group=group, input_is_parallel=True)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q, k, v = (
            t.view(B, T, self.local_heads, self.head_dim).transpose(1, 2)
            for t in self.qkv(self.ln_1(x_BTD)).chunk(3, dim=-1)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)
        x_BTD = x_BTD + self.attn_out(y)
        return x_BTD + self.mlp_out(F.gelu(self.fc(self.ln_2(x_BTD))))


def parallel_lm_head(embedding: ParallelTokenEmbedding, x_BTD: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary slice of the logits."""
    return F.linear(copy_to_tensor_region(x_BTD, embedding.embed.group), embedding.embed.weight)


class TensorParallelLoss:
    """`lm_loss` over vocabulary-sharded logits (vocab-parallel cross-entropy; every tp rank gets the loss).
    `vocab_size` places this rank's slice when the vocabulary does not split evenly."""

    def __init__(self, group, vocab_size: int | None = None):
        self.group = group
        self.vocab_start = (
            None
            if vocab_size is None
            else vocab_spec(vocab_size, comm.get_world_size(group), comm.get_rank(group)).segments[0][0]
        )

    def __call__(self, logits_BTv: torch.Tensor, targets_BT: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits_BTv, targets_BT, self.group, vocab_start=self.vocab_start)


def gpt_layer_specs(cfg: GPTConfig, source: GPT | None = None, tp_group=None) -> list:
    """The layer list (n_layer + 4 layers); use with `loss_fn=lm_loss` (with `tp_group`:
    `TensorParallelLoss(tp_group)`)."""
    if tp_group is not None:
        return [
            TiedLayerSpec("embed", ParallelTokenEmbedding, cfg, source, tp_group, tied_weight_attr="embed.weight"),
            LayerSpec(AddPositions, cfg, source),
            *[LayerSpec(ParallelPipeBlock, cfg, i, source, tp_group) for i in range(cfg.n_layer)],
            LayerSpec(FinalNorm, cfg, source),
            TiedLayerSpec(
                "embed",
                ParallelTokenEmbedding,
                cfg,
                source,
                tp_group,
                forward_fn=parallel_lm_head,
                tied_weight_attr="embed.weight",
            ),
        ]
    return [
        TiedLayerSpec("embed", TokenEmbedding, cfg, source),
        LayerSpec(AddPositions, cfg, source),
        *[LayerSpec(PipeBlock, cfg, i, source) for i in range(cfg.n_layer)],
        LayerSpec(FinalNorm, cfg, source),
        TiedLayerSpec("embed", TokenEmbedding, cfg, source, forward_fn=lm_head),
    ]
