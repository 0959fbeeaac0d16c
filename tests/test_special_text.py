"""Document text is data, never control: a special token's string quoted in a document ("<|eos|>") is
encoded as ordinary text on every path that encodes text (tokenize, eval-bpb, cross-tokenizer
alignment, the LZ78 reference), for every tokenizer the project ships or trains: no special id among
the real tokens, and the tokens' bytes are exactly the text's UTF-8 bytes."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import ByteLevelBPETokenizer, Tokenizer, decoders, models, pre_tokenizers, trainers

from entroweight.pipelines import run_stage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas.tokenizer import (
    BOS_CANDIDATES,
    EOS_CANDIDATES,
    PAD_CANDIDATES,
    TokenizerError,
)
from entroweight.trainers import bpb
from entroweight.transforms import lz78
from entroweight.transforms.align import encode_exact_batch
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.transforms.train_tokenizer import DEFAULT_BASE, corpus_texts, save_tokenizer, train_tokenizer
from entroweight.workflows.cli.main import main

# the GPT-2 files of the shared real data (tests/data/README.md), when this checkout sits beside it
GPT2 = next(
    (
        d / "data" / "tokenizers" / "gpt2"
        for d in (p / "shared" for p in Path(__file__).resolve().parents)
        if (d / "data" / "tokenizers" / "gpt2" / "vocab.bpe").is_file()
    ),
    None,
)


def algorithms() -> list[str]:
    """Every kind `train-tokenizer --algorithm` trains, read from the CLI itself."""
    opt = next(p for p in main.commands["train-tokenizer"].params if p.name == "algorithm")
    return list(opt.type.choices)


TOKENIZERS = ["llama3", *(f"trained-{a}" for a in algorithms()), "gpt2"]


def specials_of(tok: Tokenizer) -> dict[int, str]:
    return {i: t.content for i, t in tok.get_added_tokens_decoder().items() if t.special}


def hostile_texts(tok: Tokenizer) -> list[str]:
    """Documents quoting every special of `tok` and every special name the project looks for: alone,
    glued to words and to each other, at the start and the end, inside multi-byte text."""
    names = sorted({*specials_of(tok).values(), *PAD_CANDIDATES, *EOS_CANDIDATES, *BOS_CANDIDATES})
    return [
        "".join(names),
        " ".join(names),
        *(f"{s}" for s in names[:8]),
        *(f"The model emits {s} at the end: x{s}y, «{s}» 東京{s}🙂" for s in names),
        "Special tokens like <|pad|>, <|bos|> and <|eos|> mark padding, starts and ends of text.",
        "<|eos|><|eos|>\n<|pad|> <|bos|>tail",
    ]


@pytest.fixture(scope="module")
def tokenizer_paths(tmp_path_factory, c4_path) -> dict[str, Path]:
    """name -> tokenizer.json of every tokenizer the project ships or trains (the trained ones on C4 plus
    documents that quote the specials: hostile training text as well)."""
    root = tmp_path_factory.mktemp("special-tokenizers")
    c4 = list(corpus_texts([str(c4_path)], max_docs=300))
    quoting = hostile_texts(Tokenizer.from_file(str(DEFAULT_BASE / "tokenizer.json")))
    out = {"llama3": DEFAULT_BASE / "tokenizer.json"}
    for a in algorithms():
        out[f"trained-{a}"], _ = save_tokenizer(train_tokenizer(c4 + quoting, 700, a), root / a)
    if GPT2 is not None:
        g = ByteLevelBPETokenizer.from_file(str(GPT2 / "encoder.json"), str(GPT2 / "vocab.bpe"))
        g.add_special_tokens(["<|endoftext|>"])
        (root / "gpt2").mkdir()
        g.save(str(root / "gpt2" / "tokenizer.json"))
        out["gpt2"] = root / "gpt2" / "tokenizer.json"
    return out


@pytest.fixture(params=TOKENIZERS)
def tok_path(request, tokenizer_paths) -> Path:
    if request.param not in tokenizer_paths:
        pytest.skip("the shared GPT-2 files (../shared/data/tokenizers/gpt2) are not beside this checkout")
    return tokenizer_paths[request.param]


def assert_text(ids, tb: list[bytes], specials: dict[int, str], text: str) -> None:
    ids = list(ids)
    assert not [specials[i] for i in ids if i in specials], text  # no special id among real tokens
    assert b"".join(tb[i] for i in ids) == text.encode("utf-8"), text  # exactly the text's bytes


def test_the_stages_tokenizer_encodes_specials_as_text(tok_path):
    tok = load_tokenizer(tok_path)
    specials = specials_of(tok.tokenizer)
    texts = hostile_texts(tok.tokenizer)
    for text, enc in zip(
        texts, tok.tokenizer.encode_batch_fast(texts, add_special_tokens=False), strict=True
    ):
        assert_text(enc.ids, tok.token_bytes, specials, text)


@pytest.mark.parametrize("pack", [False, True], ids=["left-pad", "packed"])
def test_tokenize_records_the_texts_bytes_and_no_special_among_real_tokens(tok_path, tmp_path, pack):
    tok = load_tokenizer(tok_path)
    if tok.pad_id is None:
        pytest.skip(f"tokenize refuses {tok_path.parent.name}: it has no pad token")
    texts = hostile_texts(tok.tokenizer)
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    run_stage(TokenizeStage([str(src)], str(tok_path), n_ctx=64, pack=pack), tmp_path / "out", progress=False)
    table = pq.read_table(tmp_path / "out")
    ids = table.column("input_ids").to_pylist()
    n_pad = table.column("n_pad").to_pylist()
    real = np.concatenate([np.asarray(r[p:], dtype=np.int64) for r, p in zip(ids, n_pad, strict=True)])
    assert sum(table.column("n_bytes").to_pylist()) == sum(len(t.encode("utf-8")) for t in texts)
    specials = np.array(sorted(specials_of(tok.tokenizer)))
    if pack:  # the only special among real tokens: one eos after each document
        assert set(real[np.isin(real, specials)].tolist()) <= {tok.eos_id}
        assert int((real == tok.eos_id).sum()) == len(texts)
    else:
        assert not np.isin(real, specials).any()
        by_doc: dict[str, int] = {}
        for d, nb in zip(
            table.column("doc_id").to_pylist(), table.column("n_bytes").to_pylist(), strict=True
        ):
            by_doc[d] = by_doc.get(d, 0) + nb
        assert by_doc == {f"d{i}": len(t.encode("utf-8")) for i, t in enumerate(texts)}


def test_eval_bpb_encodes_specials_as_text(tok_path):
    tok = bpb.checkpoint_tokenizer(None, tok_path)
    tb = load_tokenizer(tok_path).token_bytes
    for text in hostile_texts(tok):
        assert_text(bpb.encode(tok, text), tb, specials_of(tok), text)


def test_cross_tokenizer_alignment_encodes_specials_as_text(tok_path):
    tok = load_tokenizer(tok_path)
    texts = hostile_texts(tok.tokenizer)
    for text, (ids, nbytes) in zip(texts, encode_exact_batch(tok, texts), strict=True):
        assert_text(ids, tok.token_bytes, specials_of(tok.tokenizer), text)
        assert int(nbytes.sum()) == len(text.encode("utf-8"))


@pytest.mark.parametrize("algorithm", [a for a in algorithms() if a in lz78.ALGORITHMS])
def test_lz78_reference_and_export_agree_on_quoted_specials(tokenizer_paths, algorithm):
    tok = load_tokenizer(tokenizer_paths[f"trained-{algorithm}"])
    ref = lz78.LZ78Dict.from_tokens(tok.token_bytes)
    for text in hostile_texts(tok.tokenizer):
        ids = tok.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == ref.encode(text), text
        assert_text(ids, tok.token_bytes, specials_of(tok.tokenizer), text)


def test_a_tokenizer_whose_model_makes_specials_from_text_is_refused(tmp_path, c4_path):
    """A unigram vocabulary holding its specials as pieces turns the text "<|pad|>" into the pad id even
    with specials split off: refused up front, naming the special, by every loader."""
    t = Tokenizer(models.Unigram())
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    specials = ["<|pad|>", "<|bos|>", "<|eos|>"]
    t.train_from_iterator(
        corpus_texts([str(c4_path)], max_docs=100),
        trainers.UnigramTrainer(vocab_size=400, special_tokens=specials, unk_token="<|pad|>"),
    )
    t.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match=r"encodes the text '<\|(pad|bos|eos)\|>' as the special token"):
        load_tokenizer(tmp_path / "tokenizer.json")
    with pytest.raises(TokenizerError, match="as the special token"):
        bpb.checkpoint_tokenizer(None, tmp_path / "tokenizer.json")
