"""`verify_dir` / `entroweight verify`: clean directories pass; each kind of hole or corruption is named.

Each corruption is made on a copy of a real tokenized or scored directory. Content corruptions are
written with a matching sha256 in the manifest, so only the content check can catch them.
"""

from __future__ import annotations

import gzip
import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from model_free import IdMod

from entroweight.pipelines import run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.verify import verify_dir
from entroweight.schemas import METADATA_KEY
from entroweight.scorers import register
from entroweight.transforms.writer import sha256_file
from entroweight.workflows.cli.main import main

N_CTX = 32


class IdParity(IdMod):
    """A cheap deterministic scorer (no model): value = id mod 7. Enough to exercise the contracts."""

    name = "test_id_parity"


register(IdParity)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory, c4_path, tokenizer_dir):
    """40 C4 docs, 8 short ones (left pads) and 2 bad rows: 4 files of 15 rows (the last 5), a shard
    each (part-00000 ... part-00003), n_ctx 32."""
    src = tmp_path_factory.mktemp("vsrc")
    with gzip.open(c4_path, "rt", encoding="utf-8") as f:
        lines = [next(f) for _ in range(40)]
    short = [json.dumps({"text": f"A short document, number {i}."}) + "\n" for i in range(0, 40, 5)]
    lines = [x for i, line in enumerate(lines) for x in ([short[i // 5], line] if i % 5 == 0 else [line])]
    lines += ['{"text": "  "}\n', "not json\n"]
    for k in range(4):
        (src / f"c4-{k}.jsonl").write_text("".join(lines[15 * k : 15 * k + 15]))
    out = tmp_path_factory.mktemp("vtokens")
    run_stage(TokenizeStage([str(src)], str(tokenizer_dir), n_ctx=N_CTX), out, progress=False)
    return out


@pytest.fixture(scope="module")
def scored(tmp_path_factory, tokens):
    out = tmp_path_factory.mktemp("vscored")
    run_stage(ScoreStage(tokens, "test_id_parity"), out, progress=False)
    return out


def copy(src, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(src, dst)
    return dst


def rewrite(d, shard, fn, meta_fn=None):
    """Rewrite shard `part-NNNNN` through fn(table) (and meta_fn(metadata)); keep its manifest's sha256 true."""
    path = d / f"{shard}.parquet"
    table = pq.read_table(path)
    meta = json.loads(table.schema.metadata[METADATA_KEY])
    table = fn(table)
    if meta_fn:
        meta = meta_fn(meta)
    table = table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()})
    pq.write_table(table, path)
    mpath = d / f".{shard}.manifest.json"
    manifest = json.loads(mpath.read_text())
    manifest["output_sha256"] = sha256_file(path)
    mpath.write_text(json.dumps(manifest))


def set_list(table, name, values: np.ndarray):
    n = values.shape[1]
    offsets = pa.array(np.arange(0, values.size + 1, n, dtype=np.int32))
    col = pa.ListArray.from_arrays(
        offsets, pa.array(values.reshape(-1), type=table.schema.field(name).type.value_type)
    )
    return table.set_column(table.schema.get_field_index(name), table.schema.field(name), col)


def get_list(table, name) -> np.ndarray:
    return np.stack(table.column(name).to_numpy(zero_copy_only=False)).copy()


def one(problems, *words):
    hits = [p for p in problems if all(w in p for w in words)]
    assert hits, f"no problem mentions {words}: {problems}"


def test_clean_directories_verify(tokens, scored):
    assert verify_dir(tokens) == []
    assert verify_dir(scored) == []
    res = CliRunner().invoke(main, ["verify", str(scored)])
    assert res.exit_code == 0 and "ok" in res.output
    res = CliRunner().invoke(main, ["verify", str(tokens), "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == {
        "directory": str(tokens),
        "ok": True,
        "problems": [],
    }


def test_not_a_stage_directory(tmp_path):
    assert "no .stage.json" in verify_dir(tmp_path)[0]
    assert "not a directory" in verify_dir(tmp_path / "nope")[0]
    # from the command line a directory that is no stage's output is a wrong argument, as `inspect`
    # says (exit 2, one line), not a damaged output (exit 1): a script tells the two apart
    (tmp_path / "config.json").write_text("{}")
    res = CliRunner().invoke(main, ["verify", str(tmp_path)])
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "is not a stage's output (no .stage.json)" in res.output, res.output


def test_cli_exits_1_with_the_problems(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    (d / "notes.txt").write_text("hello")
    res = CliRunner().invoke(main, ["verify", str(d)])
    assert res.exit_code == 1 and "notes.txt" in res.output
    res = CliRunner().invoke(main, ["verify", str(d), "--json"])
    info = json.loads(res.stdout)
    assert res.exit_code == 1 and info["ok"] is False and len(info["problems"]) == 1


# ---------------------------------------------------------------- bookkeeping and files


def test_flipped_byte_fails_sha256(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    p = d / "part-00001.parquet"
    blob = bytearray(p.read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    p.write_bytes(bytes(blob))
    one(verify_dir(d), "part-00001", "sha256")


def test_missing_manifest_is_a_hole(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    (d / ".part-00002.manifest.json").unlink()
    problems = verify_dir(d)
    one(problems, "part-00002", "no manifest", "rerun")
    one(problems, "part-00002.parquet", "not a shard")  # datasets would still load it


def test_a_manifest_that_does_not_parse_is_one_problem_and_its_shard_kept(tokens, tmp_path):
    """Its shard is not called a stray to move out (a good shard lost) nor a hole: one line names the
    manifest and says to rerun the stage, which rewrites it."""
    d = copy(tokens, tmp_path)
    (d / ".part-00002.manifest.json").write_text("{not json")
    problems = verify_dir(d)
    assert len(problems) == 1, problems
    one(problems, ".part-00002.manifest.json", "does not parse", "rerun the stage")


def test_missing_shard_file_and_rejects_file(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    (d / "part-00000.parquet").unlink()
    rejects = json.loads((d / ".part-00003.manifest.json").read_text())["rejects_file"]
    (d / rejects).unlink()
    problems = verify_dir(d)
    one(problems, "part-00000", "missing")
    one(problems, "part-00003", "rejects file missing")


def test_stray_and_temp_files(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    (d / "extra.parquet").write_bytes(b"x")
    (d / "part-00001.parquet.tmp-deadbeef").write_bytes(b"PAR1")
    (d / ".rejects" / "part-00009.parquet").write_bytes(b"x")
    problems = verify_dir(d)
    one(problems, "extra.parquet", "not a shard")
    one(problems, "tmp-deadbeef", "temp file")
    one(problems, "part-00009", "no manifest accounts")
    assert len(problems) == 3


def test_accounting_mismatch_and_row_count(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    mpath = d / ".part-00000.manifest.json"
    m = json.loads(mpath.read_text())
    m["docs_in"] += 1
    m["rows_out"] += 1
    mpath.write_text(json.dumps(m))
    problems = verify_dir(d)
    one(problems, "part-00000", "documents in")
    one(problems, "documents were lost")
    one(problems, "part-00000", "rows, its manifest says")


def test_manifest_of_another_config(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    mpath = d / ".part-00001.manifest.json"
    m = json.loads(mpath.read_text())
    m["config_hash"] = "0" * 16
    mpath.write_text(json.dumps(m))
    one(verify_dir(d), "part-00001", "mixed configs")


def test_unregistered_registry(tokens, tmp_path):
    d = copy(tokens, tmp_path)
    (d / ".shards.json").write_text("{}")
    one(verify_dir(d), "not registered")


# ---------------------------------------------------------------- content (sha256 kept true)


def test_pad_that_is_not_pad_id(tokens, tmp_path):
    d = copy(tokens, tmp_path)

    def fn(t):
        ids = get_list(t, "input_ids")
        row = int(np.argmax(t.column("n_pad").to_numpy()))
        ids[row, 0] = 5
        return set_list(t, "input_ids", ids)

    rewrite(d, "part-00000", fn)
    one(verify_dir(d), "part-00000", "pads that are not pad_id")


@pytest.mark.parametrize(
    "value, what",
    [(np.nan, "NaN or infinite"), (1.5, "outside [0, 1]"), (-0.25, "outside [0, 1]")],
    ids=["nan", "above-1", "negative"],
)
def test_bad_weights(scored, tmp_path, value, what):
    d = copy(scored, tmp_path)

    def fn(t):
        w = get_list(t, "weight")
        row = int(np.argmin(t.column("n_pad").to_numpy()))
        w[row, -1] = value
        return set_list(t, "weight", w)

    rewrite(d, "part-00001", fn)
    one(verify_dir(d), "part-00001", "weights", what)


def test_pads_must_weigh_zero_and_entropy_finite(scored, tmp_path):
    d = copy(scored, tmp_path)

    def fn(t):
        w, e = get_list(t, "weight"), get_list(t, "entropy")
        row = int(np.argmax(t.column("n_pad").to_numpy()))
        w[row, 0] = 0.5
        e[row, -1] = np.inf
        return set_list(set_list(t, "weight", w), "entropy", e)

    rewrite(d, "part-00000", fn)
    problems = verify_dir(d)
    one(problems, "pads with a weight other than 0")
    one(problems, "entropy NaN or infinite")


def test_list_lengths_differ(scored, tmp_path):
    d = copy(scored, tmp_path)

    def fn(t):
        w = get_list(t, "weight")[:, 1:]  # one weight short per row
        offsets = pa.array(np.arange(0, w.size + 1, w.shape[1], dtype=np.int32))
        col = pa.ListArray.from_arrays(offsets, pa.array(w.reshape(-1), pa.float16()))
        return t.set_column(t.schema.get_field_index("weight"), t.schema.field("weight"), col)

    rewrite(d, "part-00002", fn)
    one(verify_dir(d), "part-00002", "weight lists not of length")


def test_schema_off_contract(scored, tmp_path):
    d = copy(scored, tmp_path)
    rewrite(d, "part-00000", lambda t: t.drop_columns(["n_bytes"]))
    one(verify_dir(d), "part-00000", "schema")


def test_mixed_tokenizers_and_scorers(scored, tmp_path):
    d = copy(scored, tmp_path)
    rewrite(d, "part-00001", lambda t: t, lambda m: {**m, "tokenizer_sha256": "f" * 64})
    rewrite(d, "part-00002", lambda t: t, lambda m: {**m, "scorer": "causal_loss"})
    problems = verify_dir(d)
    one(problems, "part-00001", "another tokenizer")
    one(problems, "part-00002", "another scorer config", "scorer")


def test_scored_shard_with_fewer_rows_than_its_input(scored, tokens, tmp_path):
    d = copy(scored, tmp_path)
    rewrite(d, "part-00000", lambda t: t.slice(1))
    problems = verify_dir(d)
    one(problems, "part-00000", "rows, its manifest says")
    mpath = d / ".part-00000.manifest.json"
    m = json.loads(mpath.read_text())
    m["rows_out"] = m["rows_in"] = m["docs_in"] = m["docs_out"] = m["rows_out"] - 1
    mpath.write_text(json.dumps(m))
    one(verify_dir(d), "part-00000", "its input", "has")


def test_value_checks_run_in_every_batch(scored, tmp_path):
    """A problem in the first 1024-row batch does not hide another in the second."""
    d = copy(scored, tmp_path)

    def fn(t):
        t = pa.concat_tables([t] * (2048 // t.num_rows + 1)).slice(0, 2048).combine_chunks()
        n_pad = t.column("n_pad").to_numpy()
        ids, w = get_list(t, "input_ids"), get_list(t, "weight")
        ids[int(np.argmax(n_pad[:1024])), 0] = 5  # a wrong pad in batch 1
        w[1024 + int(np.argmin(n_pad[1024:])), -1] = np.nan  # a NaN weight in batch 2
        return set_list(set_list(t, "input_ids", ids), "weight", w)

    rewrite(d, "part-00001", fn)
    problems = verify_dir(d)
    one(problems, "part-00001", "1 pads that are not pad_id")
    one(problems, "part-00001", "1 weights NaN or infinite")
