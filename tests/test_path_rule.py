"""The one path rule over the whole CLI (docs/reliability.md; entroweight.output.check_output).

Every command that writes (found from the click group: a command with an `out` parameter) is run
with its output in each relation to each of the locations it reads: is, lies inside, holds, and the
same three through a symlink. Each must exit 2 with one line naming the output, the relation and the
input, no traceback, and nothing written. A second table puts each command's output on a directory
holding another command's output (one per declared mark (entroweight.output), and a `.stage.json` that is
not JSON): refused unless --overwrite. A new writing command fails `test_every_writing_command_has_a_row`
until it gets a row here.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from entroweight import output, storage
from entroweight.workflows.cli.main import main

CONFIG_FILE_INPUTS = {"--config", "--model-config"}  # inputs that must be files (the others: dirs)

# command -> (its inputs: name -> how it is passed, or None for a positional), the other arguments.
# An input's name is the flag (or metavar) the refusal names.
ROWS: dict[str, tuple[dict[str, str | None], list[str]]] = {
    "tokenize": ({"the source": None, "--tokenizer": "--tokenizer"}, []),
    "train-tokenizer": ({"the source": None, "--base": "--base"}, []),
    "score": (
        {"DATA_DIR": None, "--tokenizer": "--tokenizer", "--quantiles-from": "--quantiles-from"},
        ["--scorer", "causal_loss", "--weighting", "quantile"],
    ),
    "weigh": ({"SCORED_DIR": None, "--quantiles-from": "--quantiles-from"}, ["--weighting", "quantile"]),
    "export-data": ({"SCORED": None}, ["--format", "hf"]),
    "export-hf": ({"CKPT_DIR": None, "--tokenizer": "--tokenizer"}, []),
    "evaluate": ({"CKPT_DIR": None, "--documents": "--documents"}, []),
    "train": (
        {
            "the data": None,
            "--tokenizer": "--tokenizer",
            "--config": "--config",
            "--model-config": "--model-config",
        },
        ["--steps", "1"],
    ),
    "report": ({"RUN_DIR": None}, []),
    "synthesize": (
        {"--checkpoint": "--checkpoint", "--prefix-from": "--prefix-from"},
        ["--sequences", "1", "--n-ctx", "8", "--prefix-tokens", "2"],
    ),
}
# (command, relation) pairs the rule allows by design, with the reason
ALLOWED = {
    ("report", "lies inside"): "RUN_DIR/report.html is report's default output",
    ("report", "lies inside (symlink)"): "the same, through a symlink",
}
RELATIONS = ("is", "lies inside", "holds", "is (symlink)", "lies inside (symlink)", "holds (symlink)")


def writing_commands() -> list[str]:
    return sorted(n for n, c in main.commands.items() if any(p.name == "out" for p in c.params))


def test_every_writing_command_has_a_row():
    assert writing_commands() == sorted(ROWS), "give a new writing command its inputs in ROWS"


def _cases():
    for command in writing_commands():
        for name in ROWS.get(command, ({}, []))[0]:
            for relation in RELATIONS:
                if (command, relation) not in ALLOWED:
                    yield pytest.param(command, name, relation, id=f"{command}-{name}-{relation}")


def _make_input(root: Path, name: str) -> Path:
    """A file for a config input; else a directory holding one file (what a data directory holds)."""
    root.mkdir(parents=True, exist_ok=True)
    if name in CONFIG_FILE_INPUTS:
        f = root / "config.yaml"
        f.write_text("{}\n")
        return f
    (root / "data.jsonl").write_text('{"text": "hello"}\n')
    return root


def _argv(command: str, out: str, inputs: dict[str, Path]) -> list[str]:
    how, extra = ROWS[command]
    argv = [command]
    for name, flag in how.items():
        argv += [str(inputs[name])] if flag is None else [flag, str(inputs[name])]
    return [*argv, "--out", out, *extra]


def snapshot(root: Path) -> dict[str, tuple]:
    """Every file, directory and link under `root`, with sizes and mtimes: 'nothing written'."""
    seen = {}
    for dirpath, dirs, files in os.walk(root):
        for n in dirs + files:
            p = Path(dirpath) / n
            st = p.lstat()
            seen[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return seen


def refused(tmp_path: Path, argv: list[str]):
    before = snapshot(tmp_path)
    result = CliRunner().invoke(main, argv)
    assert result.exit_code == 2, (argv, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert "Traceback" not in result.output
    assert snapshot(tmp_path) == before, "a refused command wrote something"
    return lines[0]


@pytest.mark.parametrize(("command", "name", "relation"), list(_cases()))
def test_no_command_writes_where_it_reads(tmp_path, command, name, relation):
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    target = _make_input(tmp_path / "holder" / "target", name)
    inputs[name] = target
    link = tmp_path / "link"
    base = relation.removesuffix(" (symlink)")
    real = {"is": target, "lies inside": target / "sub", "holds": target.parent}[base]
    if relation.endswith("(symlink)"):  # --out reaches the input through a link
        pointed = target.parent if base == "holds" else target
        link.symlink_to(pointed, target_is_directory=pointed.is_dir())
        out = link if base != "lies inside" else link / "sub"
    else:
        out = real
    if base == "is" and target.is_file():  # click refuses a file as a directory --out first: still exit 2
        before = snapshot(tmp_path)
        result = CliRunner().invoke(main, _argv(command, str(out), inputs))
        assert result.exit_code == 2 and "is a file" in result.output and snapshot(tmp_path) == before
        return
    line = refused(tmp_path, _argv(command, str(out), inputs))
    assert f"--out {out} {base} {name} {target}" in line, line


GLOB_READS = [(c, n) for c in sorted(ROWS) for n in ROWS[c][0] if n in ("the source", "--documents")]


@pytest.mark.parametrize("glob", ["**", "*/*.jsonl"])
@pytest.mark.parametrize(("command", "name"), GLOB_READS)
def test_no_command_writes_where_a_glob_it_reads_may_match(tmp_path, command, name, glob):
    """A glob read (SOURCES, --documents) that may match files inside --out: the first run wrote its
    output there and every rerun read that output as documents ("tokenizer.json is not JSON lines").
    Refused up front, as a workflow's run_dir is (`sources.relation_to`)."""
    assert {c for c, _ in GLOB_READS} == {"tokenize", "train-tokenizer", "evaluate"}
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    docs = _make_input(tmp_path / "docs", name)
    inputs[name] = f"{docs}/{glob}"
    out = docs / "out"
    line = refused(tmp_path, _argv(command, str(out), inputs))
    assert f"--out {out} lies where {name} {docs}/{glob} may match files" in line, line


@pytest.mark.parametrize("where", ["below", "is"])
@pytest.mark.parametrize("command", sorted(ROWS))
def test_no_command_writes_below_or_into_a_file(tmp_path, command, where):
    """An --out below an existing file (a data file taken for a directory), or one that is a file where
    a directory is written, is refused by every writing command up front, naming the file (report
    crashed with FileExistsError on mkdir). report writes one file: an existing one it replaces."""
    if where == "is" and command == "report":
        pytest.skip("report's --out is the one file it writes")
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    blocker = tmp_path / "corpus.jsonl.gz"
    blocker.write_bytes(b"not a directory")
    if where == "is":
        line = refused(tmp_path, _argv(command, str(blocker), inputs))
        assert f"{blocker}" in line and "is a file" in line, line
        return
    out = blocker / "sub" / ("r.html" if command == "report" else "out")
    line = refused(tmp_path, _argv(command, str(out), inputs))
    assert f"lies below {blocker}, which is a file" in line, line


# -- another command's output: refused unless --overwrite replaces it whole

MARKS = [(mark.name, owner) for mark, owner in output.marks()] + [
    (".stage.json", "tokenize"),
    (".stage.json", None),  # not JSON
    # a stage's shards whose record was removed (a refusal's advice must not lead to mixing into them)
    (".part-00000.manifest.json", output.UNKNOWN_STAGE),
    ("part-00000.parquet", output.UNKNOWN_STAGE),
]


def _owner_cases():
    for command in writing_commands():
        if command == "report":  # writes one file, never a directory
            continue
        for mark, owner in MARKS:
            if owner != command:
                who = "shards-without-record" if owner == output.UNKNOWN_STAGE else owner or "non-json"
                yield pytest.param(command, mark, owner, id=f"{command}-over-{who}-{mark}")


@pytest.mark.parametrize(("command", "mark", "owner"), list(_owner_cases()))
def test_another_commands_output_is_refused(tmp_path, command, mark, owner):
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    out = tmp_path / "other"
    out.mkdir()
    body = json.dumps({"stage": owner}) if mark == ".stage.json" and owner else "{}"
    (out / mark).write_text(body if owner else "not json {")
    line = refused(tmp_path, _argv(command, str(out), inputs))
    # the refusal advises --overwrite where the command has one, and only there
    has_overwrite = any(p.name == "overwrite" for p in main.commands[command].params)
    if owner == output.UNKNOWN_STAGE:
        assert f"--out {out} holds the output of {owner}, not of `{command}`" in line, line
        assert ("--overwrite" in line) == has_overwrite, line
    elif owner:
        assert f"--out {out} holds the output of `{owner}`, not of `{command}`" in line, line
        assert ("--overwrite" in line) == has_overwrite, line
    else:
        assert f"{out}/.stage.json is not a stage record" in line, line


def _inside_cases():
    for command, overwrite in itertools.product(writing_commands(), (False, True)):
        if overwrite and not any(p.name == "overwrite" for p in main.commands[command].params):
            continue
        for mark, owner in MARKS:
            who = "shards-without-record" if owner == output.UNKNOWN_STAGE else owner or "non-json"
            flag = "-overwrite" if overwrite else ""
            yield pytest.param(command, mark, owner, overwrite, id=f"{command}{flag}-inside-{who}-{mark}")


@pytest.mark.parametrize(("command", "mark", "owner", "overwrite"), list(_inside_cases()))
def test_no_command_writes_inside_another_commands_output(tmp_path, command, mark, owner, overwrite):
    """--out a level or two inside a directory that holds any command's output (its own kind too: a
    workflow run, a stage's shards, a training run): refused, --overwrite or not (it would replace
    `out`, not the output around it)."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    other = tmp_path / "other"
    other.mkdir()
    body = json.dumps({"stage": owner}) if mark == ".stage.json" and owner else "{}"
    (other / mark).write_text(body if owner else "not json {")
    for out in (other / "sub", other / "deeper" / "sub"):
        out = out.with_suffix(".html") if command == "report" else out
        argv = _argv(command, str(out), inputs) + (
            ["--overwrite"] if overwrite and command != "report" else []
        )
        line = refused(tmp_path, argv)
        assert f"--out {out} lies inside {other}, the output of " in line, line


@pytest.mark.parametrize("empty", ["", "  "], ids=["empty", "blank"])
@pytest.mark.parametrize("command", writing_commands())
def test_an_empty_out_is_refused_not_taken_for_the_working_directory(tmp_path, monkeypatch, command, empty):
    """`--out "$DIR"` with DIR unset: refused, nothing written where the command runs."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    monkeypatch.chdir(tmp_path)
    line = refused(tmp_path, _argv(command, empty, inputs))
    assert "--out is empty" in line, line


@pytest.mark.parametrize(("command", "name"), [(c, n) for c in writing_commands() for n in ROWS[c][0]])
def test_an_empty_input_is_refused_not_read_as_the_working_directory(tmp_path, monkeypatch, command, name):
    """Each input of each writing command given as "" (an unset variable): exit 2, nothing written."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    inputs[name] = ""
    monkeypatch.chdir(tmp_path)
    before = snapshot(tmp_path)
    result = CliRunner().invoke(main, _argv(command, str(tmp_path / "out"), inputs))
    assert result.exit_code == 2, (command, name, result.output)
    assert "Traceback" not in result.output and snapshot(tmp_path) == before, result.output
    assert "is empty" in result.output or "does not exist" in result.output, result.output


def test_the_rule_on_urls():
    """On a URL the same relations hold by key, and the hub (read-only) is never among them."""
    check = storage.relation
    assert check("s3://b/data", "s3://b/data/") == "is"
    assert check("s3://b/data/out", "s3://b/data") == "lies inside"
    assert check("s3://b", "s3://b/data") == "holds"
    assert check("s3://b/data2", "s3://b/data") == ""
    assert check("gs://b/data", "s3://b/data") == ""


@pytest.mark.skipif(sys.platform == "win32", reason="symlinks")
def test_a_symlinked_input_seen_from_its_real_path(tmp_path):
    """The input named through a link, --out inside its real directory: the same refusal."""
    real = _make_input(tmp_path / "real", "DATA")
    (tmp_path / "alias").symlink_to(real, target_is_directory=True)
    with pytest.raises(storage.OutputRefused, match="lies inside"):
        output.check_output(real / "sub", [("DATA", tmp_path / "alias")], "train")


# -- a user's files: never written among, never removed


def _users_cases():
    for command in writing_commands():
        if command == "report":  # writes one file, never a directory
            continue
        has_overwrite = any(p.name == "overwrite" for p in main.commands[command].params)
        for overwrite in (False, True) if has_overwrite else (False,):
            yield pytest.param(command, overwrite, id=f"{command}{'-overwrite' if overwrite else ''}")


@pytest.mark.parametrize(("command", "overwrite"), list(_users_cases()))
def test_no_command_writes_among_or_removes_a_users_files(tmp_path, command, overwrite):
    """--out a directory of a user's files: refused, --overwrite or not (a command would mix its
    output among them, and a later --overwrite of that output would remove them). And the output of a
    stage with a user's file beside its shards: --overwrite by another command, which replaces that
    output whole, is refused too. Exit 2, one line, nothing written or removed."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "notes.txt").write_text("mine")
    extra = ["--overwrite"] if overwrite else []
    line = refused(tmp_path, _argv(command, str(mine), inputs) + extra)
    assert f"--out {mine} holds files of no entroweight command (notes.txt, sub)" in line, line
    if not overwrite:
        return
    stage = tmp_path / "stage"
    stage.mkdir()
    owner = "weigh" if command != "weigh" else "tokenize"
    (stage / ".stage.json").write_text(json.dumps({"stage": owner}))
    (stage / "part-00000.parquet").write_text("")
    (stage / "notes.txt").write_text("mine")
    line = refused(tmp_path, _argv(command, str(stage), inputs) + extra)
    assert f"--out {stage} holds the output of `{owner}` and files no command wrote (notes.txt)" in line, line


@pytest.mark.parametrize(("command", "overwrite"), list(_users_cases()))
def test_a_users_model_folder_is_a_users_files_to_every_command(tmp_path, command, overwrite):
    """A Hugging Face model folder of the user's (`save_pretrained`: config.json, model.safetensors)
    holds names some commands write, but no command's mark: refused by every writing command,
    --overwrite or not, nothing written or removed. export-hf took any folder holding a
    model.safetensors for its own output and replaced the user's model, exit 0; and the other
    commands' refusal called it "the output of export-hf" and advised --overwrite, which removed it
    (hostile audit)."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    (mine / "model.safetensors").write_bytes(b"weights")
    line = refused(tmp_path, _argv(command, str(mine), inputs) + (["--overwrite"] if overwrite else []))
    # a user's files (train: "a config.json that no training run wrote"), never a command's output
    assert "no entroweight command" in line or "no training run wrote" in line, line
    assert "the output of" not in line and "pass --overwrite" not in line, line


@pytest.mark.parametrize(("command", "name"), [(c, n) for c in writing_commands() for n in ROWS[c][0]])
def test_a_file_url_is_its_path_for_every_input_and_out(tmp_path, command, name):
    """file://PATH names PATH everywhere a command takes a location: the same refusal as the plain
    path (here --out is the input), never a folder named `file:` in the working directory."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    target = inputs[name]
    url_inputs = {**inputs, name: f"file://{target}"}
    out = f"file://{target}" if target.is_dir() else f"file://{target.parent}"
    how = "is" if target.is_dir() else "holds"
    out_flag = str(target) if target.is_dir() else str(target.parent)
    if command == "report":  # may write inside RUN_DIR: its RUN_DIR read as the path (no run here)
        line = refused(tmp_path, [command, f"file://{target}", "--out", f"file://{tmp_path}/r.html"])
        assert f"error: {target} has no run.json" in line, line
        return
    line = refused(tmp_path, _argv(command, out, url_inputs))
    # the input named as given (a source or --tokenizer keeps its URL) or as its path
    assert any(f"--out {out_flag} {how} {name} {n}," in line for n in (target, f"file://{target}")), line
    assert not any(p.name.startswith("file:") for p in tmp_path.rglob("*"))


@pytest.mark.parametrize("command", writing_commands())
def test_an_out_through_a_directory_that_does_not_exist_makes_no_directory_there(tmp_path, command):
    """`--out DIR/new/../../x`: the kernel cannot pass through `new`, so making the directories on
    the way (mkdir -p) made `new`, an empty directory inside what the command reads, and left it,
    and a refused train left its lock in `x` (an audit's finding). The path is taken as it reads
    (`storage.as_meant`): `x` beside DIR, nothing made in DIR."""
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    first = next(iter(inputs.values()))
    base = first if first.is_dir() else first.parent
    out = f"{base}/new/../../x" + (".html" if command == "report" else "")
    before = {p for p in base.rglob("*")}
    result = CliRunner().invoke(main, _argv(command, out, inputs))
    assert "Traceback" not in result.output, result.output
    assert {p for p in base.rglob("*")} == before, f"{command} made something in {base}"
    if result.exit_code == 2:  # refused (the inputs here are stand-ins): nothing written anywhere
        assert not (base.parent / "x").exists() and not (base.parent / "x.html").exists(), command


READERS = {  # the commands that only read: argv with SLIP for the location
    "inspect": ["inspect", "SLIP"],
    "verify": ["verify", "SLIP"],
    "compare A": ["compare", "SLIP", "GOOD"],
    "eval-bpb": ["eval-bpb", "SLIP"],
    "eval-quant": ["eval-quant", "SLIP", "--data", "GOOD"],  # --data: read as train reads its data
}


def _slip_cases():
    for command in writing_commands():
        for name in [*ROWS[command][0], "--out"]:
            if name not in CONFIG_FILE_INPUTS:  # local files only: `Location(local=True)`
                yield pytest.param(command, name, id=f"{command}-{name}")
    for case in READERS:
        yield pytest.param(case, "SLIP", id=case)


@pytest.mark.parametrize(("command", "name"), list(_slip_cases()))
def test_a_url_with_a_slash_missing_is_refused_everywhere(tmp_path, monkeypatch, command, name):
    """`s3:/bucket/key` (one slash) in any location a command takes: every command wrote a local
    folder named `s3:` and exited 0 (or refused it as a missing local file), putting nothing in the
    store. Refused up front, saying the URL meant (`storage.url_slip`), nothing written."""
    monkeypatch.chdir(tmp_path)
    slip = "s3:/bucket/x"
    good = _make_input(tmp_path / "good", "data")
    if command in READERS:
        argv = [good if a == "GOOD" else slip if a == "SLIP" else a for a in READERS[command]]
    else:
        inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
        out = str(tmp_path / "out")
        if name == "--out":
            out = slip
        else:
            inputs[name] = slip
        argv = _argv(command, out, inputs)
    line = refused(tmp_path, [str(a) for a in argv])
    assert "s3://bucket/x (two slashes)" in line, line
    assert not (tmp_path / "s3:").exists()


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("run_dir", "s3:/bucket/run", "s3://bucket/run (two slashes)"),
        ("sources", "[s3:/bucket/docs.jsonl]", "s3://bucket/docs.jsonl (two slashes)"),
        ("tokenizer", "{path: s3:/bucket/tok}", "s3://bucket/tok (two slashes)"),
        ("tokenize", "{out: s3:/bucket/tokens}", "names a store: a step's outputs are paths relative"),
        ("tokenize", "{out: 's3://bucket/tokens'}", "names a store: a step's outputs are paths relative"),
    ],
)
def test_a_workflow_location_with_a_slash_missing_is_refused(tmp_path, monkeypatch, key, value, says):
    """Every location a workflow names: a step's `out` (relative to run_dir) took `s3://b/x` as
    run_dir/s3:/b/x, and a slipped source traced back out of the runner."""
    monkeypatch.chdir(tmp_path)
    spec = {"run_dir": "run", "sources": "[docs.jsonl]", "tokenizer": "{train: {}}", key: value}
    (tmp_path / "docs.jsonl").write_text('{"text": "hello"}\n')
    (tmp_path / "w.yaml").write_text("".join(f"{k}: {v}\n" for k, v in spec.items()))
    line = refused(tmp_path, ["run", "w.yaml", "--dry-run"])
    assert says in line, line
