"""Every stage on object storage (issue 16): a real S3-protocol server on loopback (tests/s3server.py),
reached through s3fs with the endpoint and credentials in the standard AWS variables.

The same run on s3:// and on local disk gives byte-identical parquet; the object-store lock is a lease
(a conditional put), so a second run on one --out exits 3; a shard without its manifest is redone.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time

import fsspec
import pytest
from test_score_stage import tiny_llama_dir

from entroweight import storage
from entroweight.pipelines import LockHeld, run_stage
from entroweight.pipelines.score import ScoreStage
from entroweight.pipelines.tokenize import TokenizeStage
from entroweight.pipelines.weigh import WeighStage
from entroweight.schemas.datadir import DataDir
from entroweight.transforms.weigh import WeighConfig

N_CTX = 64


def s3fs():
    return fsspec.filesystem("s3", skip_instance_cache=True, use_listings_cache=False)


def parquet_bytes(location) -> dict[str, bytes]:
    """{part file name: bytes} of a stage's output directory, local or s3://."""
    d = storage.path(location)
    names = sorted(n for n in storage.listing(d) if n.startswith("part-"))
    return {n: (d / n).read_bytes() for n in names}


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer_dir):
    return tiny_llama_dir(tmp_path_factory.mktemp("tiny"), tokenizer_dir / "tokenizer.json")


def tokenize(src, tok, out, **kw):
    stage = TokenizeStage([str(src)], str(tok), n_ctx=N_CTX, shard_docs=20, overflow="truncate")
    return run_stage(stage, out, progress=False, **kw)


def score(data, model, out):
    opts = {"model": str(model), "dtype": "fp32", "batch_size": 8}
    return run_stage(ScoreStage(str(data), "causal_loss", opts), out, progress=False)


def test_tokenize_score_weigh_on_s3_match_local_disk(tmp_path, s3_bucket, c4_60, tokenizer_dir, model):
    # everything on the object store: the documents, the tokenizer, every output
    s3 = s3fs()
    s3.put(str(c4_60), f"{s3_bucket}/raw/c4.jsonl.gz")
    s3.put(str(tokenizer_dir / "tokenizer.json"), f"{s3_bucket}/tok/tokenizer.json")

    local = tokenize(c4_60, tokenizer_dir, tmp_path / "tok")
    remote = run_stage(
        TokenizeStage(
            [f"{s3_bucket}/raw/"],
            f"{s3_bucket}/tok/tokenizer.json",
            n_ctx=N_CTX,
            shard_docs=20,
            overflow="truncate",
        ),
        f"{s3_bucket}/tokens",
        progress=False,
    )
    assert (remote.docs_in, remote.rows_out, remote.shards_run) == (local.docs_in, local.rows_out, 3)
    assert parquet_bytes(f"{s3_bucket}/tokens") == parquet_bytes(tmp_path / "tok")
    # the data carries its tokenizer on the store too, and manifests record each object's size
    assert s3.exists(f"{s3_bucket.removeprefix('s3://')}/tokens/.tokenizer/tokenizer.json")
    first = DataDir(f"{s3_bucket}/tokens").parts[0]
    manifest = json.loads(
        s3.cat(f"{s3_bucket.removeprefix('s3://')}/tokens/.{first.manifest.shard}.manifest.json")
    )
    assert manifest["output_bytes"] == s3.size(f"{s3_bucket.removeprefix('s3://')}/tokens/{first.name}")

    score(tmp_path / "tok", model, tmp_path / "scored")
    score(f"{s3_bucket}/tokens", model, f"{s3_bucket}/scored")
    assert parquet_bytes(f"{s3_bucket}/scored") == parquet_bytes(tmp_path / "scored")

    cfg = WeighConfig(method="minmax", floor=0.1, dtype="uint8")
    run_stage(WeighStage(str(tmp_path / "scored"), cfg), tmp_path / "weighed", progress=False)
    run_stage(WeighStage(f"{s3_bucket}/scored", cfg), f"{s3_bucket}/weighed", progress=False)
    assert parquet_bytes(f"{s3_bucket}/weighed") == parquet_bytes(tmp_path / "weighed")

    # a rerun plans from one listing and finds everything done
    again = tokenize(f"{s3_bucket}/raw/c4.jsonl.gz", f"{s3_bucket}/tok/tokenizer.json", f"{s3_bucket}/tokens")
    assert again.shards_run == 0 and again.shards_done_before == 3


def test_a_shard_without_its_manifest_is_redone_and_a_wrong_size_too(s3_bucket, c4_60, tokenizer_dir):
    out = f"{s3_bucket}/tokens"
    tokenize(c4_60, tokenizer_dir, out)
    reference = parquet_bytes(out)
    s3, root = s3fs(), out.removeprefix("s3://")
    parts = DataDir(out).parts
    s3.rm(f"{root}/.{parts[1].manifest.shard}.manifest.json")  # killed between the parquet and its manifest
    s3.pipe(f"{root}/{parts[2].name}", b"PAR1 stale")  # an object that is not what its manifest says
    summary = tokenize(c4_60, tokenizer_dir, out)
    assert summary.shards_run == 2 and summary.shards_done_before == 1
    assert parquet_bytes(out) == reference


def test_a_source_object_rewritten_at_the_same_size_is_tokenized_again(
    tmp_path, s3_bucket, c4_60, tokenizer_dir
):
    """A source object changed since it was tokenized (one byte, the same size) is read again, as a
    local file whose mtime moved is: its listing's ETag is recorded in the manifest. Before, only the
    size was, and every rerun, --overwrite included, kept the old tokens with "nothing to do"."""
    s3 = s3fs()
    src = f"{s3_bucket}/src/c4.jsonl"
    lines = gzip.decompress(c4_60.read_bytes())
    s3.pipe(src.removeprefix("s3://"), lines)
    out = f"{s3_bucket}/tokens"
    tokenize(src, tokenizer_dir, out)
    before = parquet_bytes(out)
    at = lines.index(b'{"text":"The') + len(b'{"text":"')  # the first document's first letter
    changed = lines[:at] + b"A" + lines[at + 1 :]  # one byte: "The" -> "Ahe", the same size
    s3.pipe(src.removeprefix("s3://"), changed)
    summary = tokenize(src, tokenizer_dir, out)
    assert summary.shards_run >= 1 and parquet_bytes(out) != before
    local = tmp_path / "c4.jsonl"
    local.write_bytes(changed)
    tokenize(local, tokenizer_dir, tmp_path / "tokens")
    assert parquet_bytes(out) == parquet_bytes(tmp_path / "tokens")  # the new text, as read from disk


def test_second_run_on_a_leased_out_exits_3(s3_bucket, c4_60, tokenizer_dir):
    out = f"{s3_bucket}/tokens"
    held = storage.lock(f"{out}/.lock")  # another run's lease
    try:
        with pytest.raises(LockHeld, match="another entroweight run holds"):
            tokenize(c4_60, tokenizer_dir, out)
        cli = subprocess.run(
            [
                sys.executable,
                "-m",
                "entroweight.workflows.cli",
                "tokenize",
                str(c4_60),
                "--tokenizer",
                str(tokenizer_dir),
                "--out",
                out,
                "--n-ctx",
                str(N_CTX),
            ],
            capture_output=True,
            text=True,
            env=os.environ.copy(),
        )
        assert cli.returncode == 3, cli.stderr
        assert "Traceback" not in cli.stderr
    finally:
        held.release()
    assert tokenize(c4_60, tokenizer_dir, out).shards_run == 3  # released: the next run goes ahead


def test_an_expired_lease_is_taken_over(s3_bucket):
    lease_path = f"{s3_bucket}/out/.lock"
    storage.path(lease_path).write_bytes(json.dumps({"holder": "dead@host:1", "expires": 0}).encode())
    held = storage.lock(lease_path)  # the holder stopped renewing: taken over at once
    try:
        assert json.loads(storage.path(lease_path).read_bytes())["holder"] == held.holder
        with pytest.raises(storage.LockBusy, match=held.holder.split(":")[0]):
            storage.lock(lease_path)
    finally:
        held.release()
    assert not storage.path(lease_path).exists()


def test_a_lease_no_live_run_could_hold_says_so_and_a_wait_is_not_advised_twice(s3_bucket):
    """A lease expiring far past the TTL a live run renews (a clock ahead, one written by hand) was
    said as "until 21:54" (115 days away) with no way out; after --wait the refusal advised --wait."""
    from entroweight.pipelines.stage import run_lock

    out = f"{s3_bucket}/out"
    far = time.time() + 1e7
    storage.path(f"{out}/.lock").write_bytes(
        json.dumps({"holder": "bob@elsewhere:1:ab", "expires": far}).encode()
    )
    with pytest.raises(LockHeld) as e:
        run_lock(out, wait=0.2)
    said = str(e.value)
    assert time.strftime("%Y-%m-%d", time.gmtime(far)) in said and f"remove {out}/.lock" in said, said
    assert "still held after --wait 0.2" in said and "pass --wait" not in said, said


def test_an_aborted_upload_leaves_nothing(s3_bucket):
    target = f"{s3_bucket}/x/part-00000.parquet"
    f = storage.AtomicFile(target)
    f.write(b"x" * (6 << 20))  # past s3fs's part size: a multipart upload is under way
    f.file.flush()
    f.discard()
    assert not storage.path(target).exists()
    with storage.AtomicFile(target) as g:
        g.write(b"whole")
    assert storage.path(target).read_bytes() == b"whole"


def test_no_bucket_or_no_driver_is_a_clean_refusal(tmp_path, s3_endpoint, c4_60, tokenizer_dir):
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "entroweight.workflows.cli",
            "tokenize",
            str(c4_60),
            "--tokenizer",
            str(tokenizer_dir),
            "--out",
            "s3://no-such-bucket-ew/out",
        ],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert cli.returncode == 2, cli.stderr
    assert "Traceback" not in cli.stderr and "no-such-bucket-ew" in cli.stderr


def test_the_cli_reads_and_writes_s3(tmp_path, s3_bucket, c4_60, tokenizer_dir, model):
    s3fs().put(str(c4_60), f"{s3_bucket}/raw/c4.jsonl.gz")

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "entroweight.workflows.cli", *args],
            capture_output=True,
            text=True,
            env=os.environ.copy(),
        )

    tok = cli(
        "tokenize",
        f"{s3_bucket}/raw/*.jsonl.gz",
        "--tokenizer",
        str(tokenizer_dir),
        "--out",
        f"{s3_bucket}/tokens",
        "--n-ctx",
        str(N_CTX),
        "--shard-docs",
        "20",
    )
    assert tok.returncode == 0, tok.stderr
    assert "60 docs in" in tok.stdout
    scored = cli(
        "score",
        f"{s3_bucket}/tokens",
        "--scorer",
        "causal_loss",
        "--model",
        str(model),
        "--dtype",
        "fp32",
        "--out",
        f"{s3_bucket}/scored",
    )
    assert scored.returncode == 0, scored.stderr
    missing = cli(
        "score",
        f"{s3_bucket}/nothing-here",
        "--scorer",
        "causal_loss",
        "--model",
        str(model),
        "--out",
        f"{s3_bucket}/x",
    )
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_verify_and_inspect_read_s3_and_catch_tampering(tmp_path, s3_bucket, c4_60, tokenizer_dir):
    from entroweight.pipelines.verify import verify_dir
    from entroweight.transforms.inspect import summarize

    out = f"{s3_bucket}/tokens"
    tokenize(c4_60, tokenizer_dir, out)
    tokenize(c4_60, tokenizer_dir, tmp_path / "tok")
    assert verify_dir(out) == []
    remote, local = summarize(out), summarize(tmp_path / "tok")
    assert remote == local  # the same summary, wherever the data lives

    s3, root = s3fs(), out.removeprefix("s3://")
    parts = DataDir(out).parts
    body = bytearray(s3.cat(f"{root}/{parts[1].name}"))
    body[100] ^= 0xFF  # one flipped byte inside a page
    s3.pipe(f"{root}/{parts[1].name}", bytes(body))
    s3.rm(f"{root}/.{parts[2].manifest.shard}.manifest.json")
    s3.pipe(f"{root}/stray.parquet", b"PAR1")
    problems = verify_dir(out)
    assert any(parts[1].manifest.shard in p and "sha256 differs" in p for p in problems), problems
    assert any(parts[2].manifest.shard in p and "no manifest" in p for p in problems), problems
    assert any(p.startswith("stray.parquet") for p in problems), problems
    cli = subprocess.run(
        [sys.executable, "-m", "entroweight.workflows.cli", "verify", out],
        capture_output=True,
        text=True,
        env=os.environ.copy(),
    )
    assert cli.returncode == 1 and "sha256 differs" in cli.stdout + cli.stderr
