"""LZ78-family tokenizers: a byte-level LZ78 dictionary, greedy longest-match encoding, a `tokenizers` export.

Vocabulary: the 3 specials, then all 256 single bytes, then learned tokens; every learned token is a
known token extended by one byte, so the dictionary is prefix-closed (a trie) and greedy longest match
is a walk down the trie.

Pieces: like our BPE, tokens never cross a GPT-2 pre-token (`ByteLevel` regex split) and pieces are cut
into chunks of at most MAX_PIECE bytes. Both training and encoding see the same pieces; the chunking
keeps the `tokenizers` WordPiece export (which tries the longest substring first, cost ~piece length
squared) linear in the document, and it is part of the definition, so the export is exact, not close.

Export: a WordPiece model with an empty continuation prefix *is* greedy longest-match-first over the
piece, so `load_tokenizer` reads it unchanged (token_bytes/n_bytes through the ByteLevel decoder).
`encode` here is the reference the tests hold the export to.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import regex
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from entroweight.schemas.tokenizer import BOS, EOS, PAD, bytes_to_unicode

SPECIALS = [PAD, BOS, EOS]
N_BASE = len(SPECIALS) + 256  # ids below this are specials and single bytes
MAX_PIECE = 32
ALGORITHMS = ("lz78", "lz78-freqgated")
# GPT-2's split, as `pre_tokenizers.ByteLevel(use_regex=True)` applies it
GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")
_BYTE_CHAR = bytes_to_unicode()


def pieces(text: str) -> Iterator[bytes]:
    """The byte pieces a document is encoded in: GPT-2 pre-tokens, cut every MAX_PIECE bytes."""
    for m in GPT2_SPLIT.finditer(text):
        b = m.group().encode("utf-8")
        for i in range(0, len(b), MAX_PIECE):
            yield b[i : i + MAX_PIECE]


class LZ78Dict:
    """The dictionary as a trie: `child[(id << 8) | byte] -> id`; `tokens[id]` the bytes of each id.

    Ids are vocabulary ids; the root (empty string) is -1 and its children are the single bytes.
    """

    ROOT = -1

    def __init__(self):
        self.tokens: list[bytes] = [b""] * len(SPECIALS) + [bytes([b]) for b in range(256)]
        self.parent: list[int] = [self.ROOT] * N_BASE
        self.child: dict[int, int] = {(self.ROOT << 8) | b: len(SPECIALS) + b for b in range(256)}

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, byte: int) -> int:
        idx = len(self.tokens)
        self.tokens.append(self.tokens[parent] + bytes([byte]) if parent != self.ROOT else bytes([byte]))
        self.parent.append(parent)
        self.child[(parent << 8) | byte] = idx
        return idx

    def encode_piece(self, piece: bytes) -> list[int]:
        """Greedy longest match: walk down the trie as far as the bytes go, emit, restart at the root."""
        out, i, n, child = [], 0, len(piece), self.child
        while i < n:
            node = child[(self.ROOT << 8) | piece[i]]
            i += 1
            while i < n and ((node << 8) | piece[i]) in child:
                node = child[(node << 8) | piece[i]]
                i += 1
            out.append(node)
        return out

    def encode(self, text: str) -> list[int]:
        return [t for p in pieces(text) for t in self.encode_piece(p)]

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return b"".join(self.tokens[i] for i in ids)

    @classmethod
    def from_tokens(cls, tokens: list[bytes]) -> LZ78Dict:
        """Rebuild from `tokens` (specials and bytes first); refuses a list that is not prefix-closed."""
        d = cls()
        if tokens[len(SPECIALS) : N_BASE] != d.tokens[len(SPECIALS) :]:
            raise ValueError("an LZ78 vocabulary starts with the specials and the 256 bytes in order")
        known = {t: i for i, t in enumerate(d.tokens) if t}
        for t in tokens[N_BASE:]:
            if t[:-1] not in known or t in known:
                raise ValueError(f"token {t!r} does not extend a known token by one byte")
            known[t] = d.add(known[t[:-1]], t[-1])
        return d


def _lz78_parse(d: LZ78Dict, piece: bytes, capacity: int, counts: list[int] | None) -> None:
    """LZ78 over one piece: follow the longest known phrase, add it + the next byte as a new entry
    (while there is room), continue after that byte. `counts[id]` += 1 for every phrase through id."""
    i, n, child = 0, len(piece), d.child
    while i < n:
        node = LZ78Dict.ROOT
        while i < n and ((node << 8) | piece[i]) in child:
            node = child[(node << 8) | piece[i]]
            i += 1
            if counts is not None:
                counts[node] += 1
        if i < n and len(d) < capacity:
            d.add(node, piece[i])
            if counts is not None:
                counts.append(1)
            i += 1


def train_lz78(texts: Iterable[str], vocab_size: int) -> LZ78Dict:
    """Classic LZ78 (Ziv & Lempel 1978) over the pieces until the dictionary holds `vocab_size` tokens."""
    _check_size(vocab_size)
    d = LZ78Dict()
    for text in texts:
        for p in pieces(text):
            _lz78_parse(d, p, vocab_size, None)
        if len(d) >= vocab_size:
            break
    return d


def train_lz78_freqgated(
    texts: Iterable[str], vocab_size: int, grow: float = 4.0, rounds: int = 2
) -> LZ78Dict:
    """Frequency-gated LZ78: grow past the budget, keep only the most used entries, repeat.

    Plain LZ78 freezes once full, so its dictionary is whatever the first documents happened to add.
    Following the frequency-gated LZ78 tokenizer of the weezl/nanochat LZ78 ablations (Idehpour 2026,
    "only frequent patterns kept", sparse codes remapped dense) and LZW-GC's use counts (DonaldFoss/lzwgc:
    rarely matched entries are replaced by new ones), each round parses the corpus letting the dictionary
    grow to `grow`x the learned budget while counting how many phrases pass through each entry, then prunes
    to the budget by count. An ancestor is counted on every phrase through its descendants and was made
    first, so ranking by (count desc, age) keeps the dictionary prefix-closed. Later rounds re-grow from
    the survivors, so freed slots go to patterns that proved frequent across the whole corpus.
    """
    _check_size(vocab_size)
    texts = list(texts)
    d = LZ78Dict()
    cap = N_BASE + int((vocab_size - N_BASE) * grow)
    for _ in range(rounds):
        counts = [0] * len(d)
        for text in texts:
            for p in pieces(text):
                _lz78_parse(d, p, cap, counts)
        learned = sorted(range(N_BASE, len(d)), key=lambda i: (-counts[i], i))[: vocab_size - N_BASE]
        d = LZ78Dict.from_tokens(d.tokens[:N_BASE] + [d.tokens[i] for i in sorted(learned)])
    return d


def _check_size(vocab_size: int) -> None:
    if vocab_size < N_BASE + 1:
        raise ValueError(
            f"--vocab-size must exceed the 256 bytes and {len(SPECIALS)} specials, not {vocab_size}"
        )


def train(texts: Iterable[str], vocab_size: int, algorithm: str = "lz78") -> LZ78Dict:
    if algorithm == "lz78":
        return train_lz78(texts, vocab_size)
    if algorithm == "lz78-freqgated":
        return train_lz78_freqgated(texts, vocab_size)
    raise ValueError(f"unknown LZ78 algorithm {algorithm!r}; choose one of {', '.join(ALGORITHMS)}")


def to_tokenizers(d: LZ78Dict) -> Tokenizer:
    """The dictionary as a `tokenizers` WordPiece: same pieces, greedy longest-match-first, exact."""
    vocab = {s: i for i, s in enumerate(SPECIALS)}
    for i, t in enumerate(d.tokens[len(SPECIALS) :], start=len(SPECIALS)):
        vocab["".join(_BYTE_CHAR[b] for b in t)] = i
    # every byte is a token, so WordPiece never needs its unknown token; it must name one, though
    tok = Tokenizer(
        models.WordPiece(
            vocab, unk_token=PAD, continuing_subword_prefix="", max_input_chars_per_word=MAX_PIECE
        )
    )
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            # byte-level chars are one per byte and never a newline, so this cuts every MAX_PIECE bytes
            pre_tokenizers.Split(Regex(f".{{1,{MAX_PIECE}}}"), behavior="isolated"),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return tok
