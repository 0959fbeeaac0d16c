"""One way to list a data directory (issue 25): a library module reads a data directory's parts
through `DataDir` (schemas/datadir.py), never by its own listing. This test reads the source with
`ast` and fails on a raw listing (`storage.listing`, `storage.walk`) outside the few modules whose
job it is, and on any listing filtered for parts (`.glob("part-*")`, `.glob("*.parquet")`,
`name.startswith("part-")`, ...) anywhere in the library."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("schemas", "transforms", "scorers", "trainers", "pipelines", "workflows", "models", "entroweight")

# module -> why it may list a directory raw (with storage.listing / storage.walk)
RAW_LISTING = {
    "entroweight/storage.py": "the storage layer: the primitive itself",
    "entroweight/output.py": "the path rule: whose output a directory is, a user's files in it, an output's files",
    "schemas/datadir.py": "DataDir: the one place a listing becomes a data directory's parts",
    "pipelines/stage.py": "the stage planner's own bookkeeping of its --out (temp files, rejects, done shards)",
    "pipelines/beam.py": "the Beam engine's results directory (JSON results, not data)",
    "pipelines/__init__.py": "run_stage: whether --out existed before the run (a created directory is removed)",
    "transforms/sources.py": "source discovery: whether an input file lies in a stage's output (not its parts)",
    "workflows/engine/runner.py": "whether run_dir is a workflow run's (run.json, its lock), not a data directory",
}
# modules that may name part files themselves: the naming contract, DataDir, the planner's bookkeeping,
# and the path rule (entroweight.output: output_owner, foreign_files: a stage's shards told from a user's files, in
# the lowest layer, below the schemas that name them)
PART_NAMES = {"schemas/manifest.py", "schemas/datadir.py", "pipelines/stage.py", "entroweight/output.py"}
# modules being rewritten elsewhere that still list parts themselves: remove the entry with the rewrite
PENDING: dict[str, str] = {}
PART_PATTERN = re.compile(r"(^|[*./])part-|\*\.parquet|\.parquet$")
FILTERS = {"glob", "rglob", "iglob", "startswith", "endswith", "fnmatch", "match", "filter"}


def library_modules() -> list[Path]:
    return sorted(p for layer in LIBRARY for p in (ROOT / layer).rglob("*.py"))


def violations(path: Path) -> list[str]:
    rel = str(path.relative_to(ROOT))
    tree = ast.parse(path.read_text(), filename=rel)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
        if name in ("listing", "walk") and rel not in RAW_LISTING:
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            if owner in ("storage", "") or name == "listing":
                found.append(
                    f"{rel}:{node.lineno}: {owner + '.' if owner else ''}{name}(...) lists a directory raw"
                )
        if name in FILTERS and rel not in PART_NAMES:
            for arg in node.args:
                if (
                    isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str)
                    and PART_PATTERN.search(arg.value)
                ):
                    found.append(
                        f"{rel}:{node.lineno}: .{name}({arg.value!r}) picks a data directory's parts"
                    )
    return found


def test_no_library_module_lists_a_data_directory_around_datadir():
    bad = []
    for path in library_modules():
        rel = str(path.relative_to(ROOT))
        if rel in PENDING:
            continue
        bad += violations(path)
    assert not bad, (
        "list a data directory through DataDir (schemas/datadir.py: .parts, .files, data_files), or add the "
        "module to RAW_LISTING with the reason:\n" + "\n".join(bad)
    )


def test_the_allow_lists_are_not_stale():
    """An allow-listed module still exists; a pending one that no longer lists parts leaves the list."""
    for rel in (*RAW_LISTING, *PENDING, *PART_NAMES):
        assert (ROOT / rel).is_file(), f"{rel} is allow-listed but gone"
    for rel, why in PENDING.items():
        assert violations(ROOT / rel), f"{rel} lists through DataDir now: remove it from PENDING ({why})"


def test_the_rule_catches_the_old_ways(tmp_path):
    layer = tmp_path / "transforms"
    layer.mkdir()
    src = layer / "old.py"
    src.write_text(
        "from pathlib import Path\nfrom entroweight import storage\n"
        "a = sorted(Path(d).glob('part-*.parquet'))\n"
        "b = [n for n in storage.listing(d) if n.startswith('part-')]\n"
        "c = list(Path(d).glob('*.parquet'))\n"
    )
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = violations(src)
    finally:
        ROOT = saved
    assert len(found) == 4, found
