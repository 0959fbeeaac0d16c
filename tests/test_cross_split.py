"""cross_tokenizer on a document split over rows (`overflow: split`): the score stage hands the rows of
a document together (`continues`, from the data's `row_in_doc`), so the values of a split document's
rows equal those of the same text scored whole (float32 tolerance: rtol 1e-4, atol 1e-4 nats), and a
data token holding part of a character cut at a row edge, where one stays cut, is excluded (value 0,
weight 0), never weighted 1.0 from an entropy of 0. Real model: SmolLM2-135M (GGUF) on 1k-BPE data."""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_scorers_cross import smollm2_gguf

from entroweight.pipelines import run_stage
from entroweight.pipelines import score as score_module
from entroweight.pipelines.score import ScoreStage, segments
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.schemas.datadir import DataDir
from entroweight.schemas.weighted import excluded_mask, matrix, weights_matrix
from entroweight.scorers import make_scorer
from entroweight.transforms.tokenizer import load_tokenizer

N_CTX = 32
LONG = (
    "Le café de la gare ouvre à 6 h — 日本語のテキストも読めます 😀. "
    "Naïve façades, déjà vu; 東京の天気は晴れ 🌤️."
)
SHORT = "A short document: 短い."


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return load_tokenizer(tokenizer_dir)


@pytest.fixture(scope="module")
def scorer(tok):
    s = make_scorer("cross_tokenizer", model=str(smollm2_gguf()), aggregate="sum", dtype="fp32", batch_size=4)
    s.setup(tok)
    return s


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, tokenizer_dir):
    """LONG over several rows (split), SHORT in one, and SHORT again under the same id (kept)."""
    d = tmp_path_factory.mktemp("split_src")
    src = d / "docs.jsonl"
    rows = [{"id": "long", "text": LONG}, {"id": "short", "text": SHORT}, {"id": "short", "text": SHORT}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = d / "tokens"
    run_stage(TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX), out, progress=False)
    return out


def whole(scorer, tok, text: str) -> np.ndarray:
    """The values of `text` scored as one row as wide as the text."""
    ids = np.asarray(tok.tokenizer.encode(text, add_special_tokens=False).ids)[None, :]
    scored = scorer.score(ids, np.zeros(1, np.int64))
    assert not scored.excluded.any()
    return scored.values[0]


def real_values(table: pa.Table, column: str) -> list[np.ndarray]:
    m = matrix(table.column(column))
    return [m[r, n:] for r, n in enumerate(table.column("n_pad").to_numpy())]


def test_row_edges_cut_characters_in_the_data(tokens, tok):
    """The premise: the split cuts a multi-byte character between rows."""
    t = pq.read_table(DataDir(tokens).files[0])
    cut = 0
    for ids, n in zip(t.column("input_ids").to_pylist(), t.column("n_pad").to_pylist(), strict=True):
        try:
            tok.decode_bytes(ids[n:]).decode("utf-8")
        except UnicodeDecodeError:
            cut += 1
    assert cut >= 2 and t.column("row_in_doc").to_pylist().count(0) == 3 and t.num_rows >= 6


def test_split_document_scores_as_the_whole_text(tokens, tok, scorer, tmp_path):
    out = tmp_path / "scored"
    run_stage(ScoreStage(tokens, scorer), out, progress=False)
    t = pq.read_table(DataDir(out).files[0])
    row_in_doc = t.column("row_in_doc").to_numpy()
    starts = np.r_[np.flatnonzero(row_in_doc == 0), t.num_rows]
    values = real_values(t, "entropy")
    excluded = excluded_mask(t.column("excluded"), N_CTX)
    assert excluded is None or not excluded.any()  # every character of a split document is whole
    for (a, b), text in zip(zip(starts[:-1], starts[1:], strict=True), [LONG, SHORT, SHORT], strict=True):
        got = np.concatenate(values[a:b])
        np.testing.assert_allclose(got, whole(scorer, tok, text), rtol=1e-4, atol=1e-4)
    assert starts[1] > 3  # LONG is over several rows


def test_a_character_cut_at_a_row_edge_is_excluded_not_weighted_one(tokens, tok, scorer):
    """Rows scored on their own (no `continues`): the tokens holding part of a cut character get no
    value and are excluded; weighing gives them 0 (they weighed 1.0: entropy 0 is the row's minimum)."""
    from entroweight.transforms.weigh import WeighConfig, weigh

    t = pq.read_table(DataDir(tokens).files[0])
    ids, n_pad = matrix(t.column("input_ids")).astype(np.int64), t.column("n_pad").to_numpy()
    scored = scorer.score(ids, n_pad)
    assert scored.excluded.sum() >= 2
    for r in range(len(ids)):
        nb = tok.token_nbytes[ids[r, n_pad[r] :]]
        raw = tok.decode_bytes(ids[r, n_pad[r] :].tolist())
        ok = np.zeros(len(raw), bool)  # bytes inside a whole character
        pos = 0
        while pos < len(raw):
            try:
                raw[pos:].decode("utf-8")
                ok[pos:] = True
                break
            except UnicodeDecodeError as e:
                ok[pos : pos + e.start] = True
                pos += max(e.end, e.start + 1)
        ends = np.cumsum(nb)
        want = np.array([not ok[e - n : e].all() for n, e in zip(nb, ends, strict=True)])
        assert scored.excluded[r, n_pad[r] :].tolist() == want.tolist()
    assert (scored.values[scored.excluded] == 0).all()
    w = weigh(scored.values, n_pad, WeighConfig(), exclude=scored.excluded)
    assert (w[scored.excluded] == 0).all()


def test_a_segment_that_begins_inside_a_document_gets_the_row_before_as_context(
    tokens, tok, scorer, tmp_path, monkeypatch
):
    """Segments of 2 rows: LONG spans several; each segment's rows are scored after the row before
    them (the stage scores [previous row, rows] with `continues`), and its weights stay weights."""
    monkeypatch.setattr(score_module, "SEGMENT_TOKENS", 2 * N_CTX)
    monkeypatch.setattr(score_module, "MIN_SEGMENT_ROWS", 2)
    out = tmp_path / "scored"
    run_stage(ScoreStage(tokens, scorer), out, progress=False)
    t = pq.read_table(DataDir(out).files[0])
    src = pq.read_table(DataDir(tokens).files[0])
    ids, n_pad = matrix(src.column("input_ids")).astype(np.int64), src.column("n_pad").to_numpy()
    values = matrix(t.column("entropy"))
    # rows 2-3 of LONG are the second segment (after rows 0-1): scored after row 1, its left context
    context = scorer.score(ids[1:4], n_pad[1:4], continues=np.array([False, True, True]))
    np.testing.assert_allclose(values[2:4], context.values[1:], rtol=1e-4, atol=1e-4)
    w = weights_matrix(t.column("weight"))
    assert ((w >= 0) & (w <= 1)).all()


@pytest.mark.parametrize("seed", range(5))
def test_segments_hand_each_row_once_in_order_with_documents_whole(seed):
    """Property of the stage's segmenting: every row once, in order; a segment ends where a document
    starts (or is wholly inside one); one that begins inside a document has the row before it first."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 7, size=40)
    row_in_doc = np.concatenate([np.arange(n) for n in lengths]).astype(np.int32)
    n = len(row_in_doc)
    table = pa.table({"i": np.arange(n), "row_in_doc": row_in_doc})
    size = int(rng.integers(1, 9))
    got, prev_last = [], None
    for rows, n_context in segments(iter(table.to_batches(max_chunksize=size))):
        i = rows.column("i").to_numpy()
        assert n_context in (0, 1)
        body = i[n_context:]
        assert len(body) > 0
        if n_context:
            assert i[0] == prev_last and row_in_doc[body[0]] > 0
        else:
            assert row_in_doc[body[0]] == 0
        got += body.tolist()
        prev_last = body[-1]
    assert got == list(range(n))
