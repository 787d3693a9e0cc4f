"""Deterministic tiny models for tests, the demo and the benchmarks.

Nothing here uses dropout or any other source of randomness in ``forward``, so two runs
that start from the same seed produce bit-identical losses; parity tests rely on that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["TinyMLP", "GPTConfig", "GPT"]


class TinyMLP(nn.Module):
    """A stack of Linear+ReLU layers ending in a Linear; the smallest model with real gradients.

    ``n_layers`` counts the hidden (Linear+ReLU) layers; the output Linear comes on top.
    """

    def __init__(self, d_in: int = 16, d_hidden: int = 32, d_out: int = 8, n_layers: int = 2) -> None:
        super().__init__()
        if n_layers < 1:
            raise ValueError(f"TinyMLP needs n_layers >= 1, got {n_layers}")
        layers: list[nn.Module] = []
        width = d_in
        for _ in range(n_layers):
            layers += [nn.Linear(width, d_hidden), nn.ReLU()]
            width = d_hidden
        layers.append(nn.Linear(width, d_out))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits, or the mean-squared-error loss (0-dim) against ``y`` when it is given."""
        out = self.net(x)
        if y is None:
            return out
        return F.mse_loss(out, y)


@dataclass
class GPTConfig:
    """Shape of a :class:`GPT`. The defaults give a model of ~0.1M parameters over bytes."""

    vocab_size: int = 256
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    bias: bool = True

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head != 0:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, D = x_BTD.shape
        q_BTD, k_BTD, v_BTD = self.qkv(x_BTD).split(D, dim=2)
        # (B, T, D) -> (B, H, T, D/H): heads become a batch dimension for SDPA.
        q_BHTd, k_BHTd, v_BHTd = (
            t.view(B, T, self.n_head, D // self.n_head).transpose(1, 2) for t in (q_BTD, k_BTD, v_BTD)
        )
        y_BHTd = F.scaled_dot_product_attention(q_BHTd, k_BHTd, v_BHTd, is_causal=True)
        return self.proj(y_BHTd.transpose(1, 2).reshape(B, T, D))


class MLP(nn.Module):
    """The position-wise feed-forward layer: D -> 4D -> GELU -> D."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x_BTD)))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_BTD = x_BTD + self.attn(self.ln_1(x_BTD))
        return x_BTD + self.mlp(self.ln_2(x_BTD))


class GPT(nn.Module):
    """A small decoder-only transformer whose output head shares the token embedding's weight.

    Construction is deterministic under ``torch.manual_seed``: every rank that seeds the same
    way builds the same initial model, which is what data-parallel training assumes.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Weight tying: one Parameter object, so model.parameters() yields it once and any
        # sharding/partitioning code sees a single tensor with two users.
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)

    def _init_weights(self, module: nn.Module) -> None:
        """Whole-model initialisation, as a method (the transformers convention) so that
        `zerospeed.zero.Init` can replay it module by module on sharded parameters."""
        _init_weights(module)

    def forward(self, idx_BT: torch.Tensor, targets_BT: torch.Tensor | None = None) -> torch.Tensor:
        """Return logits ``(B, T, vocab)``, or the mean cross-entropy when ``targets_BT`` is given."""
        B, T = idx_BT.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds block_size {self.config.block_size}")
        pos_T = torch.arange(T, device=idx_BT.device)
        x_BTD = self.wte(idx_BT) + self.wpe(pos_T)
        for block in self.blocks:
            x_BTD = block(x_BTD)
        logits_BTV = self.lm_head(self.ln_f(x_BTD))
        if targets_BT is None:
            return logits_BTV
        return F.cross_entropy(logits_BTV.reshape(B * T, -1), targets_BT.reshape(B * T))

    def num_parameters(self) -> int:
        """Number of scalar parameters, counting the tied embedding/head weight once."""
        # parameters() already deduplicates shared Parameter objects.
        return sum(p.numel() for p in self.parameters())


def _init_weights(module: nn.Module) -> None:
    # GPT-2 style: small normal weights keep the initial logits near zero, so the initial
    # loss is close to ln(vocab_size) — a property the tests and the demo check.
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)
