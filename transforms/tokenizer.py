"""Load a `tokenizers` tokenizer with what the stages need of it: its hash, specials and bytes per token."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from entroweight import storage
from entroweight.schemas.tokenizer import (
    BOS_CANDIDATES,
    CARRIED_TOKENIZER,
    EOS_CANDIDATES,
    PAD_CANDIDATES,
    TokenizerError,
    check_vocab,
    resolve_tokenizer_path,
    text_as_data,
    token_bytes,
    vocab_size,
)

from .writer import sha256_file, write_bytes_atomic


@dataclass
class LoadedTokenizer:
    """A tokenizer plus the facts the data contracts record about it."""

    path: Path
    tokenizer: Tokenizer
    sha256: str
    pad_id: int | None
    eos_id: int | None
    bos_id: int | None

    @property
    def vocab_size(self) -> int:
        return vocab_size(self.tokenizer)

    @cached_property
    def token_bytes(self) -> list[bytes]:
        """The raw bytes each token stands for (b"" for specials): exact byte accounting without decode."""
        return token_bytes(self.tokenizer)

    @cached_property
    def token_nbytes(self) -> np.ndarray:
        """Bytes per token id, int32: `token_nbytes[ids].sum()` is the UTF-8 size of the decoded text."""
        return np.fromiter((len(b) for b in self.token_bytes), dtype=np.int32, count=self.vocab_size)

    @cached_property
    def _byte_table(self) -> tuple[np.ndarray, np.ndarray]:
        """Every token's bytes end to end (uint8), and where each token's begin in it."""
        flat = np.frombuffer(b"".join(self.token_bytes), dtype=np.uint8)
        return flat, np.cumsum(self.token_nbytes, dtype=np.int64) - self.token_nbytes

    def decode_bytes(self, ids) -> bytes:
        """The bytes `ids` stand for, end to end (specials: none). cross_tokenizer decodes every data
        and model token on the host while the device waits: past ~150 tokens they are gathered from one
        table (500 tokens: 14 against 23 µs; 5,000: 75 against 238), shorter runs joined token by token
        (5 tokens: 0.6 against 7 µs)."""
        if len(ids) < 150:
            tb = self.token_bytes
            return b"".join(tb[i] for i in ids)
        ids = np.asarray(ids, dtype=np.int64)
        n = self.token_nbytes[ids].astype(np.int64)
        flat, begins = self._byte_table
        # output byte j of token k comes from its begin + (j − where token k's output starts)
        return flat[np.repeat(begins[ids] - (np.cumsum(n) - n), n) + np.arange(n.sum())].tobytes()

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
    vocab = tok.get_vocab(with_added_tokens=True)
    check_vocab(vocab, p)  # a corrupt file is refused here, before any stage claims its --out
    text_as_data(tok, p)  # a special's string in a document is text; we add specials ourselves
    return LoadedTokenizer(
        path=p.resolve() if storage.is_local(p) else p,
        tokenizer=tok,
        sha256=hashlib.sha256(raw).hexdigest(),
        pad_id=_find(vocab, PAD_CANDIDATES),
        eos_id=_find(vocab, EOS_CANDIDATES),
        bos_id=_find(vocab, BOS_CANDIDATES),
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
