"""Workflows: spec refusals name the key, the tiny end-to-end run, incremental reruns, dry run, the lock."""

from __future__ import annotations

import copy
import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from entroweight import output, storage
from entroweight.workflows.cli.main import main
from entroweight.workflows.engine.outputs import RUN_OUTPUTS
from entroweight.workflows.spec import SpecError, load_workflow, parse_workflow

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "tests" / "data" / "workflow-tiny.yaml"
C4 = ROOT / "tests" / "data" / "c4" / "c4-sample.00000-of-00001.json.gz"


def c4_subset(path: Path, start: int, stop: int) -> Path:
    lines = gzip.open(C4, "rt").readlines()[start:stop]
    with gzip.open(path, "wt") as f:
        f.writelines(lines)
    return path


def tiny_spec(tmp: Path, **changes) -> dict:
    spec = yaml.safe_load(TINY.read_text())
    spec["run_dir"] = str(tmp / "run")
    spec["sources"] = [str(c4_subset(tmp / "c4-120.json.gz", 0, 120))]
    spec.update(changes)
    return spec


def write_yaml(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def run_cli(*args) -> tuple[int, str]:
    res = CliRunner().invoke(main, list(map(str, args)), catch_exceptions=False)
    return res.exit_code, res.output


_RUNS: dict[str, dict] = {}  # test_report.py imports the fixture: one run for both files


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> dict:
    """The smaller default workflow, run once end to end: 120 docs, 1k tokenizer, tiny causal model and
    estimator, causal_loss + occlusion scores, reference and weighted runs over 2 seeds, BPB, report."""
    if "tiny" in _RUNS:
        return _RUNS["tiny"]
    tmp = tmp_path_factory.mktemp("wf")
    wf = write_yaml(tmp / "wf.yaml", tiny_spec(tmp))
    start = time.perf_counter()
    code, out = run_cli("run", wf)
    assert code == 0, out
    _RUNS["tiny"] = {
        "yaml": wf,
        "run_dir": tmp / "run",
        "output": out,
        "seconds": time.perf_counter() - start,
    }
    return _RUNS["tiny"]


# -- the spec
def refusal(spec: dict) -> str:
    with pytest.raises(SpecError) as e:
        parse_workflow(spec)
    return str(e.value)


BASE = {"run_dir": "runs/x", "sources": ["a.jsonl"], "tokenizer": {"train": {"vocab_size": 512}}}


@pytest.mark.parametrize("record", ["run.json", ".lock"])
def test_no_step_writes_at_or_below_the_runs_records(record):
    """A step's output that is one of the run's records, or a path below one (a report.out of
    run.json/r.html made `report` crash on mkdir), is refused from the spec, naming the field."""
    for key, out in (("tokenize", record), ("tokenize", f"{record}/tokens"), ("report", f"{record}/r.html")):
        msg = refusal({**BASE, key: {"out": out}})
        assert f"{key}.out" in msg and "is the run directory or its record" in msg, msg


def test_a_missing_source_is_refused_by_the_dry_run_and_the_run_alike(tmp_path):
    """The dry run said "3 of 3 step(s) would run" for a source that does not exist, which the run
    then refused: both refuse it now, in the same words, and nothing is written."""
    for sources in ([str(tmp_path / "nope.jsonl.gz")], [str(tmp_path / "none-*.jsonl")]):
        wf = write_yaml(tmp_path / "wf.yaml", {**BASE, "run_dir": str(tmp_path / "run"), "sources": sources})
        said = []
        for extra in (["--dry-run"], []):
            code, out = run_cli("run", wf, *extra)
            assert code == 2 and "sources: " in out and "Traceback" not in out, out
            said.append(out.strip().splitlines()[-1])
        assert said[0] == said[1]
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("where", ["a file", "below a file", "inside a run", "inside a step's output"])
def test_a_run_dir_where_no_run_can_write_is_refused_by_the_dry_run_and_the_run_alike(tmp_path, where):
    """A run_dir that is a file or lies below one (the dry run planned every step, the run then
    failed on mkdir), or that lies inside another run or a stage's output (the run wrote its steps
    among that output's shards: the other run then failed verification on every rerun, exit 1): both
    refuse it, in the same words naming run_dir, and nothing is written."""
    (tmp_path / "data.jsonl").write_text("x\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    other = tmp_path / "other"
    other.mkdir()
    run_dir = {
        "a file": tmp_path / "notes.txt",
        "below a file": tmp_path / "notes.txt" / "run",
        "inside a run": other / "run",
        "inside a step's output": other / "scores" / "loss" / "run",
    }[where]
    if where == "inside a run":
        (other / "run.json").write_text("{}")
    if where == "inside a step's output":
        (other / "scores" / "loss").mkdir(parents=True)
        (other / "scores" / "loss" / ".stage.json").write_text(json.dumps({"stage": "score"}))
    wf = write_yaml(
        tmp_path / "wf.yaml", {**BASE, "run_dir": str(run_dir), "sources": [str(tmp_path / "data.jsonl")]}
    )
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    said = []
    for extra in (["--dry-run"], []):
        code, out = run_cli("run", wf, *extra)
        assert code == 2 and f"run_dir {run_dir}" in out and "Traceback" not in out, out
        said.append(out.strip().splitlines()[-1])
    assert said[0] == said[1]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_unknown_key_is_refused_with_its_path():
    msg = refusal({**BASE, "scores": [{"name": "a", "scorer": "causal_loss"}, {"name": "b", "scorr": "x"}]})
    assert "scores[1].scorr: unknown key" in msg
    # a step with neither a scorer nor values_from to weigh anew
    msg = refusal({**BASE, "scores": [{"name": "a"}]})
    assert "scores[0]: give either scorer (score the tokens) or values_from" in msg
    assert "tokenize.n_ctxx: unknown key" in refusal({**BASE, "tokenize": {"n_ctxx": 3}})
    assert "colour: unknown key" in refusal({**BASE, "colour": "red"})


SCORED = {"name": "a", "scorer": "causal_loss", "options": {"model": "some/model"}}
READERS_OF_VALUES = {  # what reads a score step's values, each reading step `a`
    "values_from": {"scores": [{"name": "w", "values_from": "a"}]},
    "quantiles_from": {"scores": [{"name": "b", "scorer": "causal_loss", "options": {"model": "m"},
                                   "weighting": {"method": "quantile", "quantiles_from": "a"}}]},
    "agreement": {"scores": [{"name": "b", "scorer": "causal_loss", "options": {"model": "m"}}],
                  "agreement": {"pairs": [{"y": "b", "x": "a"}]}},
    "rescaled run": {"train": {"seeds": [0], "runs": [{"name": "r", "data": "a", "loss": "rescaled"}]}},
}  # fmt: skip


SMALLEST = {  # a checkpoint of each kind a workflow's models step trains, as small as it gets
    "llama": {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32},
    "mixer": {"d_model": 16, "n_layers": 1},
    "estimator": {"encoder_config": {"d_model": 16, "n_layers": 1}, "decoder_config": {"d_model": 16, "n_layers": 1}},
    "autoencoder": {"encoder_config": {"d_model": 16, "n_layers": 1}, "decoder_config": {"d_model": 16, "n_layers": 1}},
}  # fmt: skip


def test_a_checkpoint_from_of_a_kind_its_scorer_refuses_is_refused_from_the_spec(tmp_path):
    """Every scorer that reads our checkpoint × every kind a models step trains: the spec refuses
    `checkpoint_from` exactly where the scorer refuses a real checkpoint of that kind, with its key
    path, before any model trains (causal_loss on an estimator trained it, then was refused; before
    that it scored it, the values reading the tokens after each token)."""
    from entroweight.models import REGISTRY, build_model
    from entroweight.models.checkpoint import save_checkpoint
    from entroweight.scorers import ScorerError, make_scorer
    from entroweight.scorers.registry import BUILTIN, get_scorer_class

    assert set(SMALLEST) == set(REGISTRY) - {"tfree"}  # tfree: a llama of another head
    readers = [n for n in BUILTIN if "checkpoint" in get_scorer_class(n).Options.model_fields]
    assert {"causal_loss", "excess_loss", "occlusion", "grad_input", "decomposition", "two_model"} <= set(
        readers
    )
    for kind, config in SMALLEST.items():
        path = save_checkpoint(build_model(kind, {"vocab_size": 64, "n_ctx": 16, **config}).eval(), kind,
                               tmp_path / kind, tokenizer_sha256="0" * 64, n_ctx=16, pad_id=0)  # fmt: skip
        for name in readers:
            others = {"checkpoint_short": str(path)} if name == "two_model" else {}
            others |= {"reference": str(path)} if name == "excess_loss" else {}
            try:
                make_scorer(name, checkpoint=str(path), **others)
                taken = True
            except ScorerError:
                taken = False
            spec = {**BASE, "models": [{"name": "m", "kind": kind, "config": config}],
                    "scores": [{"name": "s", "scorer": name, "checkpoint_from": "m",
                                "options": {k: "elsewhere" for k in others}}]}  # fmt: skip
            if taken:
                parse_workflow(spec)
            else:
                assert "scores[0].checkpoint_from: 'm' is " in refusal(spec), (name, kind)


@pytest.mark.parametrize("reader", sorted(READERS_OF_VALUES))
def test_values_dropped_by_a_step_that_another_reads_are_refused_from_the_spec(reader):
    """`with_entropy: false` on a step whose values a later step, the agreement table or a run reads:
    refused with its key path before any step runs (the run refused it after rewriting that step)."""
    extra = READERS_OF_VALUES[reader]
    spec = {**BASE, **extra, "scores": [{**SCORED, "with_entropy": False}, *extra.get("scores", [])]}
    msg = refusal(spec)
    assert "'a' is written without its values (with_entropy: false), which this reads" in msg, msg
    spec["scores"][0]["with_entropy"] = True
    parse_workflow(spec)


@pytest.mark.parametrize(
    "data",
    [
        ["a"],
        ["w", {"name": "w", "values_from": "a"}],
        ["c", {"name": "c", "values_from": ["a", "b"], "op": "difference"}],
    ],
    ids=["the-sample", "its-reweighing", "a-combination"],
)
def test_a_run_on_a_sample_of_the_tokens_is_refused_from_the_spec(data):
    """A run trained on a score step that scored limit_shards/limit_rows of the tokens (or on what
    re-weighs or combines it) would see those rows alone, beside runs on every token: refused."""
    name, *more = data
    limited = {**SCORED, "limit_shards": 1, "limit_rows": 5}
    other = {
        "name": "b",
        "scorer": "causal_loss",
        "options": {"model": "m"},
        "limit_shards": 1,
        "limit_rows": 5,
    }
    runs = [
        {"name": "ref", "data": "tokens", "loss": "ce"},
        {"name": "r", "data": name, "loss": "weighted_ce"},
    ]
    spec = {**BASE, "scores": [limited, other, *more], "train": {"seeds": [0], "runs": runs}}
    msg = refusal(spec)
    assert (
        f"train.runs[1].data: '{name}' holds a sample of the tokens ('a': limit_shards 1, limit_rows 5)"
        in msg
    )


@pytest.mark.parametrize(
    "where, step",
    [
        ("models[0]", {"models": [{"name": "m", "kind": "llama", "config": {"d_modle": 16}}]}),
        ("train", {"train": {"config": {"d_modle": 16}, "runs": [{"name": "r"}]}}),
        ("models[0]", {"models": [{"name": "m", "model_config": "m.yaml", "config": {"d_modle": 16}}]}),
    ],
    ids=["models", "train", "beside-a-file"],
)
def test_a_model_config_field_misspelt_is_refused_with_its_path(where, step):
    """From the spec, naming the key path (it was refused while planning, as `model causal: ...`)."""
    msg = refusal({**BASE, **step})
    assert f"{where}.config: " in msg and "d_modle" in msg and "n_layers" in msg, msg  # the fields it takes
    kind = {**BASE, "models": [{"name": "m", "kind": "lama"}]}
    assert "models[0].kind: unknown model kind 'lama'; choose one of llama" in refusal(kind)


def test_wrong_type_is_refused_with_its_path():
    msg = refusal({**BASE, "tokenize": {"n_ctx": "long"}})
    assert msg.startswith("workflow is refused: tokenize.n_ctx: ") and "\n" not in msg, msg  # one line
    msg = refusal({**BASE, "train": {"seeds": ["a"], "runs": [{"name": "r"}]}})
    assert "train.seeds[0]: " in msg


@pytest.mark.parametrize(
    "where,value",
    [
        ("tokenize", "../outside"),
        ("tokenize", "/etc/evil"),
        ("tokenize", "a/../../b"),
        ("report", "../r.html"),
    ],
)
def test_outputs_cannot_leave_the_run_dir(where, value):
    msg = refusal({**BASE, where: {"out": value}})
    assert f"{where}.out: " in msg
    assert "run_dir" in msg


def test_a_local_path_through_a_directory_that_does_not_exist_is_taken_as_it_reads(tmp_path):
    """run_dir (and every local path of a workflow) follows the commands' rule (`storage.as_meant`):
    `new/../run` is `run`, and the run does not make `new` on the way."""
    wf = parse_workflow({**BASE, "run_dir": f"{tmp_path}/new/../run"})
    assert wf.run_dir == str(tmp_path.resolve() / "run")
    assert parse_workflow({**BASE, "run_dir": "runs/x"}).run_dir == "runs/x"  # else as typed


def test_references_are_checked():
    msg = refusal({**BASE, "scores": [{"name": "s", "scorer": "causal_loss", "checkpoint_from": "nope"}]})
    assert "scores[0].checkpoint_from: 'nope' is not a models step" in msg
    msg = refusal({**BASE, "train": {"runs": [{"name": "w", "data": "missing", "loss": "weighted_ce"}]}})
    assert "train.runs[0].data: " in msg
    msg = refusal({**BASE, "train": {"runs": [{"name": "w", "loss": "weighted_ce"}]}})
    assert "train.runs[0].loss: weighted_ce needs weights" in msg
    assert "tokenizer: " in refusal({**BASE, "tokenizer": {"path": "t.json", "train": {"vocab_size": 512}}})


def test_yaml_is_loaded_safely(tmp_path):
    p = tmp_path / "evil.yaml"
    p.write_text("run_dir: !!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_workflow(p)


def test_bundled_workflows_validate():
    for name in ("default.yaml", "paper.yaml"):
        wf = load_workflow(ROOT / "workflows" / name)
        # `make run` runs 2 seeds to stay under 10 minutes (experiment.yaml: 5; tests/test_experiment.py)
        assert wf.train is not None and len(wf.train.seeds) >= 2
        cross = {"cross_tokenizer", "excess_loss"}  # excess_loss reads SmolLM2 across tokenizers
        assert {s.scorer for s in wf.scores} >= {"causal_loss", "occlusion"} and {
            s.scorer for s in wf.scores
        } & cross


def test_cli_refuses_a_bad_workflow_with_exit_2(tmp_path):
    p = write_yaml(tmp_path / "bad.yaml", {**BASE, "tokenize": {"out": "../x"}})
    code, out = run_cli("run", p)
    assert code == 2
    assert "tokenize.out" in out


def test_paper_workflow_dry_runs_here():
    code, out = run_cli("run", ROOT / "workflows" / "paper.yaml", "--dry-run")
    assert code == 0, out
    assert "tokenizer tokenizer: would run - train a 8000-token bpe" in out
    assert "train reference/seed-0: would run" in out
    assert "score llama-1b: would run - after tokens" in out
    assert (
        "agreement agreement: would run - after occlusion, occlusion_cosine, causal_loss, decomposition, llama-1b"
        in out
    )
    assert "accuracy reference/seed-0: would run - after reference/seed-0" in out
    assert "49 of 49 step(s) would run" in out  # 33 + 3 agreement steps + the items step + 12 accuracy steps


# -- the end-to-end run
def test_tiny_workflow_runs_end_to_end(tiny_run):
    run = tiny_run["run_dir"]
    assert (run / "report.html").is_file()
    record = json.loads((run / "run.json").read_text())
    assert record["code_version"].startswith("0.")
    assert record["config"]["tokenize"]["n_ctx"] == 64
    steps = {(s["kind"], s["name"]): s for s in record["steps"]}
    assert all(s["status"] == "ran" for s in steps.values()), steps
    tok_manifests = steps[("tokenize", "tokens")]["manifests"]
    assert len(tok_manifests) == 3 and sum(m["docs_in"] for m in tok_manifests) == 120
    assert len(steps[("score", "occlusion")]["manifests"]) == 2  # limit_shards: 2
    for r in ("reference", "weighted-causal"):
        for s in (0, 1):
            res = json.loads((run / "eval" / r / f"seed-{s}.json").read_text())
            assert 0 < res["bpb"] < 10
            assert (run / "train" / r / f"seed-{s}" / "metrics.jsonl").is_file()
    assert 0 < json.loads((run / "eval" / "unigram.json").read_text())["bpb"] < 10
    assert tiny_run["seconds"] < 240  # ~60-100 s on 2 shared cores


def test_a_users_file_in_a_run_dir_is_told_from_the_runs_own(tiny_run):
    """run.json records the names the steps write in run_dir (every one there, nothing else), so a
    command's --overwrite, which replaces the run whole, is refused where a user's file lies beside
    them (tests/test_output_files.py: every other command's output)."""
    run = tiny_run["run_dir"]
    record = json.loads((run / "run.json").read_text())
    shown = sorted(p.name for p in run.iterdir() if not p.name.startswith("."))  # hidden: bookkeeping
    assert record[RUN_OUTPUTS] == [n for n in shown if n != "run.json"]
    assert output.foreign_files(run, "run", "weigh") == []
    mine = run / "notes.txt"
    mine.write_text("mine")
    try:
        with pytest.raises(
            storage.OutputRefused, match=r"the output of `run` and files no command wrote \(notes.txt\)"
        ):
            output.check_output(run, [], "weigh", overwrite=True)
    finally:
        mine.unlink()


def test_a_step_removed_from_the_workflow_leaves_its_output_the_runs(small_run, tmp_path):
    """run.json's outputs keep what earlier runs in run_dir wrote: a step since removed from the
    workflow left its output, which is the run's, not a user's file."""
    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(tmp_path / "run"), "scores": []}
    assert run_cli("run", write_yaml(tmp_path / "wf.yaml", spec))[0] == 0
    spec["models"] = []
    code, out = run_cli("run", write_yaml(tmp_path / "wf.yaml", spec))
    assert code == 0, out
    assert "models" in json.loads((tmp_path / "run" / "run.json").read_text())[RUN_OUTPUTS]
    assert output.foreign_files(tmp_path / "run", "run", "weigh") == []


def test_second_run_does_no_work(tiny_run):
    run = tiny_run["run_dir"]
    # every output, manifest, stage record and shard registry stays untouched, and run.json too: it
    # records the run that made them (it was rewritten by every rerun that found nothing to do)
    mtimes = {p: p.stat().st_mtime_ns for p in run.rglob("*") if p.is_file() and p.name != ".lock"}
    record = (run / "run.json").read_bytes()
    code, out = run_cli("run", tiny_run["yaml"])
    assert code == 0, out
    assert "nothing to do: all 16 step(s)" in out
    assert ": ran" not in out
    assert {p: p.stat().st_mtime_ns for p in mtimes} == mtimes
    assert (run / "run.json").read_bytes() == record


def test_dry_run_prints_the_plan_and_writes_nothing(tiny_run, tmp_path):
    code, out = run_cli("run", tiny_run["yaml"], "--dry-run")
    assert code == 0
    assert "tokenize tokens: up to date - all 3 part(s) of the input done" in out
    assert "nothing to do: all steps are up to date" in out
    # a fresh run dir: everything would run, nothing appears on disk
    fresh = write_yaml(
        tmp_path / "fresh.yaml",
        {**yaml.safe_load(tiny_run["yaml"].read_text()), "run_dir": str(tmp_path / "new")},
    )
    code, out = run_cli("run", fresh, "--dry-run")
    assert code == 0, out
    assert "tokenize tokens: would run - after tokenizer" in out
    assert "train weighted-causal/seed-1: would run" in out
    assert "16 of 16 step(s) would run" in out
    assert not (tmp_path / "new").exists()


def test_changed_training_config_retrains_only_that(tiny_run, tmp_path):
    spec = yaml.safe_load(tiny_run["yaml"].read_text())
    spec["train"]["seeds"] = [0, 1, 2]  # one more seed: two new runs and their evals
    p = write_yaml(tmp_path / "more-seeds.yaml", spec)
    code, out = run_cli("run", p, "--dry-run")
    assert code == 0
    would = [ln for ln in out.splitlines() if ": would run" in ln]
    assert sorted(ln.split(":")[0] for ln in would) == [
        "eval reference/seed-2",
        "eval weighted-causal/seed-2",
        "report report",
        "train reference/seed-2",
        "train weighted-causal/seed-2",
    ]


# -- incremental data stages (no training: cheap)
def test_new_input_only_processes_the_new_shard(tmp_path, tokenizer_dir):
    a = c4_subset(tmp_path / "a.json.gz", 0, 30)
    spec = {
        "run_dir": str(tmp_path / "run"),
        "sources": [str(a)],
        "tokenizer": {"path": str(tokenizer_dir)},
        "tokenize": {"n_ctx": 32},
        "report": None,
    }
    p = write_yaml(tmp_path / "wf.yaml", spec)
    assert run_cli("run", p)[0] == 0
    c4_subset(tmp_path / "b.json.gz", 30, 60)
    spec["sources"] = [str(a), str(tmp_path / "b.json.gz")]
    write_yaml(p, spec)
    code, out = run_cli("run", p, "--dry-run")
    assert "tokenize tokens: would run - 1 part(s) of the input to run, 1 done" in out
    code, out = run_cli("run", p)
    assert code == 0
    assert "1 shard(s) run, 1 already done" in out


# -- the lock
def test_a_second_concurrent_run_exits_3(tmp_path, tokenizer_dir):
    spec = {"run_dir": str(tmp_path / "run"), "sources": [str(C4)], "tokenizer": {"path": str(tokenizer_dir)}}
    p = write_yaml(tmp_path / "wf.yaml", spec)
    (tmp_path / "run").mkdir()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys,time; from filelock import FileLock; "
            f"l = FileLock({str(tmp_path / 'run' / '.lock')!r}); l.acquire(); print('held', flush=True); time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        said = []
        for dry in ([], ["--dry-run"]):  # the dry run said "3 of 3 step(s) would run", exit 0
            res = subprocess.run(
                [sys.executable, "-m", "entroweight.workflows.cli", "run", str(p), *dry],
                capture_output=True,
                text=True,
                env=env,
            )
            assert res.returncode == 3, res.stderr
            assert "another entroweight run holds" in res.stderr
            said.append(res.stderr.strip().splitlines()[-1])
        assert said[0] == said[1]
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
    finally:
        holder.kill()
        holder.wait()


def test_the_dry_run_and_the_run_agree_on_the_report_once_run_json_is_gone(tmp_path, tokenizer_dir):
    """run.json removed: the dry run said the report would run, and the run then called it up to date
    (it had written a new run.json first). Both say it runs: the report reads the record."""
    spec = {
        "run_dir": str(tmp_path / "run"),
        "sources": [str(c4_subset(tmp_path / "a.json.gz", 0, 20))],
        "tokenizer": {"path": str(tokenizer_dir)},
        "tokenize": {"n_ctx": 32},
    }
    p = write_yaml(tmp_path / "wf.yaml", spec)
    code, out = run_cli("run", p)
    assert code == 0, out
    (tmp_path / "run" / "run.json").unlink()
    code, dry = run_cli("run", p, "--dry-run")
    code, ran = run_cli("run", p)
    assert code == 0 and "report report: would run" in dry and "report report: ran" in ran, dry + ran
    code, dry = run_cli("run", p, "--dry-run")
    assert "nothing to do" in dry, dry


def test_a_data_stage_that_fails_verification_fails_the_run(tmp_path, tokenizer_dir):
    """verify_dir runs after each data stage: a shard no manifest names in the tokens directory is a
    problem (exit 1). (A file of no shard's name is a user's, refused before any step runs.)"""
    spec = {
        "run_dir": str(tmp_path / "run"),
        "sources": [str(c4_subset(tmp_path / "a.json.gz", 0, 20))],
        "tokenizer": {"path": str(tokenizer_dir)},
        "tokenize": {"n_ctx": 32},
        "report": None,
    }
    p = write_yaml(tmp_path / "wf.yaml", spec)
    code, out = run_cli("run", p)
    assert code == 0 and "verified" in out
    (tmp_path / "run" / "tokens" / "part-09999-00000.parquet").write_bytes(b"not a shard")
    code, out = run_cli("run", p)
    assert code == 1
    assert "failed verification" in out and "part-09999-00000.parquet" in out
    record = json.loads((tmp_path / "run" / "run.json").read_text())
    assert record["steps"][-1]["status"] == "failed"


def test_engine_is_passed_to_the_data_stages(tmp_path, tokenizer_dir):
    """--engine beam runs the tokenize stage on Beam's in-process runner: the same shards as local."""
    src = c4_subset(tmp_path / "a.json.gz", 0, 40)
    digests = {}
    for engine in ("local", "beam"):
        spec = {
            "run_dir": str(tmp_path / engine),
            "sources": [str(src)],
            "tokenizer": {"path": str(tokenizer_dir)},
            "tokenize": {"n_ctx": 32, "shard_docs": 20},
            "report": None,
        }
        code, out = run_cli("run", write_yaml(tmp_path / f"{engine}.yaml", spec), "--engine", engine)
        assert code == 0, out
        record = json.loads((tmp_path / engine / "run.json").read_text())
        assert record["engine"] == engine
        digests[engine] = [m["output_sha256"] for m in record["steps"][1]["manifests"]]
    assert len(digests["local"]) == 2 and digests["beam"] == digests["local"]


# -- refusals come before anything is written
def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> dict:
    """A finished run of tokenizer -> tokenize -> a causal model -> its scores (no experiment: cheap)."""
    tmp = tmp_path_factory.mktemp("small")
    spec = {
        "run_dir": str(tmp / "run"),
        "sources": [str(c4_subset(tmp / "c4.json.gz", 0, 60))],
        "holdout": {"docs": 10},
        "tokenizer": {"train": {"vocab_size": 300}},
        "tokenize": {"n_ctx": 32, "shard_docs": 30},
        "models": [
            {
                "name": "causal",
                "kind": "llama",
                "steps": 2,
                "batch_size": 4,
                "config": {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32},
            }
        ],
        "scores": [
            {
                "name": "causal_loss",
                "scorer": "causal_loss",
                "checkpoint_from": "causal",
                "options": {"dtype": "fp32"},
            }
        ],
        "report": None,
    }
    code, out = run_cli("run", write_yaml(tmp / "wf.yaml", spec))
    assert code == 0, out
    return {"spec": spec, "root": tmp / "run"}


@pytest.mark.parametrize(
    "change, says",
    [
        # the tokenizer's settings: refused by its own step, after the steps before it (the holdout) ran
        (
            lambda s: s["tokenizer"]["train"].update(vocab_size=320),
            "holds a tokenizer of other options (vocab_size: ",
        ),
        # the held-out split the tokenizer was trained without: its inputs would change under it
        (
            lambda s: s["holdout"].update(docs=11),
            "holds the output of `train-tokenizer` made from what holdout",
        ),
        # the data's settings: the tokenize stage's shards are another config's
        (lambda s: s["tokenize"].update(n_ctx=48), "holds tokenize output of another config"),
        # the model's: its checkpoint would be trained again and replaced (then its scores refused)
        (
            lambda s: s["models"][0].update(steps=3),
            "holds a checkpoint trained with other settings (train.steps: 2 -> 3)",
        ),
    ],
    ids=["tokenizer", "holdout", "tokenize", "model"],
)
def test_a_refused_run_is_refused_before_any_step_writes(small_run, tmp_path, change, says):
    """Rule: a run that will be refused is refused before the lock or any step writes, in the dry run
    the same; every file of the run dir (run.json included) is as it was."""
    spec = copy.deepcopy(small_run["spec"])
    change(spec)
    wf = write_yaml(tmp_path / "changed.yaml", spec)
    before = _files(small_run["root"])
    for dry in ([], ["--dry-run"]):
        code, out = run_cli("run", wf, *dry)
        assert code == 2 and says in out, out
        assert "ran" not in out and "Traceback" not in out
        assert _files(small_run["root"]) == before


@pytest.mark.parametrize("out", ["tokenizer", "tokens", "models/causal", "scores/causal_loss"])
def test_a_users_file_in_a_steps_output_is_refused_by_the_dry_run_and_the_run_alike(small_run, out):
    """A file no command wrote in a step's output (a user's notes): the dry run said every step was up
    to date, and the run failed the stage's verification after it (exit 1, the advice "move it out",
    on every rerun). Every step whose output is a command's (tokenize, score, a model) refuses it in
    the plan, exit 2, the same words in both, nothing written."""
    notes = small_run["root"] / out / "notes.txt"
    notes.write_text("mine\n")
    try:
        wf = write_yaml(small_run["root"].parent / "wf.yaml", small_run["spec"])
        before = _files(small_run["root"])
        said = []
        for dry in (["--dry-run"], []):
            code, text = run_cli("run", wf, *dry)
            assert code == 2 and f"{notes.parent} holds files no command wrote (notes.txt)" in text, text
            said.append(text.strip().splitlines()[-1])
            assert _files(small_run["root"]) == before
        assert said[0] == said[1]
    finally:
        notes.unlink()


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda s, tmp: s.update(sources=[str(tmp / "missing.jsonl")]), "missing.jsonl"),
        (lambda s, tmp: s["holdout"].update(docs=500), "the sources hold only 60 documents"),
    ],
    ids=["missing-source", "holdout-too-large"],
)
@pytest.mark.parametrize("found", ["new", "new, below new directories", "empty", "holding a .gitkeep"])
def test_a_run_that_cannot_start_leaves_no_run_dir(small_run, tmp_path, change, says, found):
    """Refused by a step's own work (before any step ran), the run leaves run_dir as it found it: a
    new one is removed again with the directories made for it, one the user made keeps what it held
    and nothing more (an empty one kept run.json and .lock; the parents made for a new one stayed):
    nothing of the run is left behind, and the next run starts clean."""
    run_dir = tmp_path / "a" / "b" / "new" if "below" in found else tmp_path / "new"
    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(run_dir)}
    if found in ("empty", "holding a .gitkeep"):
        run_dir.mkdir()
    if found == "holding a .gitkeep":
        (run_dir / ".gitkeep").write_text("")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "wf.yaml")
    change(spec, tmp_path)
    code, out = run_cli("run", write_yaml(tmp_path / "wf.yaml", spec))
    assert code == 2 and says in out, out
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.name != "wf.yaml") == before


_TRAIN = {
    "kind": "llama",
    "config": {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32},
    "steps": 1,
    "batch_size": 4,
    "seeds": [0],
    "runs": [{"name": "reference", "data": "tokens", "loss": "ce"}],
}


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda s, tmp: s["models"][0].update(kind="lama"), "unknown model kind 'lama'"),
        (lambda s, tmp: s["models"][0]["config"].update(d_modle=16), "d_modle, which llama does not take"),
        (lambda s, tmp: s["models"][0]["config"].update(d_model="big"), "d_model is 'big'"),
        (lambda s, tmp: s["models"][0]["config"].update(d_model=-16), "d_model must be at least 1"),
        (lambda s, tmp: s["models"][0]["config"].update(d_model=15), "not a multiple of n_heads"),
        (
            lambda s, tmp: s.update(train=_TRAIN, eval={"text": str(tmp / "nope.txt")}),
            "eval.text: no text file",
        ),
    ],
    ids=["kind", "config-key", "config-type", "config-negative", "config-heads", "eval-text"],
)
def test_what_a_later_step_would_refuse_is_refused_before_the_first(small_run, tmp_path, change, says):
    """A model's kind and config, and the evaluation text, are checked before any step runs, by the
    dry run too (they were refused only when their step came, after hours of the steps before)."""
    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(tmp_path / "new")}
    change(spec, tmp_path)
    wf = write_yaml(tmp_path / "wf.yaml", spec)
    for dry in (["--dry-run"], []):
        code, out = run_cli("run", wf, *dry)
        assert code == 2 and says in out and ": ran" not in out, out
        assert not (tmp_path / "new").exists()


def test_a_workflow_file_that_is_not_text_is_refused(tmp_path):
    bad = tmp_path / "bin.yaml"
    bad.write_bytes(bytes(range(128, 256)) * 2)
    code, out = run_cli("run", bad)
    assert code == 2 and "not a text file" in out


@pytest.mark.parametrize("content", [b"<html>", b"[1, 2]", b'{"key": 3', b""])
def test_a_cached_result_gone_bad_is_made_again_not_a_failure(tmp_path, content):
    """A step's own record that cannot be read (cut short, edited into something else) means the step
    is not done: the run makes it again instead of failing on it for good."""
    from entroweight.workflows.engine.steps import RunContext, UnigramStep

    spec = copy.deepcopy(BASE) | {"run_dir": str(tmp_path / "run"), "train": _TRAIN, "eval": {}}
    out = tmp_path / "unigram.json"
    out.write_bytes(content)
    step = UnigramStep("eval", "unigram", out, RunContext(parse_workflow(spec)))
    step.key = lambda: "k"  # (its data fingerprint needs tokenized data)
    assert step.done() is None


def test_a_run_dir_of_other_files_is_refused_untouched(small_run, tmp_path):
    """A run_dir that holds a user's files (not a workflow run) is refused before any step: the steps
    would write among them, and a stage would then refuse its own output on every rerun."""
    (tmp_path / "mine" / "tokens").mkdir(parents=True)
    (tmp_path / "mine" / "tokens" / "readme.md").write_text("x")
    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(tmp_path / "mine")}
    before = _files(tmp_path / "mine")
    for dry in (["--dry-run"], []):
        code, out = run_cli("run", write_yaml(tmp_path / "wf.yaml", spec), *dry)
        assert code == 2 and "holds files that are not a workflow run's (tokens)" in out, out
        assert _files(tmp_path / "mine") == before


def test_a_checkpoint_of_edited_settings_is_replaced_only_with_overwrite(small_run, tmp_path):
    """A model step edited since its checkpoint was trained (steps 2 -> 3): refused without --overwrite
    (test_a_refused_run_is_refused_before_any_step_writes), a plan with it names what it replaces, and
    the run trains it again; then up to date."""
    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(tmp_path / "run"), "scores": []}
    assert run_cli("run", write_yaml(tmp_path / "wf.yaml", spec))[0] == 0
    # the tokenizer's path is not a setting edited (it moves with run_dir; train's record is its sha256)
    config = tmp_path / "run" / "models" / "causal" / "config.json"
    made = json.loads(config.read_text())
    made["train"]["tokenizer"] = "/elsewhere/tokenizer/tokenizer.json"
    config.write_text(json.dumps(made))
    code, out = run_cli("run", tmp_path / "wf.yaml", "--dry-run")
    assert code == 0 and "nothing to do" in out, out
    spec["models"][0]["steps"] = 3
    wf = write_yaml(tmp_path / "changed.yaml", spec)
    code, out = run_cli("run", wf, "--overwrite", "--dry-run")
    assert code == 0 and "model causal: would run - 3 steps of llama" in out, out
    assert "replaces the checkpoint trained with train.steps: 2 -> 3" in out, out
    code, out = run_cli("run", wf, "--overwrite")
    assert code == 0 and "model causal: ran - 3 steps" in out, out
    code, out = run_cli("run", wf)
    assert code == 0 and "nothing to do" in out, out


def test_min_mean_weight_in_a_score_step_drops_documents_as_counted_rejects(small_run, tmp_path):
    """`min_mean_weight` (the commands' --min-mean-weight) in a scoring step and in a re-weighing one:
    whole documents below it leave the output, each counted as a `low_weight` reject."""
    from entroweight.pipelines.stage import read_manifests

    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(tmp_path / "run")}
    spec["scores"][0] |= {"min_mean_weight": 0.5}
    spec["scores"].append({"name": "again", "values_from": "causal_loss", "min_mean_weight": 0.55})
    code, out = run_cli("run", write_yaml(tmp_path / "wf.yaml", spec))
    assert code == 0, out
    for name in ("causal_loss", "again"):
        manifests = read_manifests(tmp_path / "run" / "scores" / name)
        dropped = sum(m.rejected.get("low_weight", 0) for m in manifests)
        assert dropped > 0, name
        assert sum(m.docs_in for m in manifests) == sum(m.docs_out for m in manifests) + dropped


def _marked_outputs():
    """Every other command's output as storage knows it: its mark (a stage's: its record, its lock)."""
    yield pytest.param(output.STAGE_RECORD, "tokenize", id="a-stage")
    for mark, owner in output.marks():
        if owner != "run":
            yield pytest.param(mark.name, owner, id=owner)
    yield pytest.param("part-00000-00000.parquet", output.UNKNOWN_STAGE, id="shards-without-record")


@pytest.mark.parametrize(("mark", "owner"), list(_marked_outputs()))
def test_a_run_dir_of_another_commands_output_is_refused_untouched(small_run, tmp_path, mark, owner):
    """A run_dir holding a stage's shards, a checkpoint, an export...: refused before any step (a
    stage's output holds a lock, as a run's does: it was taken for a run killed before its record,
    and the steps wrote among its shards)."""
    other = _mkdir(tmp_path / "other")
    (other / mark).write_text(json.dumps({"stage": owner}) if mark == ".stage.json" else "{}")
    (other / ".lock").write_text("")
    spec = copy.deepcopy(small_run["spec"]) | {"run_dir": str(other)}
    before = _files(other)
    for dry in (["--dry-run"], []):
        code, out = run_cli("run", write_yaml(tmp_path / "wf.yaml", spec), *dry)
        assert code == 2 and f"run_dir {other} holds the output of " in out, out
        assert "not a workflow run's" in out and owner in out, out
        assert _files(other) == before


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="asks for a device this machine lacks")
@pytest.mark.parametrize("where", ["models", "train", "eval"])
def test_a_device_that_is_not_here_is_refused_before_the_first_step(small_run, tmp_path, where):
    """A run asking for CUDA on a machine without one is refused before its first step (it crashed
    after training); its --dry-run still plans it, as a laptop plans a cluster's run."""
    spec = copy.deepcopy(small_run["spec"]) | {
        "run_dir": str(tmp_path / "new"),
        "train": copy.deepcopy(_TRAIN),
    }
    spec["eval"] = {}
    {"models": spec["models"][0], "train": spec["train"], "eval": spec["eval"]}[where]["device"] = "cuda"
    wf = write_yaml(tmp_path / "wf.yaml", spec)
    code, out = run_cli("run", wf)
    assert code == 2 and "no CUDA device is visible here" in out and ": ran" not in out, out
    assert not (tmp_path / "new").exists()
    code, out = run_cli("run", wf, "--dry-run")  # a plan of a GPU run may be made on a laptop
    assert code == 0 and "would run" in out, out


# -- a checkpoint whose weights changed after its training
def _damage(weights: Path, how: str) -> None:
    data = weights.read_bytes()
    if how == "cut short":
        weights.write_bytes(data[: len(data) // 2])
    elif how == "edited":  # one bit of a tensor, the size kept
        weights.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))
    elif how == "config edited":  # a setting the weights' shapes do not show: loaders refuse it
        config = json.loads((weights.parent / "config.json").read_text())
        config["model"]["rope_theta"] = 5000.0
        (weights.parent / "config.json").write_text(json.dumps(config))
    else:
        weights.unlink()


DAMAGE = {
    "cut short": " as trained (cut short or edited)",
    "edited": "its sha256 is not the one trainer_state.json records",
    "gone": "model.safetensors is gone",
    "config edited": "config.json does not describe the model its weights were saved as (rope_theta 5000.0",
}


@pytest.fixture
def trained_run(tmp_path, tokenizer_dir) -> dict:
    """A finished run with a trained step of each kind: a model (its scores read it) and an experiment run."""
    spec = {
        "run_dir": str(tmp_path / "run"),
        "sources": [str(c4_subset(tmp_path / "c4.json.gz", 0, 30))],
        "tokenizer": {"path": str(tokenizer_dir)},
        "tokenize": {"n_ctx": 32},
        "models": [{"name": "causal", **{k: _TRAIN[k] for k in ("kind", "config", "steps", "batch_size")}}],
        "scores": [
            {
                "name": "causal_loss",
                "scorer": "causal_loss",
                "checkpoint_from": "causal",
                "options": {"dtype": "fp32"},
            }
        ],
        "train": _TRAIN,
        "report": None,
    }
    wf = write_yaml(tmp_path / "wf.yaml", spec)
    code, out = run_cli("run", wf)
    assert code == 0, out
    return {
        "yaml": wf,
        "root": tmp_path / "run",
        "checkpoints": {"model": "models/causal", "train": "train/reference/seed-0"},
    }


def test_every_trained_step_kind_is_covered(trained_run):
    from entroweight.workflows.engine.runner import Runner
    from entroweight.workflows.engine.steps import TrainStep

    steps = Runner(load_workflow(trained_run["yaml"]), dry_run=True, echo=lambda _: None).run()
    assert {s.kind for s in steps if isinstance(s, TrainStep)} == set(trained_run["checkpoints"])


@pytest.mark.parametrize("how", list(DAMAGE))
def test_a_checkpoint_whose_weights_changed_is_trained_again(trained_run, how, monkeypatch):
    """A finished checkpoint whose model.safetensors was cut short, edited or removed is not up to date
    (it was, until a step loaded it and refused its sha256): the dry run says why it would train again,
    the run trains it again; a model whose scores hold shards is refused first (they would be made
    again, exit 2, nothing touched) unless --overwrite. A checkpoint untouched since its training is
    up to date without its weights being read."""
    import html

    from entroweight.models.checkpoint import load_checkpoint
    from entroweight.trainers import checkpoint
    from entroweight.workflows.engine import steps

    root, wf = trained_run["root"], trained_run["yaml"]
    ckpt = {kind: root / d for kind, d in trained_run["checkpoints"].items()}
    # the experiment run: nothing reads it but its evaluations, so it is trained again
    _damage(ckpt["train"] / "model.safetensors", how)
    code, out = run_cli("run", wf, "--dry-run")
    assert code == 0 and "train reference/seed-0: would run" in out and DAMAGE[how] in out, out
    # the report, which shows this checkpoint's BPB, says so too (it called the run complete)
    code, out = run_cli("report", root, "--out", root.parent / f"{root.name}-report.html")
    page = (root.parent / f"{root.name}-report.html").read_text()
    assert code == 0 and "Incomplete run" in page and html.escape(DAMAGE[how], quote=True) in page, out
    code, out = run_cli("run", wf)
    assert code == 0 and "train reference/seed-0: ran" in out and "model causal: up to date" in out, out
    load_checkpoint(ckpt["train"])  # the loader's sha256 check passes again
    # the model: its scores would be made again, which needs --overwrite
    _damage(ckpt["model"] / "model.safetensors", how)
    before = _files(root)
    for dry in ([], ["--dry-run"]):
        code, out = run_cli("run", wf, *dry)
        assert code == 2 and "holds output made with the causal this run would train again" in out, out
        assert DAMAGE[how] in out and "--overwrite" in out and "Traceback" not in out, out
        assert _files(root) == before
    code, out = run_cli("run", wf, "--overwrite")
    # (its scores are kept where it trains the same weights again)
    assert code == 0 and "model causal: ran" in out, out
    load_checkpoint(ckpt["model"])
    # untouched since: up to date, and no weights file is hashed to say so
    hashed = []
    for module in (steps, checkpoint):  # the steps' hashing and the checkpoint check's
        monkeypatch.setattr(module, "sha256_file", lambda p: hashed.append(p) or "")
    code, out = run_cli("run", wf)
    assert code == 0 and "nothing to do" in out, out
    assert not [p for p in hashed if p.name == "model.safetensors"]


# -- sources apart from run_dir
def _src_inside(tmp: Path) -> tuple[str, Path]:  # a file in a run_dir that held nothing else
    return str(c4_subset(_mkdir(tmp / "run" / "data") / "c4.json.gz", 0, 20)), tmp / "run"


def _src_of_a_run(tmp: Path) -> tuple[str, Path]:  # a file of an earlier run: its held-out split's
    (_mkdir(tmp / "run") / "run.json").write_text("{}")
    return str(c4_subset(_mkdir(tmp / "run" / "holdout") / "train.jsonl.gz", 0, 20)), tmp / "run"


def _src_is(tmp: Path) -> tuple[str, Path]:  # a directory of documents, given as run_dir too
    c4_subset(_mkdir(tmp / "data") / "c4.json.gz", 0, 20)
    return str(tmp / "data"), tmp / "data"


def _src_holds(tmp: Path) -> tuple[str, Path]:  # run_dir inside a directory of documents
    c4_subset(_mkdir(tmp / "data") / "c4.json.gz", 0, 20)
    return str(tmp / "data"), tmp / "data" / "run"


def _src_glob(tmp: Path) -> tuple[str, Path]:  # a glob that matches a file in run_dir
    c4_subset(_mkdir(tmp / "run" / "data") / "c4.json.gz", 0, 20)
    return str(tmp / "*" / "data" / "*.json.gz"), tmp / "run"


def _src_glob_through_a_link(tmp: Path) -> tuple[str, Path]:  # its literal directory links to run_dir
    c4_subset(_mkdir(tmp / "run" / "data") / "c4.json.gz", 0, 20)
    (tmp / "link").symlink_to(tmp / "run", target_is_directory=True)
    return str(tmp / "link" / "data" / "*.json.gz"), tmp / "run"


def _src_glob_matching_a_link(tmp: Path) -> tuple[str, Path]:  # a wildcard matches a link into run_dir
    c4_subset(_mkdir(tmp / "run" / "data") / "c4.json.gz", 0, 20)
    (_mkdir(tmp / "sets") / "a").symlink_to(tmp / "run" / "data", target_is_directory=True)
    return str(tmp / "sets" / "*" / "*.json.gz"), tmp / "run"


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


@pytest.mark.parametrize(
    "make, says",
    [
        (_src_inside, "holds it"),
        (_src_of_a_run, "holds it"),
        (_src_is, "is it"),
        (_src_holds, "lies inside it"),
        (_src_glob, "holds files it may match"),
        (_src_glob_through_a_link, "holds files it may match"),
        (_src_glob_matching_a_link, "holds files it may match"),
    ],
    ids=["inside", "a-runs-file", "is", "run-dir-inside", "glob", "glob-through-link", "glob-matching-link"],
)
def test_a_source_in_the_run_dir_is_refused_up_front(tmp_path, tokenizer_dir, make, says):
    """A source that is, holds, lies inside run_dir or is a glob that may match a file in it is refused
    before anything (the run writes and removes files there), dry run or not: exit 2, one line,
    nothing written or removed."""
    src, run_dir = make(tmp_path)
    spec = {
        "run_dir": str(run_dir),
        "sources": [src],
        "tokenizer": {"path": str(tokenizer_dir)},
        "report": None,
    }
    wf = write_yaml(tmp_path / "wf.yaml", spec)
    before = _files(tmp_path)
    for dry in (["--dry-run"], []):
        code, out = run_cli("run", wf, *dry)
        assert code == 2 and f"sources[0] {src}: run_dir {run_dir} {says}" in out, out
        assert "keep what the run reads outside run_dir" in out and "Traceback" not in out, out
        assert len(out.strip().splitlines()) == 1, out
        assert _files(tmp_path) == before


@pytest.mark.parametrize("key", ["tokenizer.path", "models[0].model_config", "scores[0].options.model"])
def test_every_local_input_in_the_run_dir_is_refused_up_front(tmp_path, tokenizer_dir, c4_path, key):
    """Not the sources alone: a tokenizer, a model config or a scorer's model the run reads, in (or
    around) run_dir, is refused before anything, dry run or not: exit 2, one line, nothing written."""
    run_dir = tmp_path / "run"
    inside = _mkdir(run_dir / "mine")
    spec = {"run_dir": str(run_dir), "sources": [str(c4_path)], "tokenizer": {"path": str(tokenizer_dir)}}
    if key == "tokenizer.path":  # run_dir inside the tokenizer's directory
        shutil.copytree(tokenizer_dir, tmp_path / "tok")
        spec["run_dir"] = str(tmp_path / "tok" / "run")
        spec["tokenizer"] = {"path": str(tmp_path / "tok")}
        where, says = tmp_path / "tok", "lies inside it"
    elif key == "models[0].model_config":
        (where := inside / "cfg.yaml").write_text("d_model: 32\n")
        spec["models"] = [{"name": "m", "model_config": str(where), "steps": 1}]
        says = "holds it"
    else:
        where = inside / "model"
        shutil.copytree(tokenizer_dir, where)
        spec["scores"] = [{"name": "s", "scorer": "causal_loss", "options": {"model": str(where)}}]
        says = "holds it"
    wf = write_yaml(tmp_path / "wf.yaml", {**spec, "report": None})
    before = _files(tmp_path)
    for dry in (["--dry-run"], []):
        code, out = run_cli("run", wf, *dry)
        assert code == 2 and f"{key} {where}: run_dir {spec['run_dir']} {says}" in out, out
        assert len(out.strip().splitlines()) == 1 and "Traceback" not in out, out
        assert _files(tmp_path) == before


def test_sources_beside_the_run_dir_are_accepted(tmp_path, tokenizer_dir):
    """A glob whose directory holds run_dir but that cannot match a file in it, and a source whose name
    starts as run_dir's does, are apart."""
    c4_subset(tmp_path / "c4.json.gz", 0, 20)
    c4_subset(_mkdir(tmp_path / "run-data") / "c4.json.gz", 0, 20)
    sources = [str(tmp_path / "*.json.gz"), str(tmp_path / "run-data"), str(tmp_path / "run-*" / "*.gz")]
    spec = {"run_dir": str(tmp_path / "run"), "sources": sources, "tokenizer": {"path": str(tokenizer_dir)}}
    code, out = run_cli("run", write_yaml(tmp_path / "wf.yaml", spec | {"report": None}), "--dry-run")
    assert code == 0 and "would run" in out, out


@pytest.mark.parametrize("lost", ["tokens", "scores/causal_loss"])
def test_a_shard_gone_missing_is_remade_and_nothing_after_it_runs_again(small_run, lost):
    """Rule: the plan says what the run does. A data step's shard whose parquet went missing (its
    manifest kept) is remade as its manifest records it, so what reads that step is up to date: the
    dry run said the model would train again and refused the scores, and so did the run (it plans
    first), where the remade shard is byte-identical and nothing needs training."""
    root = small_run["root"]  # (a copy elsewhere is a moved run directory, refused) left as it was
    wf = root.parent / "wf.yaml"
    weights = root / "models" / "causal" / "model.safetensors"
    trained = weights.stat().st_mtime_ns
    shard = sorted((root / lost).glob("part-*.parquet"))[0]
    digest = hashlib.sha256(shard.read_bytes()).hexdigest()
    shard.unlink()
    kind = "tokenize tokens" if lost == "tokens" else "score causal_loss"
    for dry in (["--dry-run"], []):
        code, out = run_cli("run", wf, *dry)
        assert code == 0, out
        steps = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
        want = "would run" if dry else "ran"
        assert steps[kind].startswith(want), out
        # no model trains again; a data step that reads it may run (its inputs' files are new), and
        # its dry run says it waits for it
        after = [k for k, v in steps.items() if v.startswith(want) and k != kind]
        assert all(k.startswith(("tokenize", "score")) for k in after), out
        assert not dry or all(steps[k] == f"would run - after {kind.split()[1]}" for k in after), out
    assert hashlib.sha256(shard.read_bytes()).hexdigest() == digest
    assert weights.stat().st_mtime_ns == trained


@pytest.fixture(scope="module")
def experiment_run(tmp_path_factory) -> dict:
    """A finished run with an experiment whose train runs each have two evaluations and an accuracy
    step (they share the train run's name): holdout, tokenizer, a model, its scores, two train runs."""
    tmp = tmp_path_factory.mktemp("experiment")
    tiny = {"d_model": 16, "n_layers": 1, "n_heads": 2, "d_ff": 32}
    spec = {
        "run_dir": str(tmp / "run"),
        "sources": [str(c4_subset(tmp / "c4.json.gz", 0, 60))],
        "holdout": {"docs": 12},
        "tokenizer": {"train": {"vocab_size": 300}},
        "tokenize": {"n_ctx": 48, "shard_docs": 24},
        "models": [{"name": "causal", "kind": "llama", "config": tiny, "steps": 2, "batch_size": 4}],
        "scores": [{"name": "causal_loss", "scorer": "causal_loss", "checkpoint_from": "causal"}],
        "train": {
            "kind": "llama", "config": tiny, "steps": 2, "batch_size": 4, "seeds": [0],
            "runs": [
                {"name": "reference", "data": "tokens", "loss": "ce"},
                {"name": "weighted", "data": "causal_loss", "loss": "weighted_ce"},
            ],
        },
        "eval": {"max_bytes": 3000},
        "accuracy": {"tasks": ["entroweight_heldout"], "items": 6, "prefix_tokens": 16,
                     "continuation_tokens": 6, "choices": 2},
        "report": None,
    }  # fmt: skip
    code, out = run_cli("run", write_yaml(tmp / "wf.yaml", spec))
    assert code == 0, out
    return {"spec": spec, "root": tmp / "run", "yaml": tmp / "wf.yaml"}


def _would_and_did(wf: Path) -> tuple[set[str], set[str]]:
    """The steps the dry run says would run, and those the run then ran."""
    code, plan = run_cli("run", wf, "--dry-run")
    assert code == 0, plan
    code, out = run_cli("run", wf)
    assert code == 0, out

    def said(text, status):  # (lm-eval's progress bars may share a step's line)
        kinds = "holdout|tokenizer|tokenize|model|score|agreement|train|eval|accuracy|report"
        return set(re.findall(rf"\b((?:{kinds}) [^\s:]+(?: \(\w+\))?): {status}\b", text))

    return said(plan, "would run"), said(out, "ran")


@pytest.mark.parametrize(
    "edit",
    ["the main eval's result removed", "an accuracy result removed", "eval.max_bytes changed"],
)
def test_the_dry_run_says_what_the_run_does_when_one_step_is_redone(experiment_run, edit):
    """Rule: the plan is the run's. A train run's evaluations and accuracy step share its name, and
    the dry run took a step to be redone by name alone: one evaluation redone made every step that
    reads the train run "would run - after" it (the held-out evaluation, the accuracy), which the run
    then found up to date."""
    root, spec = experiment_run["root"], copy.deepcopy(experiment_run["spec"])
    wf = experiment_run["yaml"]
    if edit == "the main eval's result removed":
        (root / "eval" / "reference" / "seed-0.json").unlink()
        want = {"eval reference/seed-0"}
    elif edit == "an accuracy result removed":
        next((root / "accuracy").glob("reference/seed-0.json")).unlink()
        want = {"accuracy reference/seed-0"}
    else:
        spec["eval"]["max_bytes"] = 4000
        wf = write_yaml(wf.parent / "more-bytes.yaml", spec)
        want = {"eval unigram", "eval reference/seed-0", "eval weighted/seed-0"}
    would, did = _would_and_did(wf)
    assert would == did, (would, did)
    assert want <= did and not any(s.startswith(("train", "accuracy", "score")) for s in did - want), did


@pytest.mark.parametrize(
    "result, step",
    [
        ("eval/reference/seed-0.json", "eval reference/seed-0"),
        ("eval/weighted/seed-0.heldout.json", "eval weighted/seed-0 (heldout)"),
        ("eval/unigram.json", "eval unigram"),
        ("accuracy/reference/seed-0.json", "accuracy reference/seed-0"),
    ],
)
@pytest.mark.parametrize("how", ["seal kept", "seal removed too"])
def test_a_result_edited_by_hand_is_refused_by_the_report_and_made_again(
    experiment_run, tmp_path, result, step, how
):
    """Rule: a number in the report is its step's. A step's result (an evaluation, an accuracy) edited
    by hand was up to date to the run and shown by the report; each is sealed with the sha256 of its
    content (workflows/results.py): the report refuses it, naming it, and the run makes it again."""
    assert run_cli("run", experiment_run["yaml"])[0] == 0  # as the fixture's spec (other tests edit it)
    f = experiment_run["root"] / result
    original = json.loads(f.read_text())
    edit = {"bpb": 1.2345} if "bpb" in original else {"run": "edited"}
    drop = {"record_sha256"} if how == "seal removed too" else set()
    f.write_text(json.dumps({**{k: v for k, v in original.items() if k not in drop}, **edit}))
    code, out = run_cli("report", experiment_run["root"], "--out", tmp_path / "r.html")
    assert code == 2 and str(f) in out and "is not as its step wrote it" in out, out
    assert not (tmp_path / "r.html").exists()
    if "bpb" in original and ".heldout" not in result:  # the main text's BPB rows go on an export's card
        scores = experiment_run["root"] / "scores" / "causal_loss"
        code, out = run_cli("export-data", scores, "--format", "hf", "--out", tmp_path / "export")
        assert code == 2 and "is not as its step wrote it" in out and not (tmp_path / "export").exists(), out
    would, did = _would_and_did(experiment_run["yaml"])
    assert would == did == {step}, (would, did)
    assert json.loads(f.read_text())["record_sha256"] == original["record_sha256"]


def test_outputs_no_step_writes_any_more_are_said(experiment_run, tmp_path):
    """A train run renamed (or a seed, a score step removed) leaves its checkpoint, evaluations and
    accuracy in run_dir, which no step writes now and the report leaves out: the dry run and the run
    say so (kept: they may be wanted). Before, nothing mentioned them."""
    spec = copy.deepcopy(experiment_run["spec"])
    spec["train"]["runs"][1]["name"] = "renamed"
    code, out = run_cli("run", write_yaml(tmp_path / "renamed.yaml", spec), "--dry-run")
    assert code == 0, out
    said = "note: 3 output(s) in {} that no step of this workflow writes".format(experiment_run["root"])
    assert said in out and "accuracy/weighted, eval/weighted, train/weighted" in out, out
    # every step of a kind removed: the directory they wrote in, named as a whole
    spec = {**copy.deepcopy(experiment_run["spec"]), "eval": None, "accuracy": None}
    code, out = run_cli("run", write_yaml(tmp_path / "fewer.yaml", spec), "--dry-run")
    said = "note: 2 output(s) in {} that no step of this workflow writes".format(experiment_run["root"])
    assert (
        code == 0
        and said in out
        and "writes (an earlier run's, renamed or removed since; kept, and left out of the report): accuracy, eval"
        in out
    ), out
    code, out = run_cli("run", experiment_run["yaml"], "--dry-run")
    assert code == 0 and "no step of this workflow writes" not in out, out


def test_a_run_directory_is_known_by_what_its_record_holds(tiny_run):
    """A source directory skips a workflow run inside it by its run.json's keys (its declared Mark,
    which tests/test_output_files.py feeds a record written by hand): the runner's record holds them."""
    run = tiny_run["run_dir"]
    assert output.command_output(run, os.listdir(run)) == "run"


def test_a_run_killed_before_its_record_is_not_taken_for_a_finished_one(
    tmp_path, tokenizer_dir, c4_60, monkeypatch
):
    """A run with every step up to date leaves run.json as the run that made them wrote it; one that
    runs a step marks run.json first (seconds 0), so a run killed after its steps but before its
    record is not taken for the finished run by the next, which writes it (before, the previous
    run's record stayed for good)."""
    from entroweight.workflows.engine.runner import Runner

    spec = {
        "run_dir": str(tmp_path / "run"),
        "sources": [str(c4_60)],
        "tokenizer": {"path": str(tokenizer_dir)},
        "tokenize": {"n_ctx": 32, "shard_docs": 20},
        "report": None,
    }
    wf = write_yaml(tmp_path / "wf.yaml", spec)
    assert run_cli("run", wf)[0] == 0
    record = tmp_path / "run" / "run.json"
    finished = record.read_bytes()
    assert run_cli("run", wf)[0] == 0 and record.read_bytes() == finished  # nothing to do: as it was
    shutil.rmtree(tmp_path / "run" / "tokens")
    write = Runner.write_record

    def killed_at_the_end(self, seconds):
        if seconds > 0:
            raise KeyboardInterrupt
        write(self, seconds)

    monkeypatch.setattr(Runner, "write_record", killed_at_the_end)
    assert run_cli("run", wf)[0] == 130
    monkeypatch.setattr(Runner, "write_record", write)
    code, out = run_cli("run", wf)
    assert code == 0 and "nothing to do" in out, out
    now = json.loads(record.read_text())
    assert now["seconds"] > 0 and {s["status"] for s in now["steps"]} == {"up to date"}
    # the workflow file moved: the record names the one that runs now
    wf.rename(tmp_path / "moved.yaml")
    assert run_cli("run", tmp_path / "moved.yaml")[0] == 0
    assert json.loads(record.read_text())["workflow_file"].endswith("moved.yaml")


def test_a_workflows_tokenizer_is_train_tokenizers_output_with_its_one_record(tmp_path):
    """Rule (entroweight.output's contract): the tokenizer step writes train-tokenizer's output under
    that command's record, so `train-tokenizer` by hand with the same settings and sources has nothing
    to do there. A tokenizer a workflow trained before that record (its step's own
    `.workflow-step.json`) is taken as it is, its record sealed by the next run (not by a dry run):
    not refused for want of a record, nothing downstream made again."""
    from entroweight.workflows.engine.steps import _key
    from entroweight.workflows.spec import load_workflow

    spec = {
        "run_dir": str(tmp_path / "run"),
        "sources": [str(c4_subset(tmp_path / "c4.json.gz", 0, 40))],
        "holdout": {"docs": 5},
        "tokenizer": {"train": {"vocab_size": 300}},
        "tokenize": {"n_ctx": 32, "shard_docs": 20},
        "report": None,
    }
    wf = write_yaml(tmp_path / "wf.yaml", spec)
    assert run_cli("run", wf)[0] == 0
    tok = tmp_path / "run" / "tokenizer"
    train_file = tmp_path / "run" / "holdout" / "train.jsonl.gz"
    by_hand = tmp_path / "by-hand"  # (a command run by hand never writes inside a workflow's run)
    shutil.copytree(tok, by_hand, ignore=shutil.ignore_patterns(".lock"))
    code, out = run_cli("train-tokenizer", train_file, "--vocab-size", 300, "--out", by_hand)
    assert code == 0 and "nothing to do" in out, out
    # the record of an older version: its step's own key and the file's sha256
    (tok / ".train-tokenizer.json").unlink()
    legacy = {"train": load_workflow(wf).tokenizer.train.model_dump(mode="json"), "holdout": 5}
    sha = hashlib.sha256((tok / "tokenizer.json").read_bytes()).hexdigest()
    (tok / ".workflow-step.json").write_text(json.dumps({"key": _key(legacy), "sha256": sha}))
    before = _files(tmp_path / "run")
    code, out = run_cli("run", wf, "--dry-run")
    assert code == 0 and "nothing to do" in out, out
    assert _files(tmp_path / "run") == before
    code, out = run_cli("run", wf)
    assert code == 0 and "nothing to do" in out, out
    assert not (tok / ".workflow-step.json").exists() and (tok / ".train-tokenizer.json").is_file()
    assert json.loads((tok / ".train-tokenizer.json").read_text()) == json.loads(
        (by_hand / ".train-tokenizer.json").read_text()
    )
    # ... and one whose file is not the one recorded is refused, as train-tokenizer refuses it
    (tok / ".train-tokenizer.json").unlink()
    code, out = run_cli("run", wf)
    assert code == 2 and "holds a tokenizer with no record of what it is made of" in out, out
