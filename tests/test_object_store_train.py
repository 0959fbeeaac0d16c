# ruff: noqa: F811 - pytest fixtures imported from test_trainer_fixtures
"""The trainer on object storage (issue 16): weighted data read from s3://, checkpoints written to and
resumed from s3://, a tampered checkpoint refused, eval-bpb and scoring from an S3 checkpoint; on the
loopback S3 server (tests/s3server.py). Same losses and weights bytes as on local disk."""

from __future__ import annotations

import json

import fsspec
import pytest
from test_trainer import cfg, metrics
from test_trainer_fixtures import one_thread, tiny_ckpt, weighted_dir  # noqa: F401 - fixtures
from test_workflow import tiny_run  # noqa: F401 - the session fixture

from entroweight import storage
from entroweight.models.checkpoint import CheckpointError, load_checkpoint
from entroweight.trainers import TrainError, train
from entroweight.trainers.bpb import eval_bpb


def upload(local, url) -> str:
    fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
    return url


def remote_metrics(url) -> list[dict]:
    return [json.loads(line) for line in storage.path(f"{url}/metrics.jsonl").read_text().splitlines()]


def test_train_and_resume_on_s3_match_local_disk(weighted_dir, tokenizer_dir, tmp_path, s3_bucket):
    data = upload(weighted_dir, f"{s3_bucket}/weighted")
    # the local reference: 6 steps, then resumed to 12
    local = tmp_path / "run"
    train(cfg(weighted_dir, local, log_every=3, shuffle_buffer=100, stop_at=6, tokenizer=str(tokenizer_dir)))
    train(cfg(weighted_dir, local, log_every=3, shuffle_buffer=100, resume=True))

    out = f"{s3_bucket}/runs/tiny"
    first = train(cfg(data, out, log_every=3, shuffle_buffer=100, stop_at=6, tokenizer=str(tokenizer_dir)))
    assert first.out == out and first.step == 6
    # config.json records the --out given, not the local folder the run staged its files in
    recorded = json.loads(storage.path(f"{out}/config.json").read_bytes())["train"]
    assert recorded["out"] == out and recorded["data"] == [data]
    assert json.loads(storage.path(f"{out}/trainer_state.json").read_bytes())["step"] == 6
    with pytest.raises(TrainError, match="already holds a checkpoint"):
        train(cfg(data, out, log_every=3, shuffle_buffer=100))
    with pytest.raises(TrainError, match=f"^{out} holds a llama model, not mixer"):  # named as given
        train(cfg(data, out, log_every=3, shuffle_buffer=100, resume=True, model="mixer"))
    # --out written with a trailing slash too (it was refused: "s3://B/runs/tiny//config.json")
    train(cfg(data, f"{out}/", log_every=3, shuffle_buffer=100, resume=True))
    assert (
        json.loads(storage.path(f"{out}/config.json").read_bytes())["train"]["out"] == f"{out}/"
    )  # as given

    strip = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in metrics(local)]
    assert [
        {k: v for k, v in r.items() if k not in ("tokens_per_s", "elapsed_s")} for r in remote_metrics(out)
    ] == strip
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert storage.path(f"{out}/{name}").read_bytes() == (local / name).read_bytes()

    model, config = load_checkpoint(out)  # scorers, eval-bpb and export load it from the URL
    assert config["step"] == 12
    bpb_remote = eval_bpb(out, max_bytes=2000)
    assert bpb_remote["bpb"] == eval_bpb(str(local), max_bytes=2000)["bpb"]
    # the text on the store too (it was read as a local path "s3:/...": "no text file")
    from entroweight.trainers.bpb import DEFAULT_TEXT

    text = upload(DEFAULT_TEXT, f"{s3_bucket}/text/wiki.test.raw")
    assert eval_bpb(out, text, max_bytes=2000)["bpb"] == bpb_remote["bpb"]
    # a file of documents on the store is told from text as a local one is (eval-bpb refuses it)
    from entroweight.transforms.sources import not_plain_text

    docs = tmp_path / "docs.txt"
    docs.write_text(json.dumps({"text": "a document"}) + "\n")
    assert not_plain_text(upload(docs, f"{s3_bucket}/text/docs.txt")) is not None
    assert not_plain_text(text) is None


def test_a_tampered_checkpoint_on_s3_is_refused(weighted_dir, tmp_path, s3_bucket):
    local = tmp_path / "run"
    train(cfg(weighted_dir, local, steps=3, log_every=3))
    out = upload(local, f"{s3_bucket}/ckpt")
    weights = storage.path(f"{out}/model.safetensors")
    body = bytearray(weights.read_bytes())
    body[-1] ^= 0xFF
    weights.write_bytes(bytes(body))
    with pytest.raises(CheckpointError, match="sha256") as e:
        load_checkpoint(out)
    # named as the user gave it, not as the temp copy it was checked in
    assert f"{out}/model.safetensors does not match" in str(e.value) and "entroweight-copy-" not in str(
        e.value
    )


@pytest.mark.filterwarnings("ignore:Transformer Engine:UserWarning")
@pytest.mark.parametrize("fmt", ["megatron", "hf"])
def test_export_data_reads_and_writes_s3_like_local_disk(tmp_path, s3_bucket, c4_60, tokenizer_dir, fmt):
    from test_score_stage import tiny_llama_dir

    from entroweight.pipelines import run_stage
    from entroweight.pipelines.export_data import ExportError, export_data
    from entroweight.pipelines.score import ScoreStage
    from entroweight.pipelines.tokenize import TokenizeStage

    model = tiny_llama_dir(tmp_path / "model", tokenizer_dir / "tokenizer.json")
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    run_stage(
        TokenizeStage([str(c4_60)], str(tokenizer_dir), n_ctx=64, shard_docs=20),
        tmp_path / "tok",
        progress=False,
    )
    run_stage(ScoreStage(str(tmp_path / "tok"), "causal_loss", opts), tmp_path / "scored", progress=False)
    scored = upload(tmp_path / "scored", f"{s3_bucket}/scored")

    local = export_data(str(tmp_path / "scored"), str(tmp_path / "export"), fmt)
    remote = export_data(scored, f"{s3_bucket}/export", fmt)
    assert remote["counts"] == local["counts"] and remote["bytes"] == local["bytes"]
    got = storage.walk(f"{s3_bucket}/export")
    want = {str(p.relative_to(tmp_path / "export")) for p in (tmp_path / "export").rglob("*") if p.is_file()}
    assert set(got) == want
    for rel in want - {"export.json"}:  # the record names its source
        assert (
            storage.path(f"{s3_bucket}/export/{rel}").read_bytes() == (tmp_path / "export" / rel).read_bytes()
        )
    again = export_data(scored, f"{s3_bucket}/export", fmt)  # a rerun: this very export, nothing to do
    assert again["up_to_date"] and storage.walk(f"{s3_bucket}/export") == got
    with pytest.raises(ExportError, match=r"holds an export of other options \(format: "):
        export_data(scored, f"{s3_bucket}/export", "megatron" if fmt != "megatron" else "hf")
    with pytest.raises(ExportError, match="lies inside SCORED"):
        export_data(scored, f"{scored}/export", fmt)


def test_the_reader_plans_from_manifests_not_footers(tokenized_dir, tmp_path, s3_bucket, monkeypatch):
    """Stage output: one listing, the manifests, and one parquet footer per directory, whatever the
    number of files; data without manifests falls back to every file's footer. Same plan both ways."""
    import shutil

    from entroweight.trainers import data

    opened = []
    footer = data._footer
    monkeypatch.setattr(data, "_footer", lambda f: opened.append(f) or footer(f))
    remote = upload(tokenized_dir, f"{s3_bucket}/tokens")
    for where in (str(tokenized_dir), remote):
        opened.clear()
        ds = data.WeightedTokens(where, batch_size=4)
        units = ds._units(2)
        assert len(ds.info.files) == 4 and len(opened) == 1, opened

    bare = tmp_path / "bare"  # the same parquet without the stage's bookkeeping
    bare.mkdir()
    for f in tokenized_dir.glob("part-*.parquet"):
        shutil.copy(f, bare / f.name)
    opened.clear()
    ds = data.WeightedTokens(str(bare), batch_size=4)
    assert len(opened) == 4
    assert [(u.row_group, u.start, u.stop) for u in ds._units(2)] == [
        (u.row_group, u.start, u.stop) for u in units
    ]


# -- every command that writes, with --out on s3://: written there, never into a local folder "s3:"
# (export-hf, train-tokenizer, report and evaluate took the URL through Path(), exit 0, bucket empty)
COVERED = {
    "tokenize": "test_object_store.py::test_the_cli_reads_and_writes_s3",
    "score": "test_object_store.py::test_the_cli_reads_and_writes_s3",
    "weigh": "test_object_store.py::test_tokenize_score_weigh_on_s3_match_local_disk",
    "train": "test_train_and_resume_on_s3_match_local_disk",
    "export-data": "test_export_data_reads_and_writes_s3_like_local_disk",
    "synthesize": "test_synthesize.py::test_object_storage",
}
URL_OUT = {
    "export-hf": lambda ckpt, run, docs, out: ["export-hf", ckpt, "--out", out],
    "train-tokenizer": lambda ckpt, run, docs, out: [
        "train-tokenizer",
        docs,
        "--vocab-size",
        300,
        "--out",
        out,
    ],
    "report": lambda ckpt, run, docs, out: ["report", run, "--out", f"{out}/report.html"],
    "evaluate": lambda ckpt, run, docs, out: [
        "evaluate",
        ckpt,
        "--documents",
        docs,
        "--items",
        4,
        "--device",
        "cpu",
        "--out",
        out,
    ],  # fmt: skip
}


def test_every_writing_command_is_tried_with_an_s3_out():
    from test_path_rule import writing_commands

    assert sorted([*COVERED, *URL_OUT]) == writing_commands()


@pytest.mark.parametrize("command", sorted(URL_OUT))
def test_an_s3_out_is_written_there(command, tiny_ckpt, tiny_run, c4_60, s3_bucket, tmp_path, monkeypatch):  # noqa: F811
    from click.testing import CliRunner

    from entroweight.workflows.cli.main import main

    monkeypatch.chdir(tmp_path)
    out = f"{s3_bucket}/{command}"
    argv = URL_OUT[command](tiny_ckpt, tiny_run["run_dir"], c4_60, out)
    res = CliRunner().invoke(main, [str(a) for a in argv])
    assert res.exit_code == 0, res.output
    assert storage.walk(out), f"nothing in {out}: {res.output}"
    assert not (tmp_path / "s3:").exists()
    # a command's local scratch (evaluate's lm-eval caches, their locks) is not uploaded with it
    assert not [k for k in storage.walk(out) if ".lm-eval" in k], sorted(storage.walk(out))
