"""gs:// parity on a GCS emulator (fake-gcs-server on loopback, tests/gcsserver.py): the same stages
as on S3 give the same bytes as on local disk.

Not tested here: the lease's conditional create. gcsfs sends `ifGenerationMatch=0` for it, which GCS
honours, but the emulator ignores preconditions (gcsfs's own docs say its test harness cannot check
exclusive creates either); the lease logic itself is tested on S3."""

from __future__ import annotations

import fsspec
from test_object_store import parquet_bytes, tokenize

from entroweight.pipelines.verify import verify_dir


def test_tokenize_on_gcs_matches_local_disk(tmp_path, gcs_bucket, c4_60, tokenizer_dir):
    fs = fsspec.filesystem("gs", token="anon")
    fs.put(str(c4_60), f"{gcs_bucket}/raw/c4.jsonl.gz")
    fs.put(str(tokenizer_dir / "tokenizer.json"), f"{gcs_bucket}/tok/tokenizer.json")
    tokenize(c4_60, tokenizer_dir, tmp_path / "local")
    out = f"{gcs_bucket}/tokens"
    summary = tokenize(f"{gcs_bucket}/raw/c4.jsonl.gz", f"{gcs_bucket}/tok/tokenizer.json", out)
    assert summary.shards_run == 3 and summary.docs_in == 60
    assert parquet_bytes(out) == parquet_bytes(tmp_path / "local")
    assert verify_dir(out) == []
    again = tokenize(f"{gcs_bucket}/raw/c4.jsonl.gz", f"{gcs_bucket}/tok/tokenizer.json", out)
    assert again.shards_run == 0 and again.shards_done_before == 3  # planned from one listing
