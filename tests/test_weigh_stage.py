"""The weigh stage: re-weigh a scored directory from its stored entropies, without re-scoring (issue 15).

Real parquet scored by a tiny HF Llama (causal_loss) on 60 C4 documents; the stage and its CLI.
"""

from __future__ import annotations

import gzip
import itertools

import numpy as np
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_score_stage import tiny_llama_dir

from entroweight.pipelines import StageError, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.pipelines.weigh import WeighStage
from entroweight.schemas import read_file_metadata
from entroweight.transforms.select import MinMeanWeight
from entroweight.transforms.weigh import WeighConfig, entropy_quantiles, weigh
from entroweight.workflows.cli.main import main

N_CTX = 64


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, c4_path, tokenizer_dir):
    src = tmp_path_factory.mktemp("src") / "c4.jsonl.gz"
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(60)]
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.writelines(lines)
    out = tmp_path_factory.mktemp("tokens")
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=20, overflow="truncate"),
        out,
        progress=False,
    )
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), tokenizer_dir / "tokenizer.json")


def score(tokens, model, out, engine="local", **kw):
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    return run_stage(ScoreStage(tokens, "causal_loss", opts, **kw), out, engine=engine, progress=False)


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tokens, model):
    out = tmp_path_factory.mktemp("scored")
    score(tokens, model, out)
    return out


def table(d):
    import pyarrow as pa

    return pa.concat_tables([pq.read_table(p) for p in sorted(d.glob("part-*.parquet"))])


def matrix(t, col):
    return np.stack(t.column(col).to_numpy(zero_copy_only=False))


def cli(*args):
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


def test_reweighing_equals_scoring_with_that_weighting(scored, tokens, model, tmp_path):
    """weigh --weighting W on a minmax-scored directory writes exactly what `score --weighting W`
    writes, without running the model: same ids, same entropies, same weights."""
    cfg = WeighConfig(clip=(0.1, 0.9), floor=0.05, dtype="uint8")
    summary = run_stage(WeighStage(scored, cfg), tmp_path / "w", progress=False)
    assert summary.shards_run == 3 and summary.rows_out == 60
    direct = tmp_path / "direct"
    score(tokens, model, direct, weighting=cfg)
    a, b, src = table(tmp_path / "w"), table(direct), table(scored)
    for col in ("seq_id", "input_ids", "n_pad", "n_bytes", "entropy"):
        assert a.column(col).equals(src.column(col))
    np.testing.assert_array_equal(matrix(a, "weight"), matrix(b, "weight"))
    assert matrix(a, "weight").dtype == np.uint8
    meta = read_file_metadata(next((tmp_path / "w").glob("part-*.parquet")))
    assert (
        meta["stage"] == "weigh"
        and meta["weighting"]["clip"] == [0.1, 0.9]
        and meta["weighting"]["dtype"] == "uint8"
    )
    assert (
        meta["scorer"] == "causal_loss"
        and meta["scored_config_hash"]
        == read_file_metadata(next(scored.glob("part-*.parquet")))["config_hash"]
    )
    assert verify_dir(tmp_path / "w") == []
    # the re-weighed data stays self-describing and reads like any weighted data
    assert (tmp_path / "w" / ".tokenizer" / "tokenizer.json").read_bytes() == (
        tokens / ".tokenizer" / "tokenizer.json"
    ).read_bytes()
    from entroweight.trainers.data import inspect_data

    assert inspect_data([str(tmp_path / "w")], ("weight",), meta["tokenizer_sha256"]).n_ctx == N_CTX


def test_cli_quantile_from_its_own_entropies_and_incremental(scored, tmp_path):
    out = tmp_path / "q"
    code, output = cli("weigh", scored, "--out", out, "--weighting", "quantile")
    assert code == 0, output
    assert "3 shard(s) run" in output
    t = table(out)
    e, w = matrix(t, "entropy"), matrix(t, "weight").astype(np.float32)
    real = np.arange(N_CTX)[None] >= t.column("n_pad").to_numpy()[:, None]
    cfg = WeighConfig(method="quantile", quantiles=entropy_quantiles(scored))
    np.testing.assert_allclose(w, weigh(e, t.column("n_pad").to_numpy(), cfg), atol=1e-3)  # float16
    assert 0.4 < float(np.median(w[real])) < 0.6  # ranks on the data's own scale
    code, output = cli("weigh", scored, "--out", out, "--weighting", "quantile")
    assert code == 0 and "nothing to do" in output
    # another weighting into the same --out is another config: refused, the shards kept
    code, output = cli("weigh", scored, "--out", out, "--invert")
    assert code == 2 and "--overwrite" in output and "Traceback" not in output
    assert len(list(out.glob("part-*.parquet"))) == 3
    code, output = cli("weigh", scored, "--out", out, "--invert", "--overwrite")
    assert code == 0, output
    assert read_file_metadata(next(out.glob("part-*.parquet")))["weighting"]["invert"] is True


@pytest.mark.parametrize(
    "engine",
    ["beam", pytest.param("ray", marks=pytest.mark.slow)],  # Ray's start costs ~20 s on 2 cores
)
def test_engines_write_the_same_rows(scored, tmp_path, engine):
    cfg = WeighConfig(invert=True)
    run_stage(WeighStage(scored, cfg), tmp_path / "local", progress=False)
    run_stage(WeighStage(scored, cfg), tmp_path / engine, engine=engine, progress=False)
    assert table(tmp_path / "local").equals(table(tmp_path / engine))
    assert verify_dir(tmp_path / engine) == []


def test_refusals_exit_2_before_output(scored, tokens, model, tmp_path):
    out = tmp_path / "o"
    cases = [
        ((tokens,), "not weighted data"),  # a tokenized directory: nothing to re-weigh
        ((scored, "--weighting", "nope"), "--weighting"),
        ((scored, "--flor", "0.2"), "--flor"),  # a typo is refused, not ignored
        ((scored, "--clip", "0.5", "0.1"), "--clip: must be 0 <= LO < HI <= 1"),
        ((scored, "--keep", "0.5"), "--keep: applies to topk weighting only"),
        ((scored, "--weighting", "topk", "--invert", "--keep", "0.5"), "--invert: topk weights are 0 or 1"),
        ((scored, "--quantiles-from", scored), "applies to --weighting quantile or topk only"),
        ((scored, "--floor", "1.5"), "--floor: Input should be less than or equal to 1 (got 1.5)"),
    ]
    for args, words in cases:
        code, output = cli("weigh", *args, "--out", out)
        assert code == 2 and words in output and "Traceback" not in output, (args, output)
        assert not out.exists(), args
    dropped = tmp_path / "dropped"
    score(tokens, model, dropped, with_entropy=False)
    code, output = cli("weigh", dropped, "--out", out)
    assert code == 2 and "--drop-entropy" in output and not out.exists()
    # a loss that reads the values says why they are gone (it said "score it first": it was scored)
    code, output = cli("train", dropped, "--loss", "rescaled", "--steps", "1", "--out", out)
    assert code == 2 and "written without its values (--drop-entropy)" in output and not out.exists(), output
    with pytest.raises(StageError, match="score it first"):
        WeighStage(tmp_path, WeighConfig()).plan_inputs()  # refused as planning starts


def test_weigh_takes_the_weighting_flags_of_score(scored, tmp_path):
    """Before, weigh had no --keep (only `--option keep=0.6`): the flags of both commands are now made
    from one model, and a topk selection reads its quantiles from the scored directory itself."""
    code, output = cli("weigh", scored, "--out", tmp_path / "f", "--weighting", "topk", "--keep", "0.25")
    assert code == 0, output
    meta = read_file_metadata(next((tmp_path / "f").glob("part-*.parquet")))
    assert meta["weighting"]["method"] == "topk" and meta["weighting"]["keep"] == 0.25
    w = matrix(table(tmp_path / "f"), "weight").astype(np.float32)
    assert set(np.unique(w)) <= {0.0, 1.0}


def test_every_source_document_is_accounted_for_down_the_chain(tokenizer_dir, model, c4_path, tmp_path):
    """Each stage's shards carry the counts of the stages before (their lineage): a weighted
    directory, its `inspect`, its run's summary and its export still say what tokenize rejected, and
    down the chain each stage reads what the one before kept (tokenize -> score -> weigh, filters
    rejecting at each; the local and the Beam engine)."""
    import json

    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(24)]
    lines[3] = '{"text": ""}\n'  # empty
    lines[9] = "not json\n"  # invalid_json
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(lines))
    tokens = tmp_path / "tokens"
    run_stage(
        TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=10), tokens, progress=False
    )
    scored, weighed = tmp_path / "scored", tmp_path / "weighed"
    summaries = {}
    for engine in ("local", "beam"):
        steps = [MinMeanWeight(0.5)]  # drops some documents, keeps most (minmax weights of a random model)
        summaries[engine] = score(tokens, model, scored / engine, steps=steps, engine=engine)
    run_stage(
        WeighStage(scored / "local", WeighConfig(invert=True), steps=[MinMeanWeight(0.55)]),
        weighed,
        progress=False,
    )

    code, out = cli("inspect", "--json", weighed)
    assert code == 0, out
    info = json.loads(out)
    chain = [*info["upstream"], {k: info[k] for k in ("docs_in", "docs_out", "rejected")}]
    assert [c.get("stage", "weigh") for c in chain] == ["tokenize", "score", "weigh"]
    assert chain[0]["docs_in"] == 24 and chain[0]["rejected"] == {"empty": 1, "invalid_json": 1}
    for before, after in itertools.pairwise(chain):  # each stage read what the one before kept
        assert after["docs_in"] == before["docs_out"]
    assert chain[1]["rejected"] and chain[2]["rejected"], chain  # the filters did reject
    rejected = sum(n for c in chain for n in c["rejected"].values())
    assert chain[-1]["docs_out"] + rejected == 24  # every source document: kept or rejected, once
    assert chain[-1]["docs_out"] == len(set(table(weighed).column("doc_id").to_pylist()))

    local, beam = (s.upstream for s in (summaries["local"], summaries["beam"]))
    assert local == beam == [dict(chain[0], stage="tokenize")]  # the Beam workers carried it too
    assert "rejected by earlier stages: tokenize 2" in summaries["local"].line()
    code, out = cli("inspect", weighed)
    assert "tokenize: 24 docs in, 22 out, 2 rejected (empty 1, invalid_json 1)" in out, out

    code, out = cli("export-data", weighed, "--format", "hf", "--out", tmp_path / "export")
    assert code == 0, out
    record = json.loads((tmp_path / "export" / "export.json").read_text())
    assert [c["docs_in"] for c in record["lineage"]] == [c["docs_in"] for c in chain]
    assert record["lineage"][-1]["docs_out"] == record["counts"]["documents"]
    card = (tmp_path / "export" / "README.md").read_text()
    assert "tokenize: 24 docs in, 22 out, 2 rejected (empty 1, invalid_json 1)" in card

    # a sample (a workflow's limit_rows: each shard's first rows) says what it left unread
    score(tokens, model, tmp_path / "sample", rows=3)
    code, out = cli("inspect", "--json", tmp_path / "sample")
    info = json.loads(out)
    assert code == 0 and info["not_read"] > 0 and info["docs_in"] + info["not_read"] == 22, info
    code, out = cli("export-data", tmp_path / "sample", "--format", "hf", "--out", tmp_path / "sample-export")
    card = (tmp_path / "sample-export" / "README.md").read_text()
    assert f"{info['not_read']} not read (a sample of the first rows)" in card
    # an edited count carried from the stages before is refused as the stage's own is
    from entroweight.schemas.datadir import DataDir

    part = DataDir(weighed).parts[0].manifest
    path = weighed / f".{part.shard}.manifest.json"
    record = json.loads(path.read_text())
    record["extra"]["upstream"][1]["docs_out"] += 5
    path.write_text(json.dumps(record))
    code, out = cli("inspect", weighed)
    assert code == 2 and "its counts do not add up (score:" in out, out
    code, out = cli("verify", weighed)  # verify judges the counts by the same rule as the readers
    assert code == 1 and "counts do not add up (score:" in out, out


@pytest.mark.parametrize("damage", ["removed", "replaced by other bytes"])
def test_a_shard_whose_rejects_file_is_gone_is_redone(scored, tokenizer_dir, c4_path, tmp_path, damage):
    """A rerun redoes a shard whose rejects file was deleted or replaced (another size than its
    manifest records), as it does one whose parquet was (the rejected documents' ids and reasons are
    in no other file): every stage that writes one (tokenize, and weigh and score through their one
    shard writer). Before, "nothing to do" and `verify` failed."""
    from entroweight.transforms.writer import sha256_file

    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(12)]
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(lines) + '{"text": ""}\n')
    runs = {
        "tokenize": lambda out: TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX, shard_docs=5),
        "weigh": lambda out: WeighStage(scored, WeighConfig(invert=True), steps=[MinMeanWeight(0.55)]),
    }
    for name, make in runs.items():
        out = tmp_path / name
        run_stage(make(out), out, progress=False)
        rejects = sorted((out / ".rejects").glob("part-*.parquet"))
        assert rejects, name
        before = {p.name: sha256_file(p) for p in rejects}
        if damage == "removed":
            rejects[0].unlink()
        else:
            rejects[0].write_bytes(b"junk\n")
        again = run_stage(make(out), out, progress=False)
        assert again.shards_run == 1, (name, again.line())
        assert {p.name: sha256_file(p) for p in sorted((out / ".rejects").glob("part-*.parquet"))} == before
        assert verify_dir(out) == []
        assert run_stage(make(out), out, progress=False).shards_run == 0
