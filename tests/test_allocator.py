"""A scoring worker keeps freed memory for its next batch (entroweight/allocator.py): no fresh pages
faulted in a batch, on Linux with glibc; elsewhere the allocator is left alone."""

import os
import platform
import subprocess
import sys

import pytest
from test_verify import IdParity  # a model-free scorer (the stage's worker setup is under test)

from entroweight.pipelines import run_stage

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# a tensor freed and allocated again, as a forward does each batch: page faults of the second half
PROBE = """
import resource, sys, torch
from entroweight.allocator import keep_freed_memory
kept = sys.argv[1] == "1" and keep_freed_memory()
for _ in range(3):
    torch.ones(48 << 18)  # 48 MiB (above glibc's largest threshold) ...
    torch.ones(8 << 18)  # ... and 8 MiB (below it: from the heap when kept)
start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    torch.ones(8 << 18)
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
"""


def _faults(keep: bool) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, "1" if keep else "0"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    ).stdout.split()
    return out[0], int(out[1])


@pytest.mark.skipif(not GLIBC, reason="glibc's mallopt")
def test_freed_memory_is_reused_not_faulted_in_again():
    kept, faults = _faults(keep=True)
    assert kept == "True"
    default_kept, default_faults = _faults(keep=False)
    assert default_kept == "False"
    # 20 allocations of 8 MiB: 2048 pages each when faulted in again, none when reused
    assert faults < 200 < default_faults


def test_it_is_set_once_and_says_whether_it_was():
    from entroweight.allocator import keep_freed_memory

    assert keep_freed_memory() is GLIBC
    assert keep_freed_memory() is GLIBC


def test_the_score_stage_sets_it_in_each_worker(tokenized_dir, tmp_path, monkeypatch):
    """Every engine calls the stage's setup once in each worker process: that is where it is set."""
    import entroweight.pipelines.score as score

    calls = []
    monkeypatch.setattr(score, "keep_freed_memory", lambda: calls.append(1) or True)
    run_stage(score.ScoreStage(tokenized_dir, IdParity.name), tmp_path / "scored", progress=False)
    assert calls == [1]
