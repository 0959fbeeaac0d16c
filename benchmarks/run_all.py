"""`make bench`: every stage's throughput beside its bare limit, in one run.

Usage: python -m entroweight.benchmarks.run_all [--quick] [--only NAME ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import time
import traceback

import torch

# Benchmark modules, in pipeline order; each has run(quick) -> list of rows (see common.row).
MODULES = ("tokenize", "engines", "scoring", "estimator_scoring", "models", "trainer")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small inputs: a smoke run")
    p.add_argument("--only", nargs="*", default=None, help="run only these modules")
    p.add_argument("--json", default="bench-out/results.json", help="also write the rows here")
    args = p.parse_args(argv)
    print(
        f"# entroweight benchmarks on {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} torch threads, {'quick' if args.quick else 'full'} run"
    )
    rows, failed = [], []
    for name in args.only or MODULES:
        try:
            module = importlib.import_module(f"entroweight.benchmarks.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"entroweight.benchmarks.{name}":
                continue
            raise
        start = time.perf_counter()
        try:
            new = module.run(quick=args.quick)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            continue
        rows += new
        _print(new, f"{name} ({time.perf_counter() - start:.0f} s)")
    from pathlib import Path

    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(rows, indent=2))
    if failed:
        print(f"FAILED benchmark modules: {', '.join(failed)}")
    return 1 if failed else 0


def _print(rows: list[dict], title: str) -> None:
    print(f"\n## {title}")
    print(f"{'stage':<18} {'metric':<44} {'value':>12} {'bare':>12} {'ratio':>7}  target")
    for r in rows:
        bare = "" if r["bare"] is None else f"{r['bare']:,.3f}"
        ratio = "" if r["ratio"] is None else f"{r['ratio']:.3f}"
        print(
            f"{r['stage']:<18} {r['metric']:<44} {r['value']:>12,.3f} {bare:>12} {ratio:>7}  {r['target'] or ''}"
        )
        if r.get("note"):
            print(f"{'':<18}   {r['note']}")


if __name__ == "__main__":
    raise SystemExit(main())
