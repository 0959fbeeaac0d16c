"""The plain autoencoder: encoder -> one embedding -> decoder regenerates the whole sequence.

The decoder sees no tokens, only the embedding at every position: repeated (the mixer default: its
position-specific mixing weights break the symmetry), or "unrolled" (the llama default): position i
gets its own sliding window of the embedding, v[(i + j) mod D] for j < D/2, through one shared
projection, so attention does not face n_ctx identical inputs. The windows are unique only when
D ≥ n_ctx, so a smaller embedding is first enlarged to n_ctx by a linear map.

Trainer alignment: logits[:, t] reconstructs token t+1 (the trainer's next-token CE on logits[:, :-1]
vs input_ids[:, 1:]); token 0, a pad under left padding, is not reconstructed.

Same scorer-style API as the estimator: `encode(ids) -> emb (B, k)`, `decode(ids, emb) -> logits`
(ids only give the shape), `forward(ids) = decode(ids, encode(ids))`; QAT noise as the estimator's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .estimator import NOISE, PARTS, Bottleneck, build_part, last_state


class Unroll(nn.Module):
    """e (B, D) -> (B, T, d_out): position i projects the window e[(i + j) mod D], j < D // 2."""

    def __init__(self, d_emb: int, n_ctx: int, d_out: int, init_std: float):
        super().__init__()
        self.enlarge = nn.Linear(d_emb, n_ctx) if d_emb < n_ctx else None
        self.D = max(d_emb, n_ctx)
        self.window = self.D // 2
        self.proj = nn.Linear(self.window, d_out)
        for m in (self.enlarge, self.proj):
            if m is not None:
                nn.init.normal_(m.weight, std=init_std)
                nn.init.zeros_(m.bias)
        idx = (torch.arange(n_ctx)[:, None] + torch.arange(self.window)[None, :]) % self.D
        self.register_buffer("idx", idx, persistent=False)

    def forward(self, e: torch.Tensor, T: int) -> torch.Tensor:
        if self.enlarge is not None:
            e = self.enlarge(e)
        return self.proj(e[:, self.idx[:T]])  # one gather, one matmul: all windows at once


class Autoencoder(nn.Module):
    causal = False  # its one embedding saw the whole row

    @dataclass
    class Config:
        vocab_size: int = 8000
        n_ctx: int = 512
        encoder: str = "mixer"  # mixer | llama
        decoder: str = "mixer"
        encoder_config: dict = field(default_factory=lambda: {"d_model": 1024, "n_layers": 8})
        decoder_config: dict = field(default_factory=lambda: {"d_model": 1024, "n_layers": 8})
        compression: int = 1  # >1: down/up to d_enc // compression
        embed_dim: int | None = None
        unroll: bool | None = None  # None: unroll for a llama decoder, repeat for a mixer
        noise: str = "none"
        noise_q: float | None = None
        init_std: float = 0.02

        def __post_init__(self):
            for name in ("encoder", "decoder"):
                if getattr(self, name) not in PARTS:
                    raise ValueError(f"{name} must be one of {', '.join(PARTS)}, not {getattr(self, name)!r}")
            if self.noise not in NOISE:
                raise ValueError(f"unknown noise {self.noise!r}; choose one of {', '.join(NOISE)}")

    def __init__(self, config: Autoencoder.Config):
        super().__init__()
        self.config = c = config
        self.encoder = build_part(c.encoder, c.vocab_size, c.n_ctx, c.encoder_config, c.init_std)
        self.encoder.lm_head = nn.Identity()
        d_enc = self.encoder.config.d_model
        compressed = c.compression > 1 or c.embed_dim is not None
        self.embed_dim = k = (c.embed_dim or d_enc // c.compression) if compressed else d_enc
        if compressed or c.noise != "none":
            self.bottleneck = Bottleneck(d_enc, k, c.noise, c.noise_q, c.init_std)
        self.decoder = build_part(c.decoder, c.vocab_size, c.n_ctx, c.decoder_config, c.init_std)
        del self.decoder.embed_tokens  # the decoder reads the embedding only
        d_dec = self.decoder.config.d_model
        self.unroll = c.unroll if c.unroll is not None else c.decoder == "llama"
        if self.unroll:
            self.inject = Unroll(k, c.n_ctx, d_dec, c.init_std)
        else:
            self.inject = nn.Linear(k, d_dec) if k != d_dec else nn.Identity()

    def encode(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = last_state(self.encoder, input_ids)
        return self.bottleneck(h) if hasattr(self, "bottleneck") else h

    def decode(self, input_ids: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        T = input_ids.shape[1]
        if self.unroll:
            x = self.inject(emb, T)
        else:
            x = self.inject(emb)[:, None].expand(-1, T, -1)
        return self.decoder.head(self.decoder.forward_hidden(x))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V); logits[:, t] reconstructs token t+1 from the sequence's embedding."""
        return self.decode(input_ids, self.encode(input_ids))

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
