"""`make bench` does not rot: the harness's table and results files, a real quick benchmark end to end,
missing and failing modules."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import run_all
from benchmarks.common import check_target, row

ROOT = Path(__file__).resolve().parent.parent  # `python -m benchmarks.run_all` runs from here
ROW_KEYS = {"stage", "metric", "value", "bare", "ratio", "target", "note", "ok"}
MACHINE_KEYS = {
    "cpu_count",
    "cpus_usable",
    "torch",
    "torch_threads",
    "device",
    "load_avg_start",
    "load_avg_end",
}


def test_quick_tokenize_end_to_end(tmp_path):
    """The real command on the real tokenize benchmark: table on stdout, JSON and Markdown on disk."""
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.run_all",
            "--quick",
            "--only",
            "tokenize",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "# All benchmarks (quick" in res.stdout
    header = [line for line in res.stdout.splitlines() if line.startswith("stage")]
    assert header and header[-1].split() == ["stage", "metric", "value", "bare", "ratio", "target", "ok?"]

    results = json.loads((tmp_path / "results.json").read_text())
    assert MACHINE_KEYS <= set(results["machine"]) and results["machine"]["mode"] == "quick"
    assert results["machine"]["device"] == "cpu" or "cuda" not in results["machine"]["device"]
    assert results["modules"] == [
        {"name": "tokenize", "status": "ok", "seconds": results["modules"][0]["seconds"]}
    ]
    rows = {r["metric"]: r for r in results["rows"]}
    assert all(set(r) == ROW_KEYS and r["stage"] == "tokenize" for r in rows.values())
    stage = rows["MB/s (left-pad, from .json.gz)"]
    # the stage and its bare limit are both real rates; the ratio is theirs (4 significant digits each)
    assert stage["value"] > 0 and stage["bare"] > 0
    assert stage["ratio"] == pytest.approx(stage["value"] / stage["bare"], rel=2e-3)
    assert stage["ok"] == (stage["ratio"] >= 0.95)
    assert 1.0 < rows["disk B/real token (ids, left-pad)"]["value"] < 4.0
    assert rows["peak RSS MB (4x input vs 1x)"]["bare"] > 50  # a real process's RSS in MB

    md = (tmp_path / "results.md").read_text()
    assert "| stage | metric | value | bare | ratio | target | ok? |" in md
    assert md.count("\n| tokenize |") == len(rows)


def test_missing_and_failing_modules(tmp_path, monkeypatch, capsys):
    """A listed module that does not exist yet is skipped with a note; one that raises gets an error
    row, the others still run, and the exit code says so."""
    pkg = tmp_path / "mybench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(
        "from benchmarks.common import row\n"
        "def run(quick):\n"
        "    return [row('x', 'tokens/s', 95.0, 100.0, '>= 0.9'), row('x', 'B/token', 1.8, None, '<= 1.7')]\n"
    )
    (pkg / "bad.py").write_text("def run(quick):\n    raise RuntimeError('no model here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    out = tmp_path / "out"

    rc = run_all.main(
        ["--quick", "--only", "not_written_yet", "mybench.bad", "mybench.good", "--out", str(out)]
    )
    assert rc == 1
    results = json.loads((out / "results.json").read_text())  # strict JSON: no NaN
    status = {m["name"]: m["status"] for m in results["modules"]}
    assert status == {"not_written_yet": "skipped", "mybench.bad": "failed", "mybench.good": "ok"}
    by_stage = {r["stage"]: r for r in results["rows"]}
    assert by_stage["not_written_yet"]["metric"] == "skipped" and by_stage["not_written_yet"]["value"] is None
    assert by_stage["mybench.bad"]["metric"] == "ERROR" and "no model here" in by_stage["mybench.bad"]["note"]
    good = [r for r in results["rows"] if r["stage"] == "x"]
    assert [(r["ratio"], r["ok"]) for r in good] == [(0.95, True), (None, False)]
    assert "FAILED benchmark modules: mybench.bad" in capsys.readouterr().err

    # a module that exists but imports something missing is a failure, not a skip
    (pkg / "broken.py").write_text("import a_package_nobody_has\ndef run(quick):\n    return []\n")
    assert run_all.main(["--only", "mybench.broken", "--out", str(out)]) == 1
    assert json.loads((out / "results.json").read_text())["modules"][0]["status"] == "failed"


def test_targets():
    assert check_target(row("s", "m", 0.96, 1.0, ">= 0.95")) is True  # on the ratio when there is a bare
    assert check_target(row("s", "m", 0.9, 1.0, ">= 0.95")) is False
    assert check_target(row("s", "m", 1.63, None, "<= 1.7")) is True  # else on the value
    assert check_target(row("s", "m", 3e-7, None, "< 1e-5")) is True
    assert (
        check_target(row("s", "m", 3.3, None, "~3.1")) is True
        and check_target(row("s", "m", 3.5, None, "~3.1")) is False
    )
    assert check_target(row("s", "m", 500, 510, "ratio ~1.0")) is True
    assert check_target(row("s", "m", 5, None, None)) is None
    assert check_target(row("s", "m", 5, None, "fast")) is None  # not a checkable target
    assert check_target(row("s", "m", math.nan, None, ">= 1")) is False
    # small values keep their digits
    assert row("s", "m", 3.14159e-7)["value"] == 3.142e-7


def test_modules_listed_exist_or_are_pending():
    """Every module run_all lists either exists with run(quick) or is a pending name (no file yet)."""
    bench_dir = Path(run_all.__file__).parent
    for name in run_all.MODULES:
        if (bench_dir / f"{name}.py").exists():
            module = run_all._import(name)
            assert callable(getattr(module, "run", None)), f"benchmarks/{name}.py has no run(quick)"
