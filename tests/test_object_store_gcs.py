"""gs:// parity on a GCS emulator (fake-gcs-server on loopback, tests/gcsserver.py): the same stages
as on S3 give the same bytes as on local disk.

The lease on gs:// writes with generation preconditions (`ifGenerationMatch`: 0 to create, the
generation read to take over or renew), as S3 does with If-None-Match / If-Match. Its race is NOT
tested here: the emulator accepts the requests but ignores their preconditions (a second create of an
existing object succeeds; checked in `test_the_emulator_ignores_preconditions`, which fails the day it
honours them, so the race test of tests/test_lease_race.py can then run on gs:// too). What is tested:
the lease's requests are well-formed and its life cycle (create, read with generation, take over an
expired lease, release) works against the emulator. The race itself is tested on S3."""

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


def test_the_gs_lease_life_cycle_with_generations(gcs_bucket):
    import json
    import time

    from entroweight import storage

    key = f"{gcs_bucket}/lease/.lock"
    first = storage.lock(key, ttl=0.3)
    assert isinstance(first, storage.Lease) and first._gcs
    record, generation = first._read()
    assert record["holder"] == first.holder and generation == first._etag  # the generation it wrote
    first._stop.set()  # paused: its lease expires
    first._beat.join()
    time.sleep(0.4)
    second = storage.lock(key, ttl=60)  # takes over the expired lease (conditional on its generation)
    try:
        assert json.loads(storage.path(key).read_bytes())["holder"] == second.holder
        first.release()  # not its lease any more: left alone
        assert json.loads(storage.path(key).read_bytes())["holder"] == second.holder
    finally:
        second.release()
    assert not storage.path(key).exists()


def test_the_emulator_ignores_preconditions(gcs_bucket):
    """Why the race is not tested on gs:// here: an exclusive create of an existing object succeeds on
    the emulator (GCS answers 412). When this fails, the emulator honours them: run the race here."""
    from entroweight import storage

    key = f"{gcs_bucket}/probe/.lock"
    assert storage.Lease(key)._try_create()
    assert storage.Lease(key)._try_create()  # real GCS: False (412 Precondition Failed)
