"""The package works outside the checkout: a regular wheel (not the editable install), installed into
a target directory ahead of the editable install, run from a directory that is not the repository,
with Beam and Ray absent. The defaults the commands ship with (the base tokenizer of train-tokenizer,
the text of eval-bpb) must come from the wheel, not from tests/data."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# The default path must not need the extras: they are made unimportable in every command below.
ABSENT = ["apache_beam", "ray"]
CLI = (
    "import sys; sys.modules.update(dict.fromkeys(sys.argv.pop(1).split(',')));"
    "from entroweight.workflows.cli.main import main; main()"
)


def build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of only what pyproject.toml names, so nothing else of the checkout leaks in."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    src = tmp_path / "src"
    src.mkdir()
    for name in ["pyproject.toml", pyproject["project"]["readme"]]:
        shutil.copy(ROOT / name, src / name)
    for folder in set(pyproject["tool"]["setuptools"]["package-dir"].values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", wheels, src],
        check=True,
        timeout=120,
    )
    (wheel,) = wheels.glob("entroweight-*.whl")
    return wheel


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(tmp)
    site = tmp / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "-q", "install", "--no-deps", "--no-index", "--target", site, wheel],
        check=True,
        timeout=120,
    )
    work = tmp / "work"  # the working directory: not the repository, nothing of it on the path
    work.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site), "PYTHONNOUSERSITE": "1"}
    return {"wheel": wheel, "site": site, "work": work, "env": env}


def run(installed, *args, script: bool = False) -> subprocess.CompletedProcess:
    """`entroweight ARGS` from the wheel: its console script, or the CLI with Beam and Ray absent."""
    if script:
        cmd = [installed["site"] / "bin" / "entroweight"]
    else:
        cmd = [sys.executable, "-c", CLI, ",".join(ABSENT)]
    res = subprocess.run(
        [str(c) for c in [*cmd, *args]],
        cwd=installed["work"],
        env=installed["env"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, f"entroweight {' '.join(map(str, args))}:\n{res.stderr[-3000:]}"
    return res


def test_wheel_holds_the_package_data_and_no_benchmarks(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for data in [
        "entroweight/transforms/data/llama3/tokenizer.json",
        "entroweight/transforms/data/README.md",
        "entroweight/trainers/data/wikitext/wiki.test.raw",
        "entroweight/trainers/data/README.md",
        "entroweight/workflows/default.yaml",
        "entroweight/workflows/report/templates/report.html.j2",  # the report page
    ]:
        assert data in names
    assert not [n for n in names if n.startswith(("entroweight/benchmarks/", "benchmarks/", "tests/"))]


def test_installed_commands_run_outside_the_checkout(installed, c4_path):
    site, work = installed["site"], installed["work"]
    probe = (
        "import entroweight.trainers.bpb as b, entroweight.transforms.train_tokenizer as t;"
        "print(t.DEFAULT_BASE); print(b.DEFAULT_TEXT)"
    )
    found = subprocess.run(
        [sys.executable, "-c", probe], cwd=work, env=installed["env"], capture_output=True, text=True
    )
    base, text = (Path(p) for p in found.stdout.split())
    assert base.is_relative_to(site) and text.is_relative_to(site), found.stdout + found.stderr
    assert (base / "tokenizer.json").is_file() and text.is_file()

    c4 = shutil.copy(c4_path, work / c4_path.name)
    # the installed console script, with the default base tokenizer
    run(installed, "train-tokenizer", c4, "--vocab-size", 300, "--max-docs", 100, "--out", "tok", script=True)
    trained = json.loads((work / "tok" / "tokenizer.json").read_text())
    assert trained["pre_tokenizer"] == json.loads((base / "tokenizer.json").read_text())["pre_tokenizer"]

    run(
        installed, "tokenize", c4, "--tokenizer", "tok", "--n-ctx", 32, "--shard-docs", 500, "--out", "tokens"
    )
    assert sorted(p.name for p in (work / "tokens").glob("*.parquet")) == [
        "part-00000-00000.parquet",  # one file read once, a shard every 500 documents
        "part-00000-00001.parquet",
    ]

    (work / "tiny.yaml").write_text("{d_model: 16, n_layers: 1, n_heads: 2, d_ff: 32}\n")
    train_args = ["--model-config", "tiny.yaml", "--steps", 3, "--batch-size", 4, "--log-every", 1]
    run(installed, "train", "tokens", *train_args, "--tokenizer", "tok", "--device", "cpu", "--out", "ckpt")
    assert (work / "ckpt" / "model.safetensors").is_file()

    res = run(installed, "eval-bpb", "ckpt", "--max-bytes", 20000, "--device", "cpu", "--json")
    result = json.loads(res.stdout[res.stdout.index("{") :])
    assert Path(result["text"]) == text and 0 < result["bpb"] < 20
