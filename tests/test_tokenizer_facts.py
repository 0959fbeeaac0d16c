"""Tokenizer facts have one owner (schemas/tokenizer.py): every former path gives the same token bytes."""

from __future__ import annotations

import hashlib

from tokenizers import AddedToken, Tokenizer, decoders, models

from entroweight.schemas.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    bytes_to_unicode,
    token_bytes,
)
from entroweight.trainers import prefix
from entroweight.trainers.bpb import START_CANDIDATES
from entroweight.transforms.tokenizer import load_tokenizer

# the Llama 3 tokenizer's token bytes as the two copies computed them before they became one
LLAMA3_BYTES_SHA256 = "c1d9951be4d888b20b77fb83d26ae0310cbaff2015cb0fb28b91939c0784b0ed"


def digest(tb: list[bytes]) -> str:
    return hashlib.sha256(b"".join(len(b).to_bytes(2, "big") + b for b in tb)).hexdigest()


def all_paths(path) -> list[list[bytes]]:
    """The tokens' bytes by every way in: the stages' LoadedTokenizer, the trainer's (prefix-smooth CE,
    T-FREE), and the owner's, from a file and from a Tokenizer."""
    return [
        load_tokenizer(path).token_bytes,
        prefix.token_bytes(path),
        token_bytes(path),
        token_bytes(Tokenizer.from_file(str(path))),
    ]


def test_byte_level_tokenizers_give_the_same_bytes_by_every_path(tokenizer_dir, llama3_tokenizer):
    for path in (tokenizer_dir / "tokenizer.json", llama3_tokenizer):
        first, *others = all_paths(path)
        assert all(o == first for o in others), path
        text = "Grüße, naïve café — 東京 🙂 tabs\tand\nlines"
        ids = Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids
        assert b"".join(first[i] for i in ids) == text.encode("utf-8")  # exact bytes, multi-byte splits too
    assert digest(all_paths(llama3_tokenizer)[0]) == LLAMA3_BYTES_SHA256


def test_sentencepiece_style_pieces_and_byte_fallback(tmp_path):
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<0xE2>": 3, "\u2581the": 4, "a": 5}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tok.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok.save(str(tmp_path / "tokenizer.json"))
    first, *others = all_paths(tmp_path / "tokenizer.json")
    assert all(o == first for o in others)
    assert first == [b"<unk>", b"", b"", b"\xe2", b" the", b"a"]  # specials have no bytes


def test_the_byte_level_alphabet_is_a_bijection_onto_printable_characters():
    m = bytes_to_unicode()
    assert sorted(m) == list(range(256)) and len(set(m.values())) == 256
    assert all(c.isprintable() and not c.isspace() for c in m.values())
    assert m[ord("A")] == "A" and m[ord(" ")] == "Ġ" and m[ord("\n")] == "Ċ"


def test_the_bpb_start_token_is_found_by_the_shared_names():
    # end-of-text names first (the document separator tokenize packs with), then begin-of-text ones
    assert START_CANDIDATES == EOS_CANDIDATES + BOS_CANDIDATES
