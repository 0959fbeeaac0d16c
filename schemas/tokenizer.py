"""Where a tokenizer lives, and what makes its vocabulary usable: the one place every layer asks.

Data is self-describing: a tokenized (or scored, or weighed) directory carries the `tokenizer.json`
that made it under `.tokenizer/` (hidden, so `datasets.load_dataset("parquet", data_dir=DIR)` reads
only data; its sha256 is in every file's metadata), and a checkpoint carries its own beside the
weights (`tokenizer.json`). `resolve_tokenizer_path` finds either, so no command needs --tokenizer
for data or checkpoints made here; a --tokenizer given still wins.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from entroweight import storage

TOKENIZER_FILE = "tokenizer.json"
# a data directory's copy of its tokenizer: hidden, like every other file that is not data
CARRIED_TOKENIZER = Path(".tokenizer") / TOKENIZER_FILE


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
