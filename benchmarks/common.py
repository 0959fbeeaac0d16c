"""Helpers the benchmarks share: the bundled text, timing, result rows."""

from __future__ import annotations

import gzip
import json
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
C4 = REPO / "tests" / "data" / "c4" / "c4-sample.00000-of-00001.json.gz"
WIKITEXT = REPO / "tests" / "data" / "wikitext" / "wiki.test.raw"
LLAMA3 = REPO / "tests" / "data" / "tokenizers" / "llama3"


def c4_texts() -> list[str]:
    with gzip.open(C4, "rt", encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


def best_of(fn, repeat: int = 3) -> float:
    """The fastest of `repeat` runs, in seconds: the least disturbed by other load on the machine."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def row(stage, metric, value, bare=None, target=None, note="") -> dict:
    return {
        "stage": stage,
        "metric": metric,
        "value": round(value, 3),
        "bare": None if bare is None else round(bare, 3),
        "ratio": None if not bare else round(value / bare, 3),
        "target": target,
        "note": note,
    }
