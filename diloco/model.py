"""The embedded default model: a small byte-level transformer (GPT shape), pure torch.

Why byte-level: the vocabulary is fixed at 256 on every machine, so a run needs no tokenizer
download and every peer agrees on the input space by construction. Why a deterministic init from a
seed: every peer of a run must start from the same global parameters without downloading them, and a
joiner can rebuild round 0 locally and check it against the published state hash.

The default config (d_model 128, 4 layers, 4 heads, context 128) has about 0.87M parameters, the
size the DiLoCo probe in DESIGN.md measured on two CPU cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

VOCAB_SIZE = 256


@dataclass(frozen=True)
class ByteTransformerConfig:
    """Shape of the byte-level transformer; frozen so it can be part of a run fingerprint."""

    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128
    mlp_ratio: int = 4

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "context", "mlp_ratio"):
            if getattr(self, name) <= 0:
                raise ValueError(f"ByteTransformerConfig.{name} must be positive")
        if self.d_model % self.n_heads:
            raise ValueError("ByteTransformerConfig.d_model must be divisible by n_heads")


class _Block(nn.Module):
    """Pre-norm attention + MLP block; causal attention through torch's fused kernel."""

    def __init__(self, config: ByteTransformerConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.ln_attn = nn.LayerNorm(config.d_model)
        self.qkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.proj = nn.Linear(config.d_model, config.d_model)
        self.ln_mlp = nn.LayerNorm(config.d_model)
        self.fc = nn.Linear(config.d_model, config.mlp_ratio * config.d_model)
        self.fc_out = nn.Linear(config.mlp_ratio * config.d_model, config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(width, dim=2)
        heads = (batch, length, self.n_heads, width // self.n_heads)
        q, k, v = (t.view(heads).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.fc_out(F.gelu(self.fc(self.ln_mlp(x))))


class ByteTransformer(nn.Module):
    """Causal language model over bytes.

    ``forward(idx)`` takes int64 ``(B, T)`` byte values with ``T <= config.context`` and returns
    float32 logits ``(B, T, 256)``. ``loss(idx, targets)`` returns the mean cross entropy in nats
    per byte. Raises ValueError when ``T`` exceeds the context.
    """

    def __init__(self, config: ByteTransformerConfig | None = None, *, seed: int = 0) -> None:
        super().__init__()
        self.config = config or ByteTransformerConfig()
        c = self.config
        self.embed = nn.Embedding(VOCAB_SIZE, c.d_model)
        self.position = nn.Embedding(c.context, c.d_model)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.ln_final = nn.LayerNorm(c.d_model)
        self.head = nn.Linear(c.d_model, VOCAB_SIZE, bias=False)
        self.reset_parameters(seed)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from ``seed`` alone, in named order.

        A private generator (not the global torch RNG) makes the result independent of whatever
        else the process drew before, which is what lets every peer rebuild the same round 0.
        """
        generator = torch.Generator().manual_seed(seed)
        # Residual projections are scaled down by depth (GPT-2's choice) so the residual stream's
        # variance does not grow with the number of layers.
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, param in self.named_parameters():
            if name.endswith(".bias"):
                param.zero_()
            elif ".ln_" in name or name.startswith("ln_"):
                param.fill_(1.0)
            else:
                std = residual_std if name.endswith(("proj.weight", "fc_out.weight")) else 0.02
                param.copy_(torch.randn(param.shape, generator=generator) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        length = idx.shape[1]
        if length > self.config.context:
            raise ValueError(f"sequence length {length} exceeds context {self.config.context}")
        positions = torch.arange(length, device=idx.device)
        x = self.embed(idx) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_final(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))
