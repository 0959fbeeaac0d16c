"""LZ78-family tokenizers: hand-computed dictionaries, exact WordPiece export, byte round trip, stage, training."""

from __future__ import annotations

import json
import random

import pytest
from click.testing import CliRunner

from entroweight.transforms import lz78
from entroweight.transforms.lz78 import N_BASE, LZ78Dict, to_tokenizers
from entroweight.transforms.train_tokenizer import corpus_texts, save_tokenizer

B = len(lz78.SPECIALS)  # id of byte 0


def byte_id(ch: str) -> int:
    return B + ord(ch)


def test_lz78_dictionary_and_greedy_encoding_by_hand():
    # "abababab" is one GPT-2 piece. LZ78: [a]+b -> "ab"; [ab]+a -> "aba"; [b]+a -> "ba"; full.
    d = lz78.train_lz78(["abababab"], N_BASE + 3)
    assert d.tokens[N_BASE:] == [b"ab", b"aba", b"ba"]
    assert d.parent[N_BASE:] == [byte_id("a"), N_BASE, byte_id("b")]
    # greedy longest match: aba | ba | ba | b
    assert d.encode("abababab") == [N_BASE + 1, N_BASE + 2, N_BASE + 2, byte_id("b")]
    # pieces: " ab" and "!" are separate pre-tokens; tokens never cross them
    assert d.encode("ab!ab") == [N_BASE, byte_id("!"), N_BASE]
    assert d.decode_bytes(d.encode("abababab")) == b"abababab"


def test_freqgated_keeps_the_most_used_entries_by_hand():
    # grown without the cap, the parse of "abababab" passes through ab twice, aba and ba once each:
    # one learned slot keeps "ab"
    one = lz78.train_lz78_freqgated(["abababab"], N_BASE + 1, rounds=1)
    assert one.tokens[N_BASE:] == [b"ab"]
    # round 2 starts from {ab}: a[ab]+a -> aba, [b]+a -> ba, [ba]+b -> bab; "ba" is used twice now
    two = lz78.train_lz78_freqgated(["abababab"], N_BASE + 1, rounds=2)
    assert two.tokens[N_BASE:] == [b"ba"]
    # with room for everything nothing is pruned, and the result is prefix-closed
    big = lz78.train_lz78_freqgated(["abababab abab"], N_BASE + 50)
    assert all(t[:-1] in big.tokens for t in big.tokens[N_BASE:])


def test_from_tokens_refuses_a_dictionary_that_is_not_prefix_closed():
    with pytest.raises(ValueError, match="does not extend a known token"):
        LZ78Dict.from_tokens(LZ78Dict().tokens + [b"abc"])
    with pytest.raises(ValueError, match="must exceed"):
        lz78.train([], 100)
    with pytest.raises(ValueError, match="unknown LZ78 algorithm"):
        lz78.train([], 1000, "lz77")


@pytest.fixture(scope="module")
def c4_texts(c4_path):
    return list(corpus_texts([str(c4_path)]))


@pytest.mark.parametrize("algorithm", lz78.ALGORITHMS)
def test_export_is_exact_and_round_trips_bytes(algorithm, c4_texts, wikitext_path, tmp_path):
    from entroweight.transforms.tokenizer import load_tokenizer

    d = lz78.train(c4_texts[:300], 2048, algorithm)
    assert len(d) == 2048
    save_tokenizer(to_tokenizers(d), tmp_path)
    tok = load_tokenizer(tmp_path)  # the tokenize stage's loader, unchanged
    assert tok.vocab_size == 2048 and (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.token_bytes[B:] == d.tokens[B:]  # exact bytes per token through the ByteLevel decoder
    rng = random.Random(0)
    fuzz = [
        "héllo 👋🏽 世界 мир  \n\n\t x\r\n",
        "a" * 200,
        " " * 70 + "x",
        "0123456789" * 9,
        "\x00\x7f\u0085\u2028",
    ]
    fuzz += [
        "".join(
            chr(
                rng.choice(
                    [rng.randrange(32, 0x2FF), rng.randrange(0x4E00, 0x4F00), 0x1F600 + rng.randrange(50)]
                )
            )
            for _ in range(200)
        )
        for _ in range(20)
    ]
    wiki = wikitext_path.read_text()
    # the whole C4 sample and 300 kB of WikiText once; a subset for the second algorithm (CPU budget)
    full = algorithm == "lz78-freqgated"
    docs = (c4_texts if full else c4_texts[:250]) + fuzz + [wiki[: 300_000 if full else 50_000]]
    got = [e.ids for e in tok.tokenizer.encode_batch_fast(docs, add_special_tokens=False)]
    for doc, ids in zip(docs, got, strict=True):
        assert ids == d.encode(doc)  # the export is the reference greedy longest match, exactly
        assert tok.decode_bytes(ids) == doc.encode("utf-8")
        assert int(tok.token_nbytes[ids].sum()) == len(doc.encode("utf-8"))


def test_cli_tokenize_stage_and_a_tiny_training_run(c4_path, tmp_path):
    import pyarrow.parquet as pq
    import torch

    from entroweight.pipelines import run_stage
    from entroweight.pipelines.tokenize import TokenizeStage
    from entroweight.trainers import TrainConfig, train
    from entroweight.trainers.bpb import eval_bpb
    from entroweight.workflows.cli.main import main

    torch.set_num_threads(1)
    tok_dir = tmp_path / "lz"
    args = ["train-tokenizer", str(c4_path), "--algorithm", "lz78-freqgated", "--vocab-size", "1024"]
    res = CliRunner().invoke(main, [*args, "--max-docs", "200", "--out", str(tok_dir)])
    assert res.exit_code == 0, res.output
    assert "1024 tokens" in res.output
    spec = json.loads((tok_dir / "tokenizer.json").read_text())
    assert spec["model"]["type"] == "WordPiece" and spec["model"]["continuing_subword_prefix"] == ""

    data = tmp_path / "tokenized"
    # one row per document (truncated), so that row i is text i
    stage = TokenizeStage([str(c4_path)], str(tok_dir), n_ctx=64, shard_docs=500, overflow="truncate")
    run_stage(stage, data, progress=False)
    table = pq.read_table(sorted(data.glob("*.parquet"))[0])
    texts = list(corpus_texts([str(c4_path)], 500))
    n_pad = table["n_pad"].to_pylist() if "n_pad" in table.column_names else None
    assert n_pad is not None
    # n_bytes is exact: a document that fits is counted in full
    fits = [i for i, ids in enumerate(table["input_ids"].to_pylist()) if n_pad[i] > 0]
    assert fits and all(table["n_bytes"][i].as_py() == len(texts[i].encode("utf-8")) for i in fits)

    out = tmp_path / "run"
    mc = {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64}
    train(
        TrainConfig(
            data=str(data),
            out=str(out),
            model_config=mc,
            steps=20,
            batch_size=8,
            lr=3e-3,
            log_every=5,
            tokenizer=str(tok_dir),
            quiet=True,
        )
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"]
    bpb = eval_bpb(out, max_bytes=20_000, n_ctx=64, stride=64, device="cpu")
    assert 0 < bpb["bpb"] < 16 and bpb["bytes"] > 19_000
