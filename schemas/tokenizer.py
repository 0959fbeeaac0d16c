"""Tokenizer facts: where a tokenizer lives, what makes its vocabulary usable, which tokens are its
specials, and the bytes each token stands for: the one place every layer asks.

Data is self-describing: a tokenized (or scored, or weighed) directory carries the `tokenizer.json`
that made it under `.tokenizer/` (hidden, so `datasets.load_dataset("parquet", data_dir=DIR)` reads
only data; its sha256 is in every file's metadata), and a checkpoint carries its own beside the
weights (`tokenizer.json`). `resolve_tokenizer_path` finds either, so no command needs --tokenizer
for data or checkpoints made here; a --tokenizer given still wins.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer

from entroweight import storage

TOKENIZER_FILE = "tokenizer.json"
# a data directory's copy of its tokenizer: hidden, like every other file that is not data
CARRIED_TOKENIZER = Path(".tokenizer") / TOKENIZER_FILE

# The specials a tokenizer we train gets (ids 0, 1, 2).
PAD, BOS, EOS = "<|pad|>", "<|bos|>", "<|eos|>"
# Specials we look for, in order, when a tokenizer was not trained by us (Llama 3, GPT-2, ...).
PAD_CANDIDATES = (PAD, "<|finetune_right_pad_id|>", "<pad>", "[PAD]", "<|padding|>")
EOS_CANDIDATES = (EOS, "<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "[SEP]")
BOS_CANDIDATES = (BOS, "<|begin_of_text|>", "<s>", "<bos>", "[CLS]")


class TokenizerError(ValueError):
    """A tokenizer file that cannot be used or found; the message says what to do."""


def _in_dir(d) -> Path | None:
    return next((p for p in (d / TOKENIZER_FILE, d / CARRIED_TOKENIZER) if p.is_file()), None)


def resolve_tokenizer_path(
    given: str | Path | None = None,
    beside: str | Path | Iterable[str | Path] = (),
    required: bool = True,
) -> Path | None:
    """The tokenizer.json to use: `given` (a file, or a directory holding one, directly or as its
    carried `.tokenizer/` copy), else the one carried by the first of `beside` (data directories or
    files, checkpoints) that has one. None when nothing is found and not `required`."""
    if given is not None:
        if storage.blank(given):
            raise TokenizerError(
                "the tokenizer is empty (an unset variable?): give a tokenizer.json or a directory holding one"
            )
        p = storage.path(given)  # local, or a URL (s3://...)
        found = _in_dir(p) if p.is_dir() else (p if p.is_file() else None)
        if found is None:
            raise TokenizerError(f"no tokenizer at {given}: give a tokenizer.json or a directory holding one")
        return found
    places = [beside] if isinstance(beside, (str, Path)) or hasattr(beside, "protocol") else list(beside)
    places = [storage.path(b) for b in places]
    for place in places:
        found = _in_dir(place if place.is_dir() else place.parent)
        if found is not None:
            return found
    if required:
        where = ", ".join(map(str, places)) or "nowhere"
        raise TokenizerError(f"no tokenizer.json in or beside {where}: pass --tokenizer PATH")
    return None


def text_as_data(tok: Tokenizer, where: str | Path) -> Tokenizer:
    """`tok`, set up to encode a document's text as data, never as control: the string of a special token
    in the text ("<|eos|>", "<|pad|>": web text about language models quotes them) is encoded as the
    ordinary text it is (the library's `encode_special_tokens`, transformers' `split_special_tokens`), so
    no special id appears among real tokens and the tokens' bytes are the text's UTF-8 bytes; and no
    truncation or padding (our stages cut and pad themselves). The flag is not saved with the file, so
    every tokenizer that encodes text is loaded through here (transforms/tokenizer.py, trainers/bpb.py).
    It costs nothing per document: the added-token matcher still runs and only drops the special matches.

    A tokenizer whose model itself turns a special's string into the special (a unigram vocabulary that
    holds its specials as pieces) is refused (TokenizerError): one probe encode of every special's string,
    quoted inside words."""
    tok.encode_special_tokens = True
    tok.no_truncation()
    tok.no_padding()
    specials = {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}
    if specials:
        probe = " ".join(f"x{s}y" for s in specials.values())
        hit = next((i for i in tok.encode(probe, add_special_tokens=False).ids if i in specials), None)
        if hit is not None:
            raise TokenizerError(
                f"{where}: its model encodes the text {specials[hit]!r} as the special token {hit}, so a "
                "document quoting it would become a control token; use a byte-level BPE (`entroweight "
                "train-tokenizer`, Llama 3, GPT-2) or a tokenizer whose model vocabulary does not hold its specials"
            )
    return tok


def check_vocab(vocab: dict[str, int], where: str | Path) -> None:
    """Refuse a vocabulary whose ids are not unique and dense (0..V-1): two strings on one id make text
    that no longer round-trips, and an id past the end reads outside every embedding table."""
    by_id: dict[int, str] = {}
    for token, idx in vocab.items():
        if idx in by_id:
            raise TokenizerError(
                f"{where}: tokens {by_id[idx]!r} and {token!r} share id {idx}; a tokenizer maps each id "
                "to one token. The file is corrupt: re-create it (`entroweight train-tokenizer`)"
            )
        by_id[idx] = token
    n = len(by_id)
    if n and (min(by_id) != 0 or max(by_id) != n - 1):
        gaps = sorted(set(range(n)) - set(by_id))[:3]
        outside = sorted(i for i in by_id if not 0 <= i < n)[:3]
        raise TokenizerError(
            f"{where}: the {n} token ids are not 0..{n - 1} (ids {outside} lie beyond the vocabulary, "
            f"{gaps} are missing). The file is corrupt: re-create it (`entroweight train-tokenizer`)"
        )


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in character (byte-level vocabularies
    spell tokens in these characters)."""
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
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _loaded(tokenizer: Tokenizer | str | Path) -> Tokenizer:
    if isinstance(tokenizer, Tokenizer):
        return tokenizer
    return Tokenizer.from_str(storage.path(tokenizer).read_text(encoding="utf-8"))


def vocab_size(tokenizer: Tokenizer | str | Path) -> int:
    """The ids a model of this tokenizer needs: its vocabulary with the added (special) tokens, of a
    `tokenizers` Tokenizer or the tokenizer.json at a path."""
    return _loaded(tokenizer).get_vocab_size(with_added_tokens=True)


def token_bytes(tokenizer: Tokenizer | str | Path) -> list[bytes]:
    """The raw bytes each token id stands for (b"" for special tokens), of a `tokenizers` Tokenizer or
    the tokenizer.json at a path: exact byte accounting without decoding."""
    tok = _loaded(tokenizer)
    decoder = json.loads(tok.to_str()).get("decoder") or {}
    byte_level = "ByteLevel" in json.dumps(decoder)
    to_byte = {c: b for b, c in bytes_to_unicode().items()} if byte_level else None
    specials = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    out = [b""] * vocab_size(tok)
    for piece, idx in tok.get_vocab(with_added_tokens=True).items():
        if piece in specials:
            continue
        if to_byte is not None and all(ch in to_byte for ch in piece):
            out[idx] = bytes(to_byte[ch] for ch in piece)
        elif piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:  # byte fallback
            out[idx] = bytes([int(piece[3:5], 16)])
        else:  # sentencepiece-style pieces
            out[idx] = piece.replace("\u2581", " ").encode("utf-8")
    return out
