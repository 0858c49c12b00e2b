"""A decoder-only transformer in the GPT-2 shape (Radford et al. 2019), for the ``causal_lm`` tasks.

Pre-LayerNorm blocks (``x + attn(ln(x))``, ``x + mlp(ln(x))``), causal self-attention through
``F.scaled_dot_product_attention`` (flash / memory-efficient kernels where the device has them), a GELU MLP
four times as wide, learned position embeddings, a final LayerNorm and an output layer tied to the token
embedding. No dropout unless asked. Initialization is GPT-2's: normal(0, 0.02) for embeddings and weights,
zero biases, and the two projections that write into the residual stream scaled by ``1 / sqrt(2 * layers)``.

``GPT(vocab_size=50257, block_size=1024, layers=12, heads=12, width=768)`` is GPT-2 small: 124,439,808
parameters (123,653,376 without the position embeddings, the count nanoGPT reports).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, bias: bool):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, bias=bias)
        self.proj = nn.Linear(width, width, bias=bias)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).contiguous().view(b, t, c))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, dropout: float, bias: bool):
        super().__init__()
        self.ln1 = nn.LayerNorm(width, bias=bias)
        self.attn = CausalSelfAttention(width, heads, dropout, bias)
        self.ln2 = nn.LayerNorm(width, bias=bias)
        self.fc = nn.Linear(width, 4 * width, bias=bias)
        self.proj = nn.Linear(4 * width, width, bias=bias)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x)))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """``forward(idx)``: logits ``(batch, time, vocab)`` for token ids ``(batch, time)``, ``time <= block_size``."""

    def __init__(
        self,
        vocab_size: int,
        block_size: int = 64,
        layers: int = 4,
        heads: int = 4,
        width: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
    ):
        super().__init__()
        for value, name in ((vocab_size, "vocab_size"), (block_size, "block_size"), (layers, "layers"),
                            (heads, "heads"), (width, "width")):  # fmt: skip
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model.args.{name} must be an integer >= 1, got {value!r}")
        if width % heads:
            raise ValueError(f"model.args.width ({width}) must be a multiple of model.args.heads ({heads})")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"model.args.dropout must be in [0, 1), got {dropout!r}")
        self.block_size = block_size
        self.tok = nn.Embedding(vocab_size, width)
        self.pos = nn.Embedding(block_size, width)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, dropout, bias) for _ in range(layers))
        self.ln = nn.LayerNorm(width, bias=bias)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.head.weight = self.tok.weight  # tied: one tensor, counted and exchanged once
        residual_std = 0.02 / math.sqrt(2 * layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = residual_std if name.endswith(".proj") else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than model.args.block_size={self.block_size}")
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
