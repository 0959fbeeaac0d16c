"""The engines with every path on object storage (issue 16, "clusters without a shared disk"): Beam's
task list and results go through the store too, in a directory of the run's own; on the loopback S3
server (tests/s3server.py)."""

from __future__ import annotations

import pytest
from test_object_store import parquet_bytes, s3fs, tokenize
from test_object_store import source as s3_source  # noqa: F401 - a fixture

from entroweight import storage


@pytest.mark.slow
def test_beam_multi_processing_on_s3_matches_local(tmp_path, s3_bucket, s3_source, tokenizer_dir):
    s3fs().put(str(s3_source), f"{s3_bucket}/raw/c4.jsonl.gz")
    s3fs().put(str(tokenizer_dir / "tokenizer.json"), f"{s3_bucket}/tok/tokenizer.json")
    tokenize(s3_source, tokenizer_dir, tmp_path / "local")
    out = f"{s3_bucket}/tokens"
    summary = tokenize(
        f"{s3_bucket}/raw/c4.jsonl.gz", f"{s3_bucket}/tok/tokenizer.json", out, engine="beam", workers=2
    )
    assert summary.shards_run == 3
    assert parquet_bytes(out) == parquet_bytes(tmp_path / "local")
    assert not storage.walk(f"{out}/.engine")  # the run's task list and results are gone


def test_beam_leaves_other_runs_in_a_shared_temp_location_alone(s3_bucket, s3_source, tokenizer_dir):
    temp = f"{s3_bucket}/beam-temp"
    other = f"{temp}/.engine/beam-another-run/tasks.jsonl"  # a concurrent run's task list
    storage.write_text_atomic('{"shard": "part-00000"}\n', other)
    summary = tokenize(
        s3_source, tokenizer_dir, f"{s3_bucket}/tokens", engine="beam", options={"temp_location": temp}
    )
    assert summary.shards_run == 3
    assert storage.path(other).read_text() == '{"shard": "part-00000"}\n'
    assert list(storage.walk(temp)) == [".engine/beam-another-run/tasks.jsonl"]  # ours is gone
