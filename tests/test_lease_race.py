"""The object-store lease under races, against the real loopback S3 server (tests/s3server.py, moto,
which honours `If-None-Match: *` and `If-Match` on PutObject): several processes contending for one
expired lease, many times over, and never two holders at once."""

from __future__ import annotations

import json
import multiprocessing as mp
import time

import pytest

from entroweight import storage

CONTENDERS, TRIALS = 4, 30


def _contender(bucket: str, barrier, results) -> None:
    for t in range(TRIALS):
        key = f"{bucket}/race/{t}/.lock"
        barrier.wait()  # all at once on the same expired lease
        try:
            held = storage.lock(key, wait=0, ttl=60)
        except storage.LockBusy:
            held = None
        results.put((t, held is not None, held.holder if held else None))
        barrier.wait()  # every attempt of this trial is over before the winner lets go
        if held is not None:
            held.release()


def test_contenders_for_an_expired_lease_never_both_hold_it(s3_bucket):
    for t in range(TRIALS):  # a dead holder's expired lease at each trial's key
        storage.path(f"{s3_bucket}/race/{t}/.lock").write_bytes(
            json.dumps({"holder": "dead@elsewhere:1:0", "expires": 0}).encode()
        )
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(CONTENDERS), ctx.Queue()
    procs = [ctx.Process(target=_contender, args=(s3_bucket, barrier, results)) for _ in range(CONTENDERS)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in range(CONTENDERS * TRIALS)]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    holders = {t: [h for tt, won, h in got if tt == t and won] for t in range(TRIALS)}
    doubled = {t: h for t, h in holders.items() if len(h) != 1}
    assert not doubled, f"{len(doubled)} of {TRIALS} trials had not exactly one holder: {doubled}"


def test_a_holder_that_lost_its_lease_does_not_overwrite_its_successor(s3_bucket):
    """A holder paused past its TTL is taken over; its next renewal must not overwrite the new lease."""
    key = f"{s3_bucket}/paused/.lock"
    first = storage.lock(key, ttl=0.3)
    first._stop.set()  # paused: no renewal
    first._beat.join()
    time.sleep(0.4)  # expired
    second = storage.lock(key, ttl=60)
    try:
        assert not first._put(IfMatch=first._etag)  # the renewal the paused holder would send
        assert json.loads(storage.path(key).read_bytes())["holder"] == second.holder
        first.release()  # not its lease any more: left alone
        assert json.loads(storage.path(key).read_bytes())["holder"] == second.holder
    finally:
        second.release()
    assert not storage.path(key).exists()


def test_a_local_path_keeps_its_file_lock(tmp_path):
    held = storage.lock(tmp_path / ".lock")
    try:
        assert not isinstance(held, storage.Lease)
        with pytest.raises(storage.LockBusy):
            storage.lock(tmp_path / ".lock")
    finally:
        held.release()
