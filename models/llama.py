"""A llama-style decoder in small direct torch: RMSNorm, RoPE, SwiGLU, SDPA causal attention.

Weights and math map 1:1 onto Hugging Face's `LlamaForCausalLM` (rotate-half RoPE, RMSNorm in fp32,
bias-free projections), so `entroweight export-hf` is a rename, not a conversion.

Hidden-level hooks (`embed`, `forward_hidden`, `head`) let other models (the entropy estimator)
use this decoder with their own inputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from .packing import Layout, attend, check_last, last_queries, rope_at


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # in fp32 as HF does: bf16 mean-of-squares loses the parity with the export
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_cache(head_dim: int, n_ctx: int, theta: float):
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    t = torch.arange(n_ctx, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)  # rotate-half layout, as HF Llama
    return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x, cos, sin):
    return (x * cos) + (rotate_half(x) * sin)


class Attention(nn.Module):
    def __init__(self, c: Llama.Config):
        super().__init__()
        self.n_heads, self.n_kv = c.n_heads, c.n_kv_heads or c.n_heads
        self.head_dim = c.d_model // c.n_heads
        self.q_proj = nn.Linear(c.d_model, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(c.d_model, self.n_kv * self.head_dim, bias=False)
        self.v_proj = nn.Linear(c.d_model, self.n_kv * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.d_model, bias=False)
        self.dropout = c.dropout

    def forward(self, x, cos, sin, mask=None, prefix=None, capture=None, last=None):
        """`prefix`: the (k, v) of shared positions before column 0 (each (1, n_kv, P, d)), read by
        every row; `capture`: a list that receives this call's (k, v) (to build such a prefix);
        `last`: the output of the last `last` columns alone (every column's keys and values)."""
        B, T, _ = x.shape
        Q = T if last is None else last
        q = self.q_proj(x[:, T - Q :]).view(B, Q, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos[..., T - Q :, :], sin[..., T - Q :, :]), apply_rope(k, cos, sin)
        if capture is not None:
            capture.append((k, v))
        if prefix is not None:
            pk, pv = prefix
            k = torch.cat([pk.to(k.dtype).expand(B, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.to(v.dtype).expand(B, -1, -1, -1), v], dim=2)
        if self.n_kv != self.n_heads:  # grouped-query attention: each kv head serves a run of q heads
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if last is not None:
            mask = last_queries(mask, Q, k.shape[2], x.device)
        y = attend(q, k, v, mask, dropout_p=self.dropout if self.training else 0.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, Q, -1))


class MLP(nn.Module):
    def __init__(self, c: Llama.Config):
        super().__init__()
        self.gate_proj = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.up_proj = nn.Linear(c.d_model, c.d_ff, bias=False)
        self.down_proj = nn.Linear(c.d_ff, c.d_model, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, c: Llama.Config):
        super().__init__()
        self.input_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.d_model, c.norm_eps)
        self.mlp = MLP(c)
        self.drop = nn.Dropout(c.dropout)

    def forward(self, x, cos, sin, mask=None, prefix=None, capture=None, last=None):
        """`last`: the output of the last `last` columns alone (the others' keys and values computed)."""
        y = self.self_attn(self.input_layernorm(x), cos, sin, mask, prefix, capture, last)
        x = x + self.drop(y) if last is None else x[:, -last:] + self.drop(y)
        return x + self.drop(self.mlp(self.post_attention_layernorm(x)))


class Llama(nn.Module):
    causal = True  # the value at t depends on the tokens up to t alone (scorers/causal_loss.py reads it)

    @dataclass
    class Config:
        vocab_size: int = 8000
        n_ctx: int = 1024
        d_model: int = 512
        n_layers: int = 16
        n_heads: int = 4
        n_kv_heads: int | None = None  # None: as n_heads (no grouped-query attention)
        d_ff: int = 2048
        tie_embeddings: bool = False
        rope_theta: float = 10000.0
        norm_eps: float = 1e-5
        dropout: float = 0.0
        init_std: float = 0.02
        # Attention skips the left padding and positions start at each row's first real token, so a
        # row's values do not depend on how many pads precede it (each pad sees only itself, and the
        # last one predicts the first real token from nothing): scorers may then cut the padding.
        # Off: the write-up's models, which attend to the pads they were trained with.
        mask_pads: bool = False

        def __post_init__(self):
            if self.d_model % self.n_heads:
                raise ValueError(f"d_model {self.d_model} is not a multiple of n_heads {self.n_heads}")
            if (self.d_model // self.n_heads) % 2:
                raise ValueError("RoPE needs an even head dimension (d_model / n_heads)")
            if self.n_kv_heads and self.n_heads % self.n_kv_heads:
                raise ValueError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")

    def __init__(self, config: Llama.Config):
        super().__init__()
        self.config = c = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.d_model)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.d_model, c.norm_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        if c.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        cos, sin = rope_cache(c.d_model // c.n_heads, c.n_ctx, c.rope_theta)
        # not in the state dict: derived from the config, and HF recomputes its own
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2's scaled init of the residual projections keeps deep stacks stable at start
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=c.init_std / math.sqrt(2 * c.n_layers))

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.config.init_std)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward_hidden(
        self,
        x: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        layout: Layout | None = None,
        capture: list | None = None,
        last: int | None = None,
    ) -> torch.Tensor:
        """Blocks + final norm over embeddings x (B, T, d); causal. `attention_mask` (B, T), 1 on real
        tokens, 0 on the left padding: read only when the model masks pads (`mask_pads`). `layout`:
        where the slots sit and what they attend to (models/packing.py: packed rows, or rows after a
        shared pad prefix); `capture`: a list receiving each layer's (k, v) (see `prefix_of`);
        `last`: the states of the last `last` columns alone, (B, last, d): the last block computes
        only the keys and values of the columns before them, which no output reads."""
        T = x.shape[1]
        check_last(last, T)
        offset = layout.offset if layout is not None and layout.positions is None else 0
        if offset + T > self.config.n_ctx:
            raise ValueError(f"sequence of {T} tokens is longer than the model's n_ctx {self.config.n_ctx}")
        prefix = [None] * len(self.layers)
        if layout is not None:
            (cos, sin), mask = rope_at(self.rope_cos, self.rope_sin, layout, T), layout.mask
            prefix = layout.prefix or prefix
        elif self.config.mask_pads and attention_mask is not None:
            cos, sin, mask = self._pad_masked(attention_mask.bool())
        else:
            cos, sin, mask = self.rope_cos[:T], self.rope_sin[:T], None
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        # a FlexAttention mask is not cut by query: every column is computed, the last ones kept
        cut = last if isinstance(mask, torch.Tensor | None) else None
        for i, (block, before) in enumerate(zip(self.layers, prefix, strict=True)):
            x = block(x, cos, sin, mask, before, capture, cut if i == len(self.layers) - 1 else None)
        return self.norm(x if last is None else x[:, -last:])

    def prefix_of(self, x: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer, the (k, v) of the embeddings x (1, P, d) at positions 0..P-1: a prefix that rows
        starting at position P may attend to (`Layout.prefix`, cut to their offset by `cut_prefix`)."""
        kv: list = []
        self.forward_hidden(x, capture=kv)
        return kv

    def _pad_masked(self, real: torch.Tensor):
        """RoPE tables at each token's position from its row's first real token (pads at 0) and the
        attention mask (B, 1, T, T): a real token sees the real tokens up to itself, a pad itself."""
        T = real.shape[1]
        pos = (real.cumsum(1) - 1).clamp(min=0)  # (B, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=real.device).tril()
        mask = (causal & real[:, None, :] & real[:, :, None]) | torch.eye(
            T, dtype=torch.bool, device=real.device
        )
        return self.rope_cos[pos][:, None], self.rope_sin[pos][:, None], mask[:, None]

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.lm_head(h)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, V); position t predicts token t+1."""
        return self.head(self.forward_hidden(self.embed(input_ids), attention_mask))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
