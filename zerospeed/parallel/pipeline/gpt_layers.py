"""The test GPT (`zerospeed.testing.models.GPT`) as a pipeline layer list, for tests, the example and
the benchmark: token embedding (tied with the output head) | positions | blocks | final norm | head.

With `source` given, every layer starts from that model's weights, so a pipeline run can be compared
with the same GPT trained in one process.
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from zerospeed.parallel.pipeline.module import LayerSpec, TiedLayerSpec
from zerospeed.testing.models import GPT, Block, GPTConfig


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


def gpt_layer_specs(cfg: GPTConfig, source: GPT | None = None) -> list:
    """The layer list (n_layer + 4 layers); use with `loss_fn=lm_loss`."""
    return [TiedLayerSpec("embed", TokenEmbedding, cfg, source),
            LayerSpec(AddPositions, cfg, source),
            *[LayerSpec(PipeBlock, cfg, i, source) for i in range(cfg.n_layer)],
            LayerSpec(FinalNorm, cfg, source),
            TiedLayerSpec("embed", TokenEmbedding, cfg, source, forward_fn=lm_head)]
