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

from .packing import Layout, check_last


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

    def forward(self, x, prefix=None, last=None):
        """x (B, h, W, d) -> (B, h, W, d). `prefix` (1, h, P, d): the inputs of P positions before
        column 0, shared by every row (models/packing.py); the output is that of positions P..P+W-1,
        or with `last` of the last `last` of them alone (B, h, last, d)."""
        B, h, W, d = x.shape
        off = 0 if prefix is None else prefix.shape[2]
        if prefix is not None:
            x = torch.cat([prefix.to(x.dtype).expand(B, -1, -1, -1), x], dim=2)
        T = off + W
        if last is not None:  # the output rows of the last positions alone
            off, W = T - last, last
        # mask on every forward (not once at init): the optimizer would otherwise grow the upper triangle
        w = self.weight[:, off:T, :T] * self.mask[off:T, :T, None].to(self.weight.dtype)
        b = self.bias[:, off:T]
        if self.kernel == 1:
            return torch.matmul(w[..., 0].to(x.dtype), x) + b[None, :, :, None].to(x.dtype)
        # tokens are channels, the hidden dim is the conv's length; one group per head. "same"
        # padding by hand (left (k-1)//2) as torch does, without its even-kernel warning
        left = (self.kernel - 1) // 2
        xp = F.pad(x.reshape(B, h * T, d), (left, self.kernel - 1 - left))
        w, b = w.reshape(h * W, T, self.kernel).to(x.dtype), b.reshape(h * W).to(x.dtype)
        y = F.conv1d(xp, w, b, groups=h)
        return y.view(B, h, W, d)


class TokenMixer(nn.Module):
    def __init__(self, c: MaskedMixer.Config):
        super().__init__()
        self.n_heads = max(1, c.n_heads)
        self.conv = MaskedConv(c.n_ctx, self.n_heads, c.kernel)
        if c.n_heads:  # per-head projections (one matrix, split), then an output projection
            self.in_proj = nn.Linear(c.d_model, c.d_model)
            self.out_proj = nn.Linear(c.d_model, c.d_model)

    def forward(self, x, prefix=None, capture=None, last=None):
        """`prefix`: (the conv's input,) at shared positions before column 0; `capture`: a list that
        receives this call's (the conv's input,) (to build such a prefix); `last`: the output of the
        last `last` columns alone."""
        B, T, D = x.shape
        flat = self.n_heads == 1 and not hasattr(self, "in_proj")
        h = (
            x[:, None]
            if flat
            else self.in_proj(x).view(B, T, self.n_heads, D // self.n_heads).transpose(1, 2)
        )
        if capture is not None:
            capture.append((h,))
        y = self.conv(h, None if prefix is None else prefix[0], last)
        return y[:, 0] if flat else self.out_proj(y.transpose(1, 2).reshape(B, y.shape[2], D))


class MixerBlock(nn.Module):
    def __init__(self, c: MaskedMixer.Config):
        super().__init__()
        self.seq_norm = nn.LayerNorm(c.d_model)
        self.mixer = TokenMixer(c)
        self.ff_norm = nn.LayerNorm(c.d_model)
        d_ff = c.d_ff or 4 * c.d_model
        self.ff = nn.Sequential(nn.Linear(c.d_model, d_ff), nn.GELU(), nn.Linear(d_ff, c.d_model))
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, prefix=None, capture=None, last=None):
        """`last`: the output of the last `last` columns alone (every column is mixed into them)."""
        y = self.mixer(self.seq_norm(x), prefix, capture, last)
        x = x + self.drop(y) if last is None else x[:, -last:] + self.drop(y)
        return x + self.drop(self.ff(self.ff_norm(x)))


class MaskedMixer(nn.Module):
    """Causal masked-mixer LM: `forward(input_ids (B, T)) -> logits (B, T, V)`, t predicts t+1.

    Same hooks as the llama decoder (`embed`, `forward_hidden`, `head`) so the estimator and the
    autoencoder can feed it their own inputs.
    """

    causal = True  # the value at t depends on the tokens up to t alone

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

    def forward_hidden(
        self,
        x: torch.Tensor,
        layout: Layout | None = None,
        capture: list | None = None,
        last: int | None = None,
    ):
        """Blocks + final norm over embeddings x (B, T, d); causal. `layout`: rows after a shared
        prefix (models/packing.py; a mixer's weights are per position, so rows are never packed);
        `capture`: a list receiving each layer's conv input (see `prefix_of`); `last`: the states
        of the last `last` columns alone, (B, last, d): the last block mixes every column into
        them and computes nothing else."""
        if layout is not None and layout.positions is not None:
            raise ValueError("a masked mixer's weights are per position: its rows cannot be packed")
        offset = layout.offset if layout is not None else 0
        if offset + x.shape[1] > self.config.n_ctx:
            raise ValueError(
                f"sequence of {x.shape[1]} tokens is longer than the mixer's n_ctx {self.config.n_ctx}"
            )
        check_last(last, x.shape[1])
        prefix = (layout.prefix if layout is not None else None) or [None] * len(self.layers)
        for i, (block, before) in enumerate(zip(self.layers, prefix, strict=True)):
            x = block(x, before, capture, last if i == len(self.layers) - 1 else None)
        return self.norm(x)

    def prefix_of(self, x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, (the conv's input,) for the embeddings x (1, P, d) at positions 0..P-1: a prefix
        that rows starting at position P may read (`Layout.prefix`, cut by `cut_prefix`)."""
        captured: list = []
        self.forward_hidden(x, capture=captured)
        return captured

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V); position t predicts token t+1."""
        return self.head(self.forward_hidden(self.embed(input_ids)))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
