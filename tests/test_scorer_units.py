# ruff: noqa: F811 - pytest fixtures imported from test_weighted_inputs
"""Scores that mean what they say (issue 17): the start token a model declares, each scorer's unit in
the file metadata (and `rescaled` refusing other units), the write-up's raw cosine weight, packed
documents scored apart with their separator excluded, and NaN/inf refused instead of weighed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_scorers_cross import smollm2_gguf
from test_trainer_fixtures import make_weighted
from test_weighted_inputs import model, scored, tokens  # noqa: F401 - fixtures

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.stage import StageFailed
from entroweight.schemas import METADATA_KEY, read_file_metadata
from entroweight.scorers import Scored, Scorer, hf, make_scorer
from entroweight.transforms.tokenizer import load_tokenizer
from entroweight.transforms.weigh import NonFiniteScores, WeighConfig, weigh
from entroweight.workflows.cli.main import main


# -- defect 3: the start token is what the model declares
def test_bare_llama3_tokenizer_starts_with_begin_of_text(llama3_tokenizer):
    tok = load_tokenizer(llama3_tokenizer)
    start = hf.start_token(llama3_tokenizer.parent, tok)
    assert (start.id, start.token) == (128000, "<|begin_of_text|>")  # was <|end_of_text|> (128001)
    assert start.source.startswith("fallback")  # a bare tokenizer.json declares nothing


def test_declared_start_token_wins(llama3_tokenizer, tmp_path):
    spec = json.loads(llama3_tokenizer.read_text())
    # the hub's Llama 3 tokenizer.json: a post-processor that inserts <|begin_of_text|>
    bos = {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [bos, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [bos, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {
            "<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000], "tokens": ["<|begin_of_text|>"]}
        },
    }
    d = tmp_path / "hub"
    d.mkdir()
    (d / "tokenizer.json").write_text(json.dumps(spec))
    start = hf.start_token(d, load_tokenizer(d / "tokenizer.json"))
    assert (start.id, start.source) == (128000, "post_processor")
    # a tokenizer_config.json that adds its bos_token: that token, whatever its name
    d2 = tmp_path / "cfg"
    d2.mkdir()
    shutil.copy(llama3_tokenizer, d2 / "tokenizer.json")
    (d2 / "tokenizer_config.json").write_text(
        json.dumps({"add_bos_token": True, "bos_token": "<|end_of_text|>"})
    )
    start = hf.start_token(d2, load_tokenizer(d2 / "tokenizer.json"))
    assert (start.token, start.source) == ("<|end_of_text|>", "add_bos_token")


def test_smollm2_declares_none_and_the_choice_is_recorded(tokenized_dir, tokenizer_dir, tmp_path):
    resolved = hf.resolve_model(str(smollm2_gguf()))
    start = hf.start_token(resolved, hf.model_tokenizer(resolved))
    # its config's bos_token_id is the chat turn's <|im_start|>, never added to text: the fallback
    assert (start.token, start.source) == ("<|endoftext|>", "fallback: end-of-text token by name")
    data = _one_shard(tokenized_dir, tmp_path, rows=2)
    opts = {"model": str(smollm2_gguf()), "aggregate": "sum", "dtype": "fp32", "context": 64}
    stage = ScoreStage(data, "cross_tokenizer", opts, tokenizer=str(tokenizer_dir / "tokenizer.json"))
    run_stage(stage, tmp_path / "out", progress=False)
    meta = read_file_metadata(next((tmp_path / "out").glob("part-*.parquet")))
    assert meta["start_token"] == {"id": 0, "token": "<|endoftext|>", "source": start.source}
    assert meta["unit"] == "nats"


# -- defect 4: units
def test_each_scorer_declares_its_unit(tmp_path):
    from entroweight.scorers.excess_loss import ExcessLossScorer
    from entroweight.scorers.grad_input import GradInputScorer
    from entroweight.scorers.occlusion import OcclusionScorer

    assert make_scorer("causal_loss", model=str(smollm2_gguf())).unit == "nats"
    occ = OcclusionScorer.__new__(OcclusionScorer)
    occ.metric = "l1"
    assert occ.unit == "l1_minmax"
    occ.metric = "cosine"
    assert occ.unit == "cosine_distance"
    assert GradInputScorer.unit == "grad_input_minmax"
    assert ExcessLossScorer.unit == "nats_difference"


def _with_unit(src: Path, dst: Path, unit: str | None) -> Path:
    make_weighted(src, dst, files=1)
    for f in dst.glob("*.parquet"):
        t = pq.read_table(f)
        meta = dict(t.schema.metadata)
        md = json.loads(meta[METADATA_KEY])
        md.pop("unit", None)
        if unit:
            md["unit"] = unit
        meta[METADATA_KEY] = json.dumps(md).encode()
        pq.write_table(t.replace_schema_metadata(meta), f)
    return dst


@pytest.mark.parametrize("unit", ["l1_minmax", "cosine_distance", None])
def test_rescaled_refuses_scores_not_in_nats(tokenized_dir, tokenizer_dir, tmp_path, unit):
    data = _with_unit(tokenized_dir, tmp_path / "data", unit)
    out = tmp_path / "run"
    r = CliRunner().invoke(
        main,
        [
            "train",
            str(data),
            "--loss",
            "rescaled",
            "--out",
            str(out),
            "--steps",
            "2",
            "--tokenizer",
            str(tokenizer_dir),
        ],
    )
    assert r.exit_code == 2, r.output
    assert "needs entropies in nats" in r.output and "Traceback" not in r.output
    assert not out.exists() or not any(out.iterdir())


def test_raw_weighting_is_the_write_ups_cosine_weight():
    m = np.array([[0.0, 0.2, 0.9, 1.4, 2.0]], dtype=np.float32)  # 1 - cos in [0, 2]
    w = weigh(m, np.array([1]), WeighConfig(method="raw"))
    np.testing.assert_allclose(w, [[0.0, 0.8, 0.1, 0.0, 0.0]], atol=1e-7)  # pad 0; 1 - m clipped to [0, 1]


@pytest.mark.parametrize("front", ["score causal_loss", "score excess_loss", "weigh", "workflow"])
def test_raw_weighting_of_a_loss_is_refused_by_every_front_end(tokenized_dir, scored, tmp_path, front):
    """`raw` reads values as they are, clipped to [0, 1]: on a loss (nats, nats_difference) nearly
    every weight is 0. Refused before anything is written, by every front end that weighs (exit 2,
    one line; a workflow with its key path); a distance in [0, 2] is still taken. Before (hostile
    audit): 74,495 real tokens weighed 0, exit 0, until `train` refused the data."""
    from entroweight.workflows.spec import SpecError, parse_workflow

    out = tmp_path / "out"
    gguf = str(smollm2_gguf())
    if front == "workflow":
        step = {
            "name": "a",
            "scorer": "causal_loss",
            "options": {"model": gguf},
            "weighting": {"method": "raw"},
        }
        spec = {"run_dir": str(tmp_path / "run"), "sources": ["a.jsonl"], "scores": [step],
                "tokenizer": {"train": {"vocab_size": 512}}}  # fmt: skip
        with pytest.raises(SpecError, match=r"scores\[0\]\.weighting\.method: method: raw weighs the values"):
            parse_workflow(spec)
        step["scorer"], step["options"] = "occlusion", {"metric": "cosine"}
        step["checkpoint_from"] = "e"
        spec["models"] = [{"name": "e", "kind": "estimator", "config": {}}]
        parse_workflow(spec)  # cosine distances: the write-up's raw weight
        return
    if front == "weigh":  # causal_loss values, in nats
        argv = ["weigh", str(scored)]
    else:
        scorer = front.split()[1]
        argv = ["score", str(tokenized_dir), "--scorer", scorer, "--model", gguf]
        argv += ["--reference", gguf] if scorer == "excess_loss" else []
    r = CliRunner().invoke(main, [*argv, "--weighting", "raw", "--out", str(out)])
    assert r.exit_code == 2 and "--weighting raw weighs the values as they are" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1 and not out.exists()


# -- defect 5: packed rows
def test_packed_documents_are_scored_apart_and_the_separator_excluded(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    enc = lambda t: tok.tokenizer.encode(t, add_special_tokens=False).ids  # noqa: E731
    a, b = enc("The cat sat on the mat."), enc("Stock markets fell sharply on Monday.")
    T = len(a) + 1 + len(b) + 2
    packed = np.full(T, tok.pad_id)
    packed[2:] = [*a, tok.eos_id, *b]
    alone = np.full(T, tok.pad_id)
    alone[-len(b) :] = b
    ids = np.stack([packed, alone])
    n_pad = np.array([2, T - len(b)])
    s = make_scorer("cross_tokenizer", model=str(smollm2_gguf()), aggregate="sum", dtype="fp32")
    s.setup(tok)
    scored = s.score(ids, n_pad)
    v = scored.values
    sep = 2 + len(a)
    # the second document reads exactly what it reads alone: the start token, not "mat.<eos>"
    np.testing.assert_allclose(v[0, sep + 1 :], v[1, -len(b) :], rtol=1e-4, atol=1e-4)
    assert v[0, sep + 1] > 0.5  # the first token is predicted from the start token only
    assert v[0, sep] == 0.0
    excluded = scored.excluded
    assert excluded[0].tolist() == [i == sep for i in range(T)] and not excluded[1].any()
    w = weigh(v, n_pad, WeighConfig(), exclude=excluded)
    assert w[0, sep] == 0.0  # the separator weighs 0 (it weighed 1.000: the row's minimum entropy)
    real = np.r_[2:sep, sep + 1 : T]
    assert w[0, real].min() == pytest.approx(0.0, abs=1e-6) and w[0, real].max() == pytest.approx(1.0)


# -- defect 6: NaN / inf
def test_non_finite_scores_are_refused_naming_the_rows():
    v = np.ones((4, 5), dtype=np.float32)
    v[1, 3], v[3, 0] = np.nan, np.inf
    v[2, 0] = np.nan  # under a pad: no weight is derived from it
    n_pad = np.array([0, 0, 1, 0])
    with pytest.raises(NonFiniteScores, match=r"2 row\(s\) \(rows 11, 13\)"):
        weigh(v, n_pad, WeighConfig(), first_row=10)


class _NaNScorer(Scorer):
    name = "nan_test"

    def config(self):
        return {"scorer": self.name}

    def setup(self, data_tokenizer=None):
        pass

    def score(self, input_ids, n_pad, batching=None):
        out = np.ones(np.shape(input_ids), dtype=np.float32)
        out[3, -1] = np.nan
        return Scored(out)


def _one_shard(tokenized_dir: Path, tmp_path: Path, rows: int | None = None) -> Path:
    """The first shard of `tokenized_dir` (its first `rows` rows) as a tokenized directory of its own."""
    from stagecopy import stage_subset

    return stage_subset(tokenized_dir, tmp_path / "one", shards=1, rows=rows)


def test_score_stage_fails_the_shard_instead_of_weighing_nan(tokenized_dir, tmp_path):
    stage = ScoreStage(_one_shard(tokenized_dir, tmp_path), _NaNScorer())
    with pytest.raises(StageFailed, match=r"NaN or inf on 1 real token\(s\) of 1 row\(s\) \(rows 3\)"):
        run_stage(stage, tmp_path / "out", progress=False)
    assert not list((tmp_path / "out").glob("part-*.parquet"))
