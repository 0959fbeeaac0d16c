"""The masked mixer: a transformer whose attention is a causally masked 1-D convolution over tokens.

Each block mixes tokens with a learned (n_ctx × n_ctx) weight, masked lower-triangular on every
forward (position t reads positions ≤ t only), then runs a GELU feed-forward; both sublayers are
pre-LayerNorm residuals. Variants:

- flat (`n_heads=0`, `kernel=1`): one masked token-mixing matrix shared by every hidden channel;
- kernel k > 1: the convolution treats tokens as channels and slides a width-k kernel along the
  hidden dimension, so a token's element n also reads elements n±(k/2) of earlier tokens (k weight
  maps per layer); still causal in tokens;
- multi-headed (`n_heads=h`): project to h heads of d_model/h, one masked convolution per head,
  concatenate, output projection.

There are no positional embeddings: the mixing weights are position-specific already. A sequence
shorter than n_ctx uses the top-left T × T corner of each weight, which is exactly what the model
computes for those positions on a longer sequence (the mask makes later rows/columns irrelevant).

Precision: train in bf16 autocast (or fp32). fp16 overflows in multi-headed mixers: the write-up saw
exploding gradients with fp16 that vanished with bf16's wider exponent range.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


class MaskedConv(nn.Module):
    """h causal token-mixing convolutions over x (B, h, T, d_head) -> (B, h, T, d_head)."""

    def __init__(self, n_ctx: int, n_heads: int, kernel: int):
        super().__init__()
        self.n_heads, self.kernel = n_heads, kernel
        self.weight = nn.Parameter(torch.empty(n_heads, n_ctx, n_ctx, kernel))
        self.bias = nn.Parameter(torch.empty(n_heads, n_ctx))
        # nn.Conv1d's default init (fan_in = n_ctx · kernel), as the write-up's models used
        bound = 1 / math.sqrt(n_ctx * kernel)
        nn.init.uniform_(self.weight, -bound, bound)
        nn.init.uniform_(self.bias, -bound, bound)
        self.register_buffer("mask", torch.ones(n_ctx, n_ctx).tril(), persistent=False)

    def forward(self, x):
        B, h, T, d = x.shape
        # mask on every forward (not once at init): the optimizer would otherwise grow the upper triangle
        w = self.weight[:, :T, :T] * self.mask[:T, :T, None].to(self.weight.dtype)
        b = self.bias[:, :T]
        if self.kernel == 1:
            return torch.matmul(w[..., 0].to(x.dtype), x) + b[None, :, :, None].to(x.dtype)
        # tokens are channels, the hidden dim is the conv's length; one group per head. "same"
        # padding by hand (left (k-1)//2) as torch does, without its even-kernel warning
        left = (self.kernel - 1) // 2
        xp = F.pad(x.reshape(B, h * T, d), (left, self.kernel - 1 - left))
        w, b = w.reshape(h * T, T, self.kernel).to(x.dtype), b.reshape(h * T).to(x.dtype)
        y = F.conv1d(xp, w, b, groups=h)
        return y.view(B, h, T, d)


class TokenMixer(nn.Module):
    def __init__(self, c: MaskedMixer.Config):
        super().__init__()
        self.n_heads = max(1, c.n_heads)
        self.conv = MaskedConv(c.n_ctx, self.n_heads, c.kernel)
        if c.n_heads:  # per-head projections (one matrix, split), then an output projection
            self.in_proj = nn.Linear(c.d_model, c.d_model)
            self.out_proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x):
        B, T, D = x.shape
        if self.n_heads == 1 and not hasattr(self, "in_proj"):
            return self.conv(x[:, None])[:, 0]
        h = self.in_proj(x).view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)
        y = self.conv(h).transpose(1, 2).reshape(B, T, D)
        return self.out_proj(y)


class MixerBlock(nn.Module):
    def __init__(self, c: MaskedMixer.Config):
        super().__init__()
        self.seq_norm = nn.LayerNorm(c.d_model)
        self.mixer = TokenMixer(c)
        self.ff_norm = nn.LayerNorm(c.d_model)
        d_ff = c.d_ff or 4 * c.d_model
        self.ff = nn.Sequential(nn.Linear(c.d_model, d_ff), nn.GELU(), nn.Linear(d_ff, c.d_model))
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x):
        x = x + self.drop(self.mixer(self.seq_norm(x)))
        return x + self.drop(self.ff(self.ff_norm(x)))


class MaskedMixer(nn.Module):
    """Causal masked-mixer LM: `forward(input_ids (B, T)) -> logits (B, T, V)`, t predicts t+1.

    Same hooks as the llama decoder (`embed`, `forward_hidden`, `head`) so the estimator and the
    autoencoder can feed it their own inputs.
    """

    @dataclass
    class Config:
        vocab_size: int = 8000
        n_ctx: int = 1024
        d_model: int = 512
        n_layers: int = 16
        n_heads: int = 0  # 0: flat (one masked conv, no projections); h: multi-headed
        kernel: int = 1  # conv width along the hidden dim; 1 is the plain masked mixer
        d_ff: int | None = None  # None: 4 · d_model
        tie_embeddings: bool = False
        dropout: float = 0.0
        init_std: float = 0.02

        def __post_init__(self):
            if self.n_heads < 0 or (self.n_heads and self.d_model % self.n_heads):
                raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
            if self.kernel < 1:
                raise ValueError(f"kernel must be at least 1, not {self.kernel}")

    def __init__(self, config: MaskedMixer.Config):
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList([MixerBlock(c) for _ in range(c.n_layers)])
        self.norm = nn.LayerNorm(c.d_model)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=c.init_std)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward_hidden(self, x: torch.Tensor) -> torch.Tensor:
        """Blocks + final norm over embeddings x (B, T, d); causal."""
        if x.shape[1] > self.config.n_ctx:
            raise ValueError(
                f"sequence of {x.shape[1]} tokens is longer than the mixer's n_ctx {self.config.n_ctx}"
            )
        for block in self.layers:
            x = block(x)
        return self.norm(x)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V); position t predicts token t+1."""
        return self.head(self.forward_hidden(self.embed(input_ids)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
