"""`make bench`: every stage's throughput beside its bare limit, in one run.

Usage, from the repository root: python -m benchmarks.run_all [--quick] [--only NAME ...] [--out DIR]
(the benchmarks read tests/data, so they run from the checkout and do not ship in the wheel)

Each module in MODULES exports `run(quick: bool) -> list[row]` (rows from `common.row`). A listed module
that does not exist yet is skipped with a note; one that raises gets an error row and the others still
run; the exit code is 1 if any module failed. The table, the rows and the machine they were measured
on go to `<out>/results.json` and `<out>/results.md`.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from .common import REPO, check_target, row

# Benchmark modules, in pipeline order. A name with a dot is imported as a full module path (your own).
MODULES = (
    "tokenize",
    "corpora",
    "engines",
    "object_store",
    "scoring",
    "score_memory",
    "estimator_scoring",
    "models",
    "synthesize",
    "trainer",
    "export",
)
COLUMNS = ("stage", "metric", "value", "bare", "ratio", "target", "ok?")


def machine_info() -> dict:
    """What the figures depend on: cores (and how loaded they were), torch, the device."""
    cuda = torch.cuda.is_available()
    try:
        commit = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_avg_start": [round(x, 2) for x in os.getloadavg()],
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "python": platform.python_version(),
        "commit": commit,
    }


def _import(name: str):
    """The module, or None when it does not exist (yet): a listed benchmark still being written."""
    full = name if "." in name else f"{__package__}.{name}"
    try:
        return importlib.import_module(full)
    except ModuleNotFoundError as e:
        if e.name == full:
            return None
        raise  # the module exists but imports something missing: that is a failure, not a skip


def run_modules(names, quick: bool) -> tuple[list[dict], list[dict]]:
    """(rows, one status dict per module). Never raises for a module's own failure."""
    rows, status = [], []
    for name in names:
        start = time.perf_counter()
        try:
            module = _import(name)
            if module is None:
                rows.append(row(name, "skipped", float("nan"), note="module does not exist yet"))
                status.append({"name": name, "status": "skipped", "seconds": 0.0})
                print(f"\n## {name}: skipped (module does not exist yet)", flush=True)
                continue
            new = module.run(quick=quick)
            for r in new:
                missing = {"stage", "metric", "value", "bare", "ratio", "target", "note"} - set(r)
                if missing:
                    raise ValueError(f"{name}: row {r} lacks {sorted(missing)}; build rows with common.row")
        except Exception as e:
            traceback.print_exc()
            seconds = time.perf_counter() - start
            msg = f"{type(e).__name__}: {e}".splitlines()[0][:300]
            rows.append(row(name, "ERROR", float("nan"), note=msg))
            status.append({"name": name, "status": "failed", "seconds": round(seconds, 1), "error": msg})
            print(f"\n## {name}: FAILED after {seconds:.0f} s: {msg}", flush=True)
            continue
        seconds = time.perf_counter() - start
        rows += new
        status.append({"name": name, "status": "ok", "seconds": round(seconds, 1)})
        print(f"\n## {name} ({seconds:.0f} s)\n" + format_table(new), flush=True)
    for r in rows:
        r["ok"] = check_target(r)
    return rows, status


def _fmt(v, digits: str = ".4g") -> str:
    if v is None or v != v:  # None or NaN
        return ""
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:{digits}}"


def _cells(r: dict) -> list[str]:
    ok = {True: "yes", False: "NO", None: ""}[r.get("ok", check_target(r))]
    return [
        r["stage"],
        r["metric"],
        _fmt(r["value"]),
        _fmt(r["bare"]),
        _fmt(r["ratio"], ".3f"),
        r["target"] or "",
        ok,
    ]


def format_table(rows: list[dict], notes: bool = True) -> str:
    """Plain text, aligned: for the terminal; each row's note on the line below it."""
    cells = [list(COLUMNS)] + [_cells(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = []
    for k, c in enumerate(cells):
        just = [
            s.rjust(w) if i in (2, 3, 4) else s.ljust(w)
            for i, (s, w) in enumerate(zip(c, widths, strict=True))
        ]
        lines.append("  ".join(just).rstrip())
        if notes and k and rows[k - 1].get("note"):
            lines.append("    " + rows[k - 1]["note"])
    return "\n".join(lines)


def format_markdown(rows: list[dict], info: dict, status: list[dict]) -> str:
    head = (
        f"# entroweight benchmarks ({info['mode']})\n\n"
        f"{info['date']}, commit {info['commit'] or '?'}: {info['cpus_usable']} usable of {info['cpu_count']} CPUs "
        f"({info['cpu']}), device {info['device']}, torch {info['torch']} ({info['torch_threads']} threads), "
        f"Python {info['python']}; load average {info['load_avg_start']} at start, {info['load_avg_end']} at "
        f"the end (other processes share the machine: absolute rates are noisy, ratios much less so).\n\n"
        "Modules: " + ", ".join(f"{s['name']} {s['status']} ({s['seconds']:.0f} s)" for s in status) + "\n\n"
    )
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    table += ["| " + " | ".join(c.replace("|", "\\|") for c in _cells(r)) + " |" for r in rows]
    notes = [f"- **{r['stage']} / {r['metric']}**: {r['note']}" for r in rows if r.get("note")]
    return head + "\n".join(table) + ("\n\nNotes:\n\n" + "\n".join(notes) if notes else "") + "\n"


def _plain(o):
    """numpy scalars and anything else a module put in a row, as JSON can hold them."""
    return o.item() if hasattr(o, "item") else str(o)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small inputs (< ~45 s a module): a smoke run")
    p.add_argument("--only", nargs="+", default=None, metavar="NAME", help=f"run only these of {MODULES}")
    p.add_argument("--out", default="bench-out", help="write results.json and results.md here")
    args = p.parse_args(argv)
    info = machine_info() | {"mode": "quick" if args.quick else "full"}
    print(
        f"# entroweight benchmarks ({info['mode']}): {info['cpus_usable']} CPUs, device {info['device']}, "
        f"torch {info['torch']} ({info['torch_threads']} threads), load average {info['load_avg_start']}",
        flush=True,
    )
    start = time.perf_counter()
    rows, status = run_modules(args.only or MODULES, args.quick)
    info["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    info["seconds"] = round(time.perf_counter() - start, 1)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"machine": info, "modules": status, "columns": list(COLUMNS), "rows": rows}
    # NaN is not JSON: a skipped or failed module's value is null
    clean = [{k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in rows]
    (out / "results.json").write_text(json.dumps(results | {"rows": clean}, indent=2, default=_plain) + "\n")
    (out / "results.md").write_text(format_markdown(rows, info, status))

    print(f"\n# All benchmarks ({info['mode']}, {info['seconds']:.0f} s)\n" + format_table(rows, notes=False))
    print(f"\nwrote {out / 'results.json'} and {out / 'results.md'}")
    failed = [s["name"] for s in status if s["status"] == "failed"]
    if failed:
        print(f"FAILED benchmark modules: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
