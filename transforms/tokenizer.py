"""Load a `tokenizers` tokenizer with what the stages need of it: its hash, specials and bytes per token."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from entroweight import storage
from entroweight.schemas.tokenizer import (
    CARRIED_TOKENIZER,
    TokenizerError,
    check_vocab,
    resolve_tokenizer_path,
)

from .writer import sha256_file, write_bytes_atomic

PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# Specials we look for, in order, when a tokenizer was not trained by us (Llama 3, GPT-2, ...).
PAD_CANDIDATES = (PAD, "<|finetune_right_pad_id|>", "<pad>", "[PAD]", "<|padding|>")
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
BOS_CANDIDATES = (BOS, "<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


def _bytes_to_unicode() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted: character -> byte."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


@dataclass
class LoadedTokenizer:
    """A tokenizer plus the facts the data contracts record about it."""

    path: Path
    tokenizer: Tokenizer
    sha256: str
    pad_id: int | None
    eos_id: int | None
    bos_id: int | None
    _special_ids: set[int] = field(default_factory=set, repr=False)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The raw bytes each token stands for (b"" for specials): exact byte accounting without decode."""
        spec = json.loads(self.tokenizer.to_str())
        byte_level = "ByteLevel" in json.dumps(spec.get("decoder") or {})
        inverse = _bytes_to_unicode() if byte_level else None
        out: list[bytes] = [b""] * self.vocab_size
        for tok, idx in self.tokenizer.get_vocab(with_added_tokens=True).items():
            if idx in self._special_ids:
                continue
            if inverse is not None and all(ch in inverse for ch in tok):
                out[idx] = bytes(inverse[ch] for ch in tok)
            elif tok.startswith("<0x") and tok.endswith(">") and len(tok) == 6:  # byte fallback
                out[idx] = bytes([int(tok[3:5], 16)])
            else:  # sentencepiece-style pieces
                out[idx] = tok.replace("\u2581", " ").encode("utf-8")
        return out

    @cached_property
    def token_nbytes(self) -> np.ndarray:
        """Bytes per token id, int32: `token_nbytes[ids].sum()` is the UTF-8 size of the decoded text."""
        return np.fromiter((len(b) for b in self.token_bytes), dtype=np.int32, count=self.vocab_size)

    def decode_bytes(self, ids) -> bytes:
        tb = self.token_bytes
        return b"".join(tb[i] for i in ids)

    def describe(self) -> dict:
        return {
            "tokenizer": str(self.path),
            "tokenizer_sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "pad_id": self.pad_id,
            "eos_id": self.eos_id,
        }


def _find(vocab: dict[str, int], candidates) -> int | None:
    return next((vocab[c] for c in candidates if c in vocab), None)


def load_tokenizer(path: str | Path) -> LoadedTokenizer:
    """The tokenizer at `path` (a tokenizer.json, or a directory carrying one; local or a URL)."""
    p = resolve_tokenizer_path(path)
    return tokenizer_from_bytes(p.read_bytes(), p)


def tokenizer_from_bytes(raw: bytes, p) -> LoadedTokenizer:
    """A tokenizer from its JSON bytes (`p` names where they came from): stages carry the bytes to their
    workers, which may share no disk with the driver."""
    p = storage.path(p)
    try:
        tok = Tokenizer.from_str(raw.decode("utf-8"))
    except Exception as e:  # the Rust error is terse; say which file and what to do
        raise TokenizerError(
            f"{p} is not a valid tokenizers JSON file ({e}); re-create it with `entroweight train-tokenizer`"
        ) from e
    # Our stages add specials themselves; a post-processor adding BOS would break byte accounting.
    tok.no_truncation()
    tok.no_padding()
    vocab = tok.get_vocab(with_added_tokens=True)
    check_vocab(vocab, p)  # a corrupt file is refused here, before any stage claims its --out
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    return LoadedTokenizer(
        path=p.resolve() if storage.is_local(p) else p,
        tokenizer=tok,
        sha256=hashlib.sha256(raw).hexdigest(),
        pad_id=_find(vocab, PAD_CANDIDATES),
        eos_id=_find(vocab, EOS_CANDIDATES),
        bos_id=_find(vocab, BOS_CANDIDATES),
        _special_ids={vocab[s] for s in specials if s in vocab},
    )


def data_tokenizer(data_dir: str | Path, sha256: str, given: str | Path | None = None) -> Path | None:
    """A data directory's tokenizer: `given` (--tokenizer) or else the copy the directory carries; refused
    when its sha256 is not the one in the shards' metadata. None when there is neither (data made before
    directories carried their tokenizer)."""
    path = resolve_tokenizer_path(given, [data_dir], required=False)
    if path is not None and (found := sha256_file(path)) != sha256:
        what = f"--tokenizer {given}" if given is not None else f"{path}, the copy {data_dir} carries,"
        raise TokenizerError(
            f"{what} is not the tokenizer of {data_dir} (sha256 {found[:12]}… vs {sha256[:12]}… in its "
            "shards' metadata): pass the tokenizer the data was tokenized with"
        )
    return path


def carry_tokenizer(path: str | Path, out_dir: str | Path) -> Path:
    """Copy a tokenizer into an output directory (`.tokenizer/tokenizer.json`), atomically, unless the
    same bytes are there already: the directory then needs no --tokenizer downstream."""
    dest = storage.path(out_dir) / str(CARRIED_TOKENIZER)
    raw = storage.path(path).read_bytes()
    if not dest.is_file() or dest.read_bytes() != raw:
        write_bytes_atomic(raw, dest)
    return dest
