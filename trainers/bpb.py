"""Bits per byte on held-out text: BPB = Σ CE (nats) / (ln 2 · Σ bytes), exact UTF-8 bytes.

The text is tokenized as one stream, prefixed with the end-of-text token (a document start, as in
packed training data), and scored with a sliding window: the first window scores its n_ctx − 1
targets, each later one the next `stride` targets (at most n_ctx − 1: a window's first token is
context only), placed to end at its last target so every target has as much left context as a
window allows. Every token after the first is scored exactly once, so Σ bytes is simply the UTF-8
size of the text.
"""

from __future__ import annotations

import hashlib
import math
import sys
from importlib.resources import files
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer
from tqdm.auto import tqdm

from entroweight import storage
from entroweight.models.checkpoint import CheckpointError, a_model_of, load_checkpoint
from entroweight.options import device_here
from entroweight.schemas.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    TokenizerError,
    check_vocab,
    resolve_tokenizer_path,
    text_as_data,
    vocab_size,
)

from .losses import per_token_ce

# WikiText-2's test text: package data (data/README.md), installed with the package.
DEFAULT_TEXT = Path(files(__package__) / "data" / "wikitext" / "wiki.test.raw")
# The token a text is read after: the end-of-text token that separates documents in packed training
# data (the one tokenize found, by the same names), else a begin-of-text token.
START_CANDIDATES = EOS_CANDIDATES + BOS_CANDIDATES
# The evaluation text in clusters of this many bytes (the last one shorter): about one C4 document,
# so 200 kB of text is 100 clusters for the report's two-way intervals.
BLOCK_BYTES = 2000


def read_text(path: str | Path | None, max_bytes: int | None = None) -> str:
    """The text to score; refuses empty text and invalid UTF-8 (BPB counts exact UTF-8 bytes).

    A `max_bytes` cut inside a character drops that partial character (the result's `bytes` says
    how many were scored).
    """
    path = storage.path(path) if path else DEFAULT_TEXT  # a URL stays one (s3://...)
    if not path.is_file():
        what = "is not a regular file" if path.exists() else "does not exist"
        raise FileNotFoundError(
            f"no text file {path} (it {what}); name a text file (--text FILE; a workflow's eval.text), "
            "e.g. WikiText-2's wiki.test.raw"
        )
    if max_bytes is not None and max_bytes < 1:
        raise ValueError(f"--max-bytes must be at least 1, not {max_bytes}")
    raw = path.read_bytes()
    cut = max_bytes is not None and len(raw) > max_bytes
    raw = raw[:max_bytes] if cut else raw
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        if not (cut and e.start >= len(raw) - 3 and e.reason == "unexpected end of data"):
            raise ValueError(
                f"{path} is not valid UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}): bits per byte "
                "are counted on exact UTF-8 bytes; re-encode the file (e.g. iconv -t utf-8) or fix it"
            ) from None
        text = raw[: e.start].decode("utf-8")
    if not text:
        raise ValueError(
            f"{path} has no text to evaluate" + (f" in its first {max_bytes} bytes" if cut else "")
        )
    return text


def checkpoint_tokenizer(ckpt_dir, tokenizer=None, expect_sha: str | None = None, beside=()) -> Tokenizer:
    """`tokenizer`, else the one stored with a checkpoint (or carried by the data `beside`), checked
    against the checkpoint's sha256 and refused when its vocabulary is corrupt."""
    try:
        path = resolve_tokenizer_path(tokenizer, [*([ckpt_dir] if ckpt_dir else []), *beside])
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    raw = path.read_bytes()
    if expect_sha and hashlib.sha256(raw).hexdigest() != expect_sha:
        raise CheckpointError(f"{path} is not the tokenizer the checkpoint was trained with (sha256 differs)")
    tok = Tokenizer.from_str(raw.decode("utf-8"))
    check_vocab(tok.get_vocab(with_added_tokens=True), path)
    return text_as_data(tok, path)


def start_token(tok: Tokenizer) -> int | None:
    vocab = tok.get_vocab(with_added_tokens=True)
    return next((vocab[c] for c in START_CANDIDATES if c in vocab), None)


def encode(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False).ids


def token_block(tok: Tokenizer, text: str, n_bytes: int, block_bytes: int = BLOCK_BYTES) -> np.ndarray:
    """Per token of `encode(tok, text)`, the block of `block_bytes` bytes its text ends in."""
    enc = tok.encode(text, add_special_tokens=False)
    # the byte offset at which each character starts (offsets are in characters)
    byte_at = np.concatenate([[0], np.cumsum([len(c.encode("utf-8")) for c in text])])
    ends = byte_at[np.array([e for _, e in enc.offsets], dtype=np.int64)] if enc.offsets else np.zeros(0, int)
    last = max(0, -(-n_bytes // block_bytes) - 1)
    return np.minimum(np.maximum(ends - 1, 0) // block_bytes, last)


def blocks(ce: np.ndarray, block_of_target: np.ndarray, n_bytes: int, block_bytes: int = BLOCK_BYTES) -> dict:
    """{"bytes": [...], "nats": [...]} per block: Σ bytes = n_bytes, Σ nats = ce.sum()."""
    n_blocks = max(1, -(-n_bytes // block_bytes))
    nats = np.bincount(block_of_target, weights=ce, minlength=n_blocks)[:n_blocks]
    size = np.full(n_blocks, float(block_bytes))
    size[-1] = n_bytes - block_bytes * (n_blocks - 1)
    return {"bytes": size.tolist(), "nats": nats.tolist()}


def check_window(n_ctx: int, stride: int) -> None:
    if n_ctx < 2:
        raise ValueError(f"--n-ctx must be at least 2 (one context token and one target), not {n_ctx}")
    if not 0 < stride <= n_ctx:
        raise ValueError(f"--stride must be in 1..n_ctx ({n_ctx}), not {stride}")


def windows(n_tokens: int, n_ctx: int, stride: int):
    """(begin, end, first scored target index) per window over a stream of n_tokens tokens.

    Targets are indices 1..n_tokens-1 (index 0 is context only); each is scored exactly once. A
    window's first token is context only, so a window scores at most n_ctx − 1 new targets: with
    stride n_ctx consecutive windows share one token. Every window spans min(n_ctx, n_tokens) tokens
    ending at its last target (the last window too), so every target gets the most context it can.
    """
    check_window(n_ctx, stride)
    step = min(stride, n_ctx - 1)
    first, end = 1, min(n_ctx, n_tokens)
    while first < n_tokens:
        yield max(0, end - n_ctx), end, first
        first, end = end, min(end + step, n_tokens)


@torch.no_grad()
def score_stream(
    model, ids: list[int], n_ctx: int, stride: int, batch_size: int = 16, device="cpu", progress=None
) -> np.ndarray:
    """CE in nats of each of ids[1:] given its left context, by sliding windows (all of one length)."""
    seq = torch.tensor(ids, dtype=torch.long)
    wins = list(windows(len(ids), n_ctx, stride))
    out = np.zeros(max(len(ids) - 1, 0), np.float64)
    with tqdm(total=len(wins), unit="window", desc="eval-bpb", disable=not progress, file=sys.stderr) as bar:
        for i in range(0, len(wins), batch_size):
            group = wins[i : i + batch_size]
            x = torch.stack([seq[b:e] for b, e, _ in group]).to(device)
            ce = per_token_ce(model(x)[:, :-1], x[:, 1:]).double().cpu()
            for row, (b, e, first) in enumerate(group):
                out[first - 1 : e - 1] = ce[row, first - b - 1 :].numpy()  # target t sits at column t-b-1
            bar.update(len(group))
    return out


def eval_bpb(
    ckpt_dir,
    text_path=None,
    n_ctx: int | None = None,
    stride: int | None = None,
    tokenizer=None,
    max_bytes: int | None = None,
    batch_size: int = 16,
    device: str = "auto",
    allow_pickle: bool = False,
    embed_format: str | None = None,
    progress: bool = False,
) -> dict:
    """{bpb, nats, bytes, tokens, n_ctx, stride, text} of a checkpoint on `text_path` (default WikiText-2 test).

    Estimator / autoencoder checkpoints report amortized bits: `bpb` = (embedding bits + Σ token bits)
    / bytes, each window's embedding stored in `embed_format` (default float8_e4m3fn; refused for a
    model with no embedding), split into `embed_bpb` + `token_bpb`.
    `progress`: a bar of windows on stderr.
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1, not {batch_size}")
    try:  # the one device check of every command, before anything is read
        dev = device_here(device)
    except ValueError as e:
        raise ValueError(f"--device {e}") from None
    text = read_text(text_path, max_bytes)  # refusals about the text come before loading the model
    model, config = load_checkpoint(ckpt_dir, map_location=str(dev), allow_pickle=allow_pickle)
    tok = checkpoint_tokenizer(ckpt_dir, tokenizer, config.get("tokenizer_sha256"))
    model_ctx = config["model"].get("n_ctx") or config.get("n_ctx")
    n_ctx = n_ctx if n_ctx is not None else model_ctx
    if model_ctx and n_ctx > model_ctx:
        raise ValueError(f"--n-ctx {n_ctx} is longer than the model's n_ctx {model_ctx}")
    amortized = all(hasattr(model, a) for a in ("encode", "decode", "embed_dim"))
    if embed_format is not None and not amortized:  # it would change nothing: said, not ignored
        raise ValueError(
            f"--embed-format is the format of an estimator's or autoencoder's embedding; {ckpt_dir} holds "
            f"{a_model_of(config['kind'])}, which has none"
        )
    embed_format = embed_format or "float8_e4m3fn"
    # estimator / autoencoder: each window's embedding is paid for, so windows overlap by only the
    # one context token by default; an LM defaults to half-overlapping windows
    if stride is None:
        stride = max(1, n_ctx - 1 if amortized else n_ctx // 2)
    check_window(n_ctx, stride)
    stride = min(stride, n_ctx - 1)  # what `windows` steps by (a window's first token is context only)
    start = start_token(tok)
    ids = ([start] if start is not None else []) + encode(tok, text)
    n_bytes = len(text.encode("utf-8"))
    if start is None:  # no start token: the first token is context only, and its bytes leave the count
        n_bytes -= len(tok.decode(ids[:1]).encode("utf-8"))
    if len(ids) < 2 or n_bytes < 1:
        raise ValueError(
            f"the text ({n_bytes} bytes) has no token to predict after the first; give more text"
        )
    if amortized:
        return _amortized(
            model, ids, n_ctx, stride, batch_size, dev, n_bytes, embed_format, text_path, progress
        )
    ce = score_stream(model, ids, n_ctx, stride, batch_size, dev, progress)
    nats = float(ce.sum())
    text_blocks = token_block(tok, text, n_bytes)
    block_of = text_blocks[len(text_blocks) - len(ce) :]  # the targets: the text's last len(ce) tokens
    return {
        "bpb": nats / (math.log(2) * n_bytes),
        "nats": nats,
        "blocks": blocks(ce, block_of, n_bytes),
        "bytes": n_bytes,
        "tokens": len(ids) - 1,
        "n_ctx": n_ctx,
        "stride": stride,
        "text": str(text_path or DEFAULT_TEXT),  # as given: Path() would turn s3:// into s3:/
    }


def _amortized(model, ids, n_ctx, stride, batch_size, dev, n_bytes, fmt, text_path, progress) -> dict:
    from entroweight.models.quant import embedding_bits, quantize

    n_windows = sum(1 for _ in windows(len(ids), n_ctx, stride))
    nats = score_stream(
        lambda x: model.decode(x, quantize(model.encode(x), fmt)),
        ids,
        n_ctx,
        stride,
        batch_size,
        dev,
        progress,
    ).sum()
    embed_bits = n_windows * embedding_bits(model.embed_dim, fmt)
    token_bpb = nats / (math.log(2) * n_bytes)
    return {
        "bpb": token_bpb + embed_bits / n_bytes,
        "token_bpb": token_bpb,
        "embed_bpb": embed_bits / n_bytes,
        "amortized": True,
        "embed_format": fmt,
        "windows": n_windows,
        "nats": float(nats),
        "bytes": n_bytes,
        "tokens": len(ids) - 1,
        "n_ctx": n_ctx,
        "stride": stride,
        "text": str(text_path or DEFAULT_TEXT),  # as given: Path() would turn s3:// into s3:/
    }


def unigram_bpb(data_paths, tokenizer, text_path=None, max_bytes: int | None = None) -> dict:
    """The baseline a model must beat: token frequencies of the training data (add-one smoothed) as
    the prediction for every token of the text."""
    from .data import WeightedTokens

    paths = [data_paths] if isinstance(data_paths, (str, Path)) else list(data_paths)
    try:
        path = resolve_tokenizer_path(tokenizer, paths)
    except TokenizerError as e:
        raise CheckpointError(str(e)) from None
    tok = checkpoint_tokenizer(None, path)
    V = vocab_size(tok)
    counts = np.ones(V, dtype=np.float64)
    # the data's ids must be this tokenizer's: counted under another, each id would be another token
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    for item in WeightedTokens(data_paths, batch_size=256, shuffle=False, columns=(), tokenizer_sha256=sha):
        ids = item["input_ids"][item["mask"]].numpy()
        counts += np.bincount(ids, minlength=V)[:V]
    logp = np.log(counts / counts.sum())
    text = read_text(text_path, max_bytes)
    ids = np.array(encode(tok, text))
    nats = float(-logp[ids].sum())
    n_bytes = len(text.encode("utf-8"))
    return {"bpb": nats / (math.log(2) * n_bytes), "nats": nats, "bytes": n_bytes, "tokens": len(ids)}
