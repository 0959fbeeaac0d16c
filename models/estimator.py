"""The entropy estimator (embedding-augmented causal model) of the write-up.

An encoder (masked mixer or llama) reads the whole sequence; its last position is projected `down`
to a small embedding e (k values, e.g. 64 = d_enc / 4). A causal decoder predicts every token given
its left context *and* e. Since e saw the whole sequence, the decoder's dependence on e at a position
measures how much information the left context lacks there: the token's entropy (the scorers read it
out by occlusion, gradients or loss differences).

The decoder receives e in one of three ways (`injection`):

- `token`: `up(e)` is prepended as position 0 (x = up(e) ⊕ W_wte·ids); the decoder has n_ctx + 1
  positions and only the outputs at the real tokens are returned, so logits stay (B, T, V);
- `embedding`: e is concatenated to every token embedding along d_model (token embeddings are
  d_model − k wide, so the decoder keeps its width);
- `combination`: `up(e)` is added to every token embedding.

Scorer API (all differentiable in `emb`; gradients of logits w.r.t. emb give grad×input):

- `encode(input_ids) -> emb (B, k)`;
- `decode(input_ids, emb) -> logits (B, T, V)`, position t predicts token t+1 from tokens ≤ t and emb;
- `decode(input_ids, None)` is the occluded forward (x_o = 0 ⊕ W_wte·ids): a zero vector where the
  embedding enters; for `token` with a llama decoder position 0 is also masked from attention
  (implemented by leaving it out: with RoPE, attention depends on relative positions only, so
  this is exactly the masked computation). `up` has no bias, so for every other pairing
  `decode(ids, zeros)` equals `decode(ids, None)`;
- `forward(input_ids) = decode(input_ids, encode(input_ids))`, what the trainer calls.

Noise QAT (training mode only): `noise="embedding"` adds U(−q, q), q = 2^-4, to e; `"pre_down"` adds
U(−q, q), q = 2^-2, to the encoder state on a residual branch (h + U) just before `down`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from .llama import Llama
from .mixer import MaskedMixer
from .packing import Layout, after_prefix, check_last
from .quant import Q_EMBEDDING, Q_PRE_DOWN, sequence_nats, uniform_noise

PARTS = {"mixer": MaskedMixer, "llama": Llama}
INJECTIONS = ("token", "embedding", "combination")
NOISE = ("none", "embedding", "pre_down")


def build_part(kind: str, vocab_size: int, n_ctx: int, overrides: dict, init_std: float) -> nn.Module:
    """An encoder/decoder stack of `kind` from the shared sizes and its own config fields."""
    if kind not in PARTS:
        raise ValueError(f"unknown encoder/decoder kind {kind!r}; choose one of {', '.join(PARTS)}")
    cfg = {"init_std": init_std, **overrides, "vocab_size": vocab_size, "n_ctx": n_ctx}
    cfg["tie_embeddings"] = False  # the parts' embeddings/heads are swapped out below
    if kind == "llama":
        cfg.setdefault("d_ff", 4 * cfg.get("d_model", Llama.Config.d_model))  # the write-up's 4·d
    cls = PARTS[kind]
    return cls(cls.Config(**cfg))


class Bottleneck(nn.Module):
    """Encoder state h (B, d) -> embedding e (B, k), with the QAT noise in training mode."""

    def __init__(self, d_in: int, k: int, noise: str, q: float | None, init_std: float = 0.02):
        super().__init__()
        if noise not in NOISE:
            raise ValueError(f"unknown noise {noise!r}; choose one of {', '.join(NOISE)}")
        self.noise = noise
        self.q = q if q is not None else (Q_PRE_DOWN if noise == "pre_down" else Q_EMBEDDING)
        self.down = nn.Linear(d_in, k)
        nn.init.normal_(self.down.weight, std=init_std)
        nn.init.zeros_(self.down.bias)

    def forward(self, h):
        if self.training and self.noise == "pre_down":
            h = uniform_noise(h, self.q)
        e = self.down(h)
        if self.training and self.noise == "embedding":
            e = uniform_noise(e, self.q)
        return e


def last_state(encoder: nn.Module, input_ids: torch.Tensor, layout: Layout | None = None) -> torch.Tensor:
    """The encoder's final-norm hidden state at the last position (B, d): with left padding, the
    last real token, which has read the whole sequence. The last block computes that position alone."""
    return encoder.forward_hidden(encoder.embed(input_ids), layout=layout, last=1)[:, -1]


class EntropyEstimator(nn.Module):
    causal = False  # the decoder is causal, but its embedding saw the whole row

    @dataclass
    class Config:
        vocab_size: int = 8000
        n_ctx: int = 1024
        injection: str = "token"  # token | embedding | combination
        encoder: str = "llama"  # mixer | llama
        decoder: str = "llama"
        # each part's own Config fields (d_model, n_layers, n_heads, kernel, d_ff, ...)
        encoder_config: dict = field(default_factory=lambda: {"d_model": 256, "n_layers": 16})
        decoder_config: dict = field(default_factory=lambda: {"d_model": 512, "n_layers": 16})
        compression: int = 4  # embed_dim = encoder d_model // compression ...
        embed_dim: int | None = None  # ... unless given
        noise: str = "embedding"  # none | embedding (q = 2^-4 at e) | pre_down (q = 2^-2 before down)
        noise_q: float | None = None  # None: the mode's default
        init_std: float = 0.02

        def __post_init__(self):
            if self.injection not in INJECTIONS:
                raise ValueError(
                    f"unknown injection {self.injection!r}; choose one of {', '.join(INJECTIONS)}"
                )
            if self.noise not in NOISE:
                raise ValueError(f"unknown noise {self.noise!r}; choose one of {', '.join(NOISE)}")
            for name in ("encoder", "decoder"):
                if getattr(self, name) not in PARTS:
                    raise ValueError(f"{name} must be one of {', '.join(PARTS)}, not {getattr(self, name)!r}")
            if self.compression < 1:
                raise ValueError(f"compression must be at least 1, not {self.compression}")

    def __init__(self, config: EntropyEstimator.Config):
        super().__init__()
        self.config = c = config
        self.encoder = build_part(c.encoder, c.vocab_size, c.n_ctx, c.encoder_config, c.init_std)
        self.encoder.lm_head = nn.Identity()  # the encoder needs no vocabulary head
        d_enc = self.encoder.config.d_model
        self.embed_dim = k = c.embed_dim or d_enc // c.compression
        self.bottleneck = Bottleneck(d_enc, k, c.noise, c.noise_q, c.init_std)
        n_dec = c.n_ctx + 1 if c.injection == "token" else c.n_ctx
        self.decoder = build_part(c.decoder, c.vocab_size, n_dec, c.decoder_config, c.init_std)
        d_dec = self.decoder.config.d_model
        if c.injection == "embedding":
            if k >= d_dec:
                raise ValueError(f"embedding concatenation needs embed_dim {k} < decoder d_model {d_dec}")
            # token embeddings give up k channels to e, so the decoder keeps its width
            self.decoder.embed_tokens = nn.Embedding(c.vocab_size, d_dec - k)
            nn.init.normal_(self.decoder.embed_tokens.weight, std=c.init_std)
        else:
            self.up = nn.Linear(k, d_dec, bias=False)  # no bias: a zero embedding injects exactly zero
            nn.init.normal_(self.up.weight, std=c.init_std)

    # -- the scorer API
    def encode(self, input_ids: torch.Tensor, prefix: list | None = None) -> torch.Tensor:
        """The compressed embedding e (B, k) of each sequence (noised in training mode). With `prefix`
        (`encoder_prefix`), `input_ids` are the last columns of rows whose earlier columns are pads."""
        layout = None
        if prefix is not None:
            W = input_ids.shape[1]
            layout = after_prefix(prefix, self.config.n_ctx - W, W, input_ids.device)
        return self.bottleneck(last_state(self.encoder, input_ids, layout))

    def decode(
        self,
        input_ids: torch.Tensor,
        emb: torch.Tensor | None,
        prefix: list | None = None,
        last: int | None = None,
    ) -> torch.Tensor:
        """Logits (B, T, V) given the embedding; `emb=None` is the occluded forward (see module doc).
        With `prefix` (`decoder_prefix` of the same embedding, shared by every row), `input_ids` are
        the last columns of rows whose earlier columns are pads. `last`: the logits of the last
        `last` columns alone (B, last, V): the decoder's last block computes no other column's."""
        dec, mode = self.decoder, self.config.injection
        x = dec.embed(input_ids)
        B, T, _ = x.shape
        layout = None
        if prefix is not None:  # the decoder positions before the window: pads (+ the memory position)
            offset = self.config.n_ctx - T + self._memory_slots(emb)
            layout = after_prefix(prefix, offset, T, x.device)
        check_last(last, T)
        if mode == "token":
            if emb is None and self.config.decoder == "llama":  # position 0 masked = left out
                return dec.head(dec.forward_hidden(x, layout=layout, last=last))
            if prefix is not None:  # the memory position is in the prefix
                return dec.head(dec.forward_hidden(x, layout=layout, last=last))
            p = x.new_zeros(B, 1, x.shape[-1]) if emb is None else self.up(emb.to(x.dtype))[:, None]
            return dec.head(dec.forward_hidden(torch.cat([p, x], dim=1), last=last or T))
        if mode == "embedding":
            e = x.new_zeros(B, self.embed_dim) if emb is None else emb.to(x.dtype)
            x = torch.cat([x, e[:, None].expand(B, T, -1)], dim=-1)
        elif emb is not None:  # combination
            x = x + self.up(emb.to(x.dtype))[:, None]
        return dec.head(dec.forward_hidden(x, layout=layout, last=last))

    def _memory_slots(self, emb: torch.Tensor | None) -> int:
        """Decoder positions before the tokens: 1 for token injection (the embedding's), else 0."""
        removed = emb is None and self.config.decoder == "llama"
        return int(self.config.injection == "token" and not removed)

    def encoder_prefix(self, pad_id: int) -> list:
        """The encoder's prefix over a row of pads (models/packing.py): a row's pad columns, read once
        for every row (`encode(..., prefix=)`)."""
        pads = torch.full((1, self.config.n_ctx), pad_id, device=self.encoder.embed_tokens.weight.device)
        return self.encoder.prefix_of(self.encoder.embed(pads))

    def decoder_prefix(self, pad_id: int, emb: torch.Tensor | None) -> list:
        """The decoder's prefix over a row of pads decoded with `emb` (1, k) (None: occluded): shared
        by every row decoded with that same embedding (`decode(..., prefix=)`)."""
        dec, mode = self.decoder, self.config.injection
        weight = dec.embed_tokens.weight
        x = dec.embed(torch.full((1, self.config.n_ctx), pad_id, device=weight.device))
        if mode == "token" and self._memory_slots(emb):
            p = x.new_zeros(1, 1, x.shape[-1]) if emb is None else self.up(emb.to(x.dtype))[:, None]
            x = torch.cat([p, x], dim=1)
        elif mode == "embedding":
            e = x.new_zeros(1, self.embed_dim) if emb is None else emb.to(x.dtype)
            x = torch.cat([x, e[:, None].expand(1, x.shape[1], -1)], dim=-1)
        elif mode == "combination" and emb is not None:
            x = x + self.up(emb.to(x.dtype))[:, None]
        return dec.prefix_of(x)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, V); position t predicts token t+1 (with the whole sequence's embedding)."""
        return self.decode(input_ids, self.encode(input_ids))

    def sequence_bits(
        self, input_ids: torch.Tensor, pad_id: int | None, bits_per_value: int = 8
    ) -> torch.Tensor:
        """Amortized bits of each sequence (B,): k · bits_per_value for the stored embedding plus Σ token
        losses in bits (the write-up's compression view; divide by the sequence's bytes for BPB)."""
        nats = sequence_nats(self(input_ids), input_ids, pad_id)
        return nats / math.log(2) + self.embed_dim * bits_per_value

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())
