"""Train a byte-level BPE with a base tokenizer's normalizer and pre-tokenizer (the write-up: Llama 3's)."""

from __future__ import annotations

import collections
import itertools
import re
from collections.abc import Iterable, Iterator
from importlib.resources import files
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from entroweight import output, storage
from entroweight.schemas.tokenizer import BOS, EOS, PAD, TOKENIZER_FILE, resolve_tokenizer_path, text_as_data

from .sources import DocumentReader, SourceError, check_text_column, plan_inputs

SPECIALS = [PAD, BOS, EOS]
# The write-up's base, Llama 3's tokenizer: package data (data/README.md), installed with the package.
DEFAULT_BASE = Path(files(__package__) / "data" / "llama3")


def corpus_texts(
    sources: list[str],
    max_docs: int | None = None,
    text_column: str = "text",
    rejected: collections.Counter | None = None,
) -> Iterator[str]:
    """Texts of the valid documents of the sources, in a fixed order; the rejected ones are skipped,
    and counted by reason in `rejected` when given (for the caller to say so).
    Raises SourceError at the first read when no document can be read: a tokenizer trained on
    nothing would still save (its 256 bytes and specials) and exit 0."""
    texts = _texts(sources, max_docs, check_text_column(text_column), rejected)
    first = next(texts, None)
    if first is None:
        raise SourceError(
            f"no document could be read from {', '.join(sources)} (every row was rejected); "
            f"is the text in another column than {text_column!r}? pass --text-column NAME"
        )
    return itertools.chain([first], texts)


def rejects_said(rejected: collections.Counter) -> str:
    """`corpus_texts`' rejects as a caller says them: "3 document(s) rejected (1 empty, 2 invalid_json)"."""
    shown = ", ".join(f"{n} {reason}" for reason, n in sorted(rejected.items()))
    return f"{sum(rejected.values())} document(s) rejected ({shown})"


def _texts(sources: list[str], max_docs: int | None, text_column: str, rejected) -> Iterator[str]:
    n = 0
    for shard in plan_inputs(sources):
        reader = DocumentReader(shard, text_column)
        for batch in reader:
            for text in batch.column("text").to_pylist():
                yield text
                n += 1
                if max_docs and n >= max_docs:
                    return
        if rejected is not None:
            rejected.update(r["reason"] for r in reader.rejects)


def train_bpe(
    texts: Iterable[str],
    vocab_size: int,
    base: str | Path | None,
    min_frequency: int = 2,
    progress: bool = False,
) -> Tokenizer:
    """A BPE of exactly `vocab_size` tokens (specials included) over the 256 byte symbols."""
    if vocab_size < 256 + len(SPECIALS) + 1:
        raise ValueError(
            f"--vocab-size must exceed the 256 bytes and {len(SPECIALS)} specials, not {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    if base is not None:
        base_tok = Tokenizer.from_file(str(resolve_tokenizer_path(base)))
        if base_tok.normalizer is not None:
            tok.normalizer = base_tok.normalizer
        tok.pre_tokenizer = base_tok.pre_tokenizer
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


# the most tokens a trained tokenizer may have (Llama 3's is 128,256): the trainers allocate by the
# size asked, so 2**31 aborted the process in the BPE trainer's Rust code (a 141-GB allocation)
MAX_VOCAB_SIZE = 1 << 20


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    algorithm: str = "bpe",
    base: str | Path | None = None,
    progress: bool = False,
) -> Tokenizer:
    """A `vocab_size` tokenizer of `algorithm`: BPE on `base`'s pre-tokenizer (default DEFAULT_BASE),
    or an LZ78 dictionary (a related-work baseline, docs/baselines.md; `base` unused)."""
    if vocab_size > MAX_VOCAB_SIZE:
        raise ValueError(f"--vocab-size must be at most {MAX_VOCAB_SIZE:,}, not {vocab_size:,}")
    if algorithm == "bpe":
        tok = train_bpe(texts, vocab_size, base or DEFAULT_BASE, progress=progress)
    else:
        from . import lz78

        tok = lz78.to_tokenizers(lz78.train(texts, vocab_size, algorithm))
    return text_as_data(tok, f"the trained {algorithm} tokenizer")


#: train-tokenizer's output (entroweight.output's contract): tokenizer.sha256 marks it, and its record
#: (what it was trained from: `trained_from`), written first and sealed last. Kept: data tokenized and
#: models trained with the tokenizer depend on it, so one not trained from these very arguments and
#: files is refused unless --overwrite
TRAINED_FROM = ".train-tokenizer.json"
SHA256_FILE = "tokenizer.sha256"
TRAIN_TOKENIZER = output.declare(
    output.Output(
        "train-tokenizer",
        marks=(
            output.Mark(SHA256_FILE, re.compile(r"[0-9a-f]{64}  tokenizer\.json\n?")),
            output.Mark(TRAINED_FROM, (output.MADE_OF,)),
        ),
        files=(SHA256_FILE, TOKENIZER_FILE),
        record=TRAINED_FROM,
        leftovers=True,  # a tokenizer.json written before its sha256: taken back with --overwrite
        kept=True,
    )
)


def trained_from(
    sources: list[str], vocab_size: int, base, max_docs, algorithm: str, text_column: str
) -> dict | None:
    """What a tokenizer trained by `train-tokenizer` is made of (entroweight.output's made_of): the
    options, the source files as listed in the order read (with --max-docs the order decides which
    documents); the inputs' fingerprints: each source's size and mtime or an object's version, the
    base tokenizer's bytes, this code. None where a source is a hub dataset: its main branch may have
    moved, and nothing pins it here (never "the same": refused unless --overwrite)."""
    from entroweight import __version__

    from .sources import source_files

    files = source_files(list(sources))
    if any(stat is None for stat in files.values()):
        return None
    base_file = resolve_tokenizer_path(base or DEFAULT_BASE) if algorithm == "bpe" else None
    options = {"sources": list(files), "vocab_size": vocab_size, "base": base, "max_docs": max_docs}
    return {
        "options": {**options, "algorithm": algorithm, "text_column": text_column},
        "inputs": {
            "sources": [list(stat) for stat in files.values()],
            "base_sha256": storage.sha256(base_file) if base_file is not None else None,
            "code_version": __version__,
        },
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> tuple[Path, str]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / TOKENIZER_FILE
    tok.save(str(path))
    sha = storage.sha256(path)
    (out / SHA256_FILE).write_text(f"{sha}  {TOKENIZER_FILE}\n")
    return path, sha
