"""Helpers the benchmarks share: the bundled text, timing, result rows and their targets."""

from __future__ import annotations

import atexit
import gzip
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

from entroweight.transforms.train_tokenizer import DEFAULT_BASE as LLAMA3
from entroweight.transforms.train_tokenizer import save_tokenizer, train_bpe

REPO = Path(__file__).resolve().parent.parent
C4 = REPO / "tests" / "data" / "c4" / "c4-sample.00000-of-00001.json.gz"


def c4_texts() -> list[str]:
    with gzip.open(C4, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


_TOKENIZERS: dict[tuple[int, bool], Path] = {}


def bench_tokenizer(vocab: int = 8000, quick: bool = False) -> Path:
    """A BPE of `vocab` tokens (Llama 3 pre-tokenizer) trained on the C4 sample (quick: its first 300
    docs), trained once per process and shared by the modules of one `make bench` run."""
    if (vocab, quick) not in _TOKENIZERS:
        d = Path(tempfile.mkdtemp(prefix=f"bench-tok{vocab}-"))
        atexit.register(shutil.rmtree, d, True)
        save_tokenizer(train_bpe(c4_texts()[: 300 if quick else None], vocab, LLAMA3), d)
        _TOKENIZERS[vocab, quick] = d
    return _TOKENIZERS[vocab, quick]


def write_jsonl_gz(path: Path, texts: list[str], copies: int = 1) -> int:
    """`texts` repeated `copies` times as gzip jsonl (what users feed the tokenizer); returns text bytes."""
    with gzip.open(path, "wt", encoding="utf-8", compresslevel=1) as f:
        for _ in range(copies):
            f.writelines(json.dumps({"text": t}) + "\n" for t in texts)
    return copies * sum(len(t.encode()) for t in texts)


def bench_threads() -> int:
    """Intra-op torch threads for CPU model benchmarks: ENTROWEIGHT_BENCH_THREADS, else 1 when the
    machine is already busy (1-minute load >= usable cores: OpenMP threads spin-waiting on each other
    there run a model several times slower and far noisier), else torch's default."""
    if os.environ.get("ENTROWEIGHT_BENCH_THREADS"):
        return int(os.environ["ENTROWEIGHT_BENCH_THREADS"])
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return 1 if os.getloadavg()[0] >= cores else torch.get_num_threads()


class PeakRSS:
    """Peak resident memory of this process inside a `with` block (sampled every 20 ms), in MB; `.start`
    is the RSS on entry, so `.peak - .start` is what the block added."""

    def __init__(self, every: float = 0.02):
        import psutil

        self._proc, self._every, self._stop = psutil.Process(), every, threading.Event()

    def _sample(self):
        while not self._stop.wait(self._every):
            self.peak = max(self.peak, self._proc.memory_info().rss / 2**20)

    def __enter__(self):
        self.start = self.peak = self._proc.memory_info().rss / 2**20
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._proc.memory_info().rss / 2**20)


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def alternate(fns: dict, rounds: int) -> dict[str, list[float]]:
    """Seconds of each of `fns` over `rounds` rounds, run in alternating order (A B, B A, ...), so that
    load from other processes on a shared machine falls on every variant alike."""
    times = {name: [] for name in fns}
    order = list(fns)
    for i in range(rounds):
        for name in order if i % 2 == 0 else order[::-1]:
            times[name].append(timed(fns[name]))
    return times


def median(xs) -> float:
    return float(statistics.median(xs))


def fastest(times: list[float]) -> float:
    """The time a ratio takes from alternated runs: the fastest. Load from other processes only ever
    slows a run (on the shared 2-core machine one path's alternated runs spread by ±20 %), so the
    fastest run is the nearest to the code's own cost, as `timeit` advises; path and limit are taken
    alike."""
    return float(min(times))


def paired_median(slow: list[float], fast: list[float]) -> float:
    """The median over rounds of fast/slow, each pair timed side by side: how steady a ratio is."""
    return median([f / s for s, f in zip(slow, fast, strict=True)])


def row(stage, metric, value, bare=None, target=None, note="") -> dict:
    """One result. `bare` is the limit measured in the same run on the same input (ratio = value/bare);
    `target` is checked on the ratio when there is a bare, else on the value (see check_target)."""
    return {
        "stage": stage,
        "metric": metric,
        "value": _round(value),
        "bare": None if bare is None else _round(bare),
        "ratio": None if not bare else _round(value / bare),
        "target": target,
        "note": note,
    }


def _round(x) -> float:
    """Four significant digits: enough under this noise, and small errors (1e-7) do not round to 0."""
    return float(f"{float(x):.4g}")


_TARGET = re.compile(r"^\s*(ratio|value)?\s*(>=|<=|==|>|<|~)\s*([-+0-9.eE]+)\s*$")


def check_target(r: dict) -> bool | None:
    """Whether a row meets its target: ">= 0.95", "<= 1.7", "< 1e-5", "~3.1" (within 10%); prefixed
    "ratio"/"value" to say which column, else the ratio if the row has one, else the value.
    None when there is no target or it is not in this form."""
    m = _TARGET.match(r.get("target") or "")
    if not m:
        return None
    which, op, limit = m.group(1), m.group(2), float(m.group(3))
    x = r.get(which) if which else (r["ratio"] if r.get("ratio") is not None else r["value"])
    if x is None or x != x:  # missing or NaN: the target is not met
        return False
    return {
        ">=": x >= limit,
        "<=": x <= limit,
        ">": x > limit,
        "<": x < limit,
        "==": x == limit,
        "~": abs(x - limit) <= 0.1 * abs(limit),
    }[op]
