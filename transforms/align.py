"""Cross-tokenizer alignment by exact byte spans: model-token losses -> data-token values.

Each model token covers a byte span of the text; its loss is spread over those bytes and the bytes
are regrouped by the data tokens' spans:
- `sum`  (conserves information): a byte carries loss/len(span); a data token gets the sum over its
  bytes, so a window's total nats are unchanged;
- `mean` (the write-up): a byte carries its model token's whole loss; a data token gets the mean over
  its bytes (the write-up averages per character; on ASCII the two are the same).
Spans come from each token's raw bytes (cumulative byte counts), never from per-token decoding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .tokenizer import LoadedTokenizer

AGGREGATES = ("mean", "sum")


class AlignmentError(ValueError):
    """Text that a tokenizer cannot map back to exact bytes; the message says what to do."""


@dataclass
class AlignStats:
    """Alignment error of a set of windows; `add` accumulates, `as_dict` goes into the manifest."""

    bytes_total: int = 0
    bytes_uncovered: int = 0  # bytes no model token covers (invalid UTF-8 at a cut window edge)
    tokens_uncovered: int = 0  # data tokens with bytes but none covered: they get 0
    nats_model: float = 0.0  # sum of the model-token losses
    nats_regrouped: float = 0.0  # sum of the `sum`-regrouped data-token values
    max_rel_err: float = 0.0  # worst |regrouped - model| / model over windows (sum aggregate)
    windows: int = 0
    extra: dict = field(default_factory=dict)

    def add(self, other: AlignStats) -> None:
        for k in (
            "bytes_total",
            "bytes_uncovered",
            "tokens_uncovered",
            "nats_model",
            "nats_regrouped",
            "windows",
        ):
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.max_rel_err = max(self.max_rel_err, other.max_rel_err)

    def as_dict(self) -> dict:
        total = self.nats_model
        return {
            "bytes_total": self.bytes_total,
            "bytes_uncovered": self.bytes_uncovered,
            "tokens_uncovered": self.tokens_uncovered,
            "nats_model": round(self.nats_model, 4),
            "nats_regrouped": round(self.nats_regrouped, 4),
            "rel_err_total": abs(self.nats_regrouped - total) / total if total else 0.0,
            "max_rel_err": self.max_rel_err,
        }


def spans(nbytes: np.ndarray, offset: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) byte spans of consecutive tokens of these byte lengths."""
    ends = np.cumsum(np.asarray(nbytes, dtype=np.int64)) + offset
    return ends - nbytes, ends


def utf8_runs(data: bytes) -> list[tuple[int, int]]:
    """Maximal runs of valid UTF-8 as (start, end) byte offsets. A window cut mid-character leaves
    a partial character at an edge: those bytes fall between runs and are reported uncovered."""
    runs, pos = [], 0
    while pos < len(data):
        try:
            data[pos:].decode("utf-8")
        except UnicodeDecodeError as e:
            if e.start > 0:
                runs.append((pos, pos + e.start))
            pos += max(e.end, e.start + 1)
            continue
        runs.append((pos, len(data)))
        break
    return runs


def partly_covered(data_nbytes: np.ndarray, covered: list[tuple[int, int]]) -> np.ndarray:
    """Data tokens (bool per token) holding a byte outside every `covered` (start, end) byte span: a
    token holding part of a character cut at a row edge, which no model token can score."""
    data_nbytes = np.asarray(data_nbytes, dtype=np.int64)
    n_bytes = int(data_nbytes.sum())
    depth = np.zeros(n_bytes + 1, dtype=np.int64)
    for a, b in covered:
        depth[a] += 1
        depth[b] -= 1
    cum = np.concatenate([[0], np.cumsum(np.cumsum(depth)[:n_bytes] > 0)])
    d_start, d_end = spans(data_nbytes)
    return (cum[d_end] - cum[d_start]) < data_nbytes


def encode_exact(tok: LoadedTokenizer, text: str) -> tuple[np.ndarray, np.ndarray]:
    """Model ids of `text` and each token's byte count; their bytes concatenate to the UTF-8 text."""
    return encode_exact_batch(tok, [text])[0]


def encode_exact_batch(tok: LoadedTokenizer, texts: list[str]) -> list[tuple[np.ndarray, np.ndarray]]:
    """`encode_exact` over many texts in one `encode_batch` call.

    Special-token strings in the text ("<|endoftext|>") are encoded as plain text, never as specials:
    every LoadedTokenizer is set up so (schemas/tokenizer.py `text_as_data`)."""
    out = []
    for text, enc in zip(
        texts, tok.tokenizer.encode_batch_fast(texts, add_special_tokens=False), strict=True
    ):
        ids = np.asarray(enc.ids, dtype=np.int64)
        if tok.decode_bytes(ids) != text.encode("utf-8"):
            raise AlignmentError(
                f"the tokenizer {tok.path} does not reproduce the text byte for byte (a normalizer or a "
                "prefix space changes it); cross-tokenizer scoring needs a byte-level tokenizer "
                "(Llama 3, GPT-2, SmolLM2) or one without normalization"
            )
        out.append((ids, tok.token_nbytes[ids].astype(np.int64)))
    return out


def regroup(
    data_nbytes: np.ndarray,
    model_starts: np.ndarray,
    model_ends: np.ndarray,
    model_losses: np.ndarray,
    aggregate: str,
) -> tuple[np.ndarray, AlignStats]:
    """Data-token values (float64) from model-token losses given as byte spans in the data's bytes.

    Model spans must not overlap; bytes outside every model span are uncovered (0 for `sum`,
    left out of the mean for `mean`; a data token with no covered byte gets 0)."""
    if aggregate not in AGGREGATES:
        raise ValueError(f"aggregate must be one of {', '.join(AGGREGATES)}, not {aggregate!r}")
    data_nbytes = np.asarray(data_nbytes, dtype=np.int64)
    n_bytes = int(data_nbytes.sum())
    losses = np.asarray(model_losses, dtype=np.float64)
    lengths = model_ends - model_starts
    if (lengths <= 0).any() or (model_starts < 0).any() or (model_ends > n_bytes).any():
        raise AlignmentError("model token spans must be non-empty and inside the data's bytes")
    per_byte = np.zeros(n_bytes, dtype=np.float64)
    covered = np.zeros(n_bytes, dtype=np.float64)
    owner = np.repeat(np.arange(len(losses)), lengths)
    # byte positions of every model token, flattened without a Python loop
    first = np.repeat(np.cumsum(lengths) - lengths, lengths)
    positions = np.arange(int(lengths.sum()), dtype=np.int64) - first + np.repeat(model_starts, lengths)
    covered[positions] = 1.0
    spread = losses / lengths if aggregate == "sum" else losses
    per_byte[positions] = spread[owner]
    d_start, d_end = spans(data_nbytes)
    cum = np.concatenate([[0.0], np.cumsum(per_byte)])
    cum_cov = np.concatenate([[0.0], np.cumsum(covered)])
    totals = cum[d_end] - cum[d_start]
    n_cov = cum_cov[d_end] - cum_cov[d_start]
    if aggregate == "sum":
        values = totals
        regrouped = float(values.sum())
    else:
        values = np.divide(totals, n_cov, out=np.zeros_like(totals), where=n_cov > 0)
        share = np.zeros(n_bytes)
        share[positions] = (losses / lengths)[owner]
        regrouped = float(share.sum())
    nats = float(losses.sum())
    stats = AlignStats(
        bytes_total=n_bytes,
        bytes_uncovered=int(n_bytes - covered.sum()),
        tokens_uncovered=int(((data_nbytes > 0) & (n_cov == 0)).sum()),
        nats_model=nats,
        nats_regrouped=regrouped,
        max_rel_err=abs(regrouped - nats) / nats if nats else 0.0,
        windows=1,
    )
    return values, stats
