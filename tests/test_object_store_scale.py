"""Planning on an object store lists --out once and reads the manifests in parallel: no request per
shard beyond the manifest's own GET (issue 16, "Planning that scales"). Counted on the loopback S3
server (tests/s3server.py) at the s3fs client, by API call."""

from __future__ import annotations

import collections

import pytest
import s3fs

from benchmarks.object_store import populate_done
from entroweight.pipelines.stage import plan_run

N = 600  # 1,202 objects: two pages of a LIST


@pytest.fixture
def s3_calls(monkeypatch):
    calls = collections.Counter()
    original = s3fs.S3FileSystem._call_s3

    async def counted(self, method, *args, **kwargs):
        calls[method if isinstance(method, str) else getattr(method, "__name__", str(method))] += 1
        return await original(self, method, *args, **kwargs)

    monkeypatch.setattr(s3fs.S3FileSystem, "_call_s3", counted)
    return calls


def test_planning_many_done_shards_costs_one_listing_and_a_get_per_manifest(s3_bucket, s3_calls):
    out = f"{s3_bucket}/plan"
    stage = populate_done(out, N)
    s3_calls.clear()
    plan = plan_run(stage, out)
    assert len(plan.done) == N and not plan.todo
    lists = sum(v for k, v in s3_calls.items() if k.startswith("list_objects"))
    heads = s3_calls.get("head_object", 0)
    gets = s3_calls.get("get_object", 0)
    assert lists <= 6, s3_calls  # a few listings (pages), not one per shard
    assert heads <= 4, s3_calls  # no per-shard existence check
    assert N <= gets <= N + 4, s3_calls  # each manifest once, plus the stage record and registry
