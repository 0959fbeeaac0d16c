# ruff: noqa: F811 - pytest fixtures imported from test_weighted_inputs
"""A user's file is told apart from every command's output, not only from a stage's shards.

`--overwrite` replaces another command's output whole (and export-data its own export): a file a user
put inside it went with it. each command's declaration (entroweight.output) names what it writes directly in its
output; any other name there is a user's, and the replacement is refused (exit 2, one line, nothing
removed). The table must name every file a command really writes, or its own output would be refused:
each command here writes its real output, which must hold nothing the table leaves out. (A workflow
run's names are those its run.json records: tests/test_workflow.py.)
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from click.testing import CliRunner
from test_weighted_inputs import model, scored, tokens, weighed  # noqa: F401 - fixtures

from entroweight import output
from entroweight.transforms.sources import file_format
from entroweight.workflows.cli.main import main

#: the commands whose output names its files by their declaration (a workflow run's: its run.json)
FILES_NAMED = sorted(o.command for o in output.declared() if o.files_of is None)
HAS = {m: importlib.util.find_spec(m) is not None for m in ("megatron", "litdata")}


def cli(*args) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output


@pytest.fixture(scope="module")
def outputs(tmp_path_factory, weighed, c4_path) -> dict:
    """owner -> a directory holding that command's real output (export-data: one per format)."""
    root = tmp_path_factory.mktemp("outputs")
    out = {}
    code, text = cli("train-tokenizer", c4_path, "--vocab-size", 300, "--max-docs", 40, "--out", root / "tok")
    assert code == 0, text
    out["train-tokenizer"] = [root / "tok"]
    (root / "tiny.yaml").write_text("d_model: 32\nn_layers: 1\nn_heads: 2\nd_ff: 64\n")
    code, text = cli(
        "train", weighed, "--out", root / "run", "--steps", 2, "--batch-size", 4,
        "--model-config", root / "tiny.yaml", "--loss", "weighted_ce",
    )  # fmt: skip
    assert code == 0, text
    out["train"] = [root / "run"]
    code, text = cli("export-hf", root / "run", "--out", root / "hf")
    assert code == 0, text
    out["export-hf"] = [root / "hf"]
    code, text = cli("evaluate", root / "run", "--documents", c4_path, "--items", 8, "--out", root / "eval")
    assert code == 0, text
    out["evaluate"] = [root / "eval"]
    out["export-data"] = []
    for fmt in ("hf", "megatron", "litdata"):
        if fmt == "hf" or HAS[fmt]:
            code, text = cli("export-data", weighed, "--format", fmt, "--out", root / f"export-{fmt}")
            assert code == 0, text
            out["export-data"].append(root / f"export-{fmt}")
    return out


def test_every_marked_output_has_a_case():
    """Every declared command's output has a case here (a workflow run, whose names its run.json
    records: tests/test_workflow.py; a stage: its shards)."""
    assert set(FILES_NAMED) == {o.command for o in output.declared()} - {"run"}


@pytest.mark.parametrize("owner", FILES_NAMED)
def test_a_commands_output_holds_only_what_it_is_known_to_write(outputs, owner):
    for d in outputs[owner]:
        assert output.output_owner(d) == owner
        assert output.foreign_files(d, owner, "tokenize") == [], sorted(p.name for p in d.iterdir())


@pytest.mark.parametrize("owner", FILES_NAMED)
def test_overwrite_keeps_a_users_file_inside_any_commands_output(outputs, owner, scored, weighed, tmp_path):
    """Another command's --overwrite (weigh here; every command goes through the one check,
    tests/test_path_rule.py) is refused where a user's file lies inside the output it would replace,
    and so is export-data's --overwrite of its own export; without the file, both replace it."""
    original = outputs[owner][0]
    d = tmp_path / "copy"
    shutil.copytree(original, d)
    (d / "notes.txt").write_text("mine")
    again = ["export-data", weighed, "--format", "hf", "--out", d, "--overwrite"]
    for argv in (["weigh", scored, "--out", d, "--overwrite"], again):
        code, text = cli(*argv)
        assert code == 2 and "files no command wrote (notes.txt), which --overwrite would remove" in text, (
            text
        )
        assert (d / "notes.txt").read_text() == "mine"
    (d / "notes.txt").unlink()
    code, text = cli(*(again if owner == "export-data" else ["weigh", scored, "--out", d, "--overwrite"]))
    assert code == 0, text
    assert output.output_owner(d) == ("export-data" if owner == "export-data" else "weigh")


# -- an output inside the sources is no documents
# a workflow run's record as the runner writes it (the keys its declared Mark reads it by)
RUN_RECORD = {"steps": [], "config": {}, "code_version": "x", "workflow_file": "wf.yaml"}


def _docs(n: int) -> str:
    return "".join(json.dumps({"text": f"document {i} of a user's own corpus."}) + "\n" for i in range(n))


def _tokenize(src, tmp_path, tokenizer_dir) -> tuple[int, str]:
    r = CliRunner().invoke(
        main, ["tokenize", str(src), "--tokenizer", str(tokenizer_dir), "--out", str(tmp_path / "t")]
    )
    return r.exit_code, r.output


@pytest.mark.parametrize("owner", sorted({o for _, o in output.marks()}))
def test_an_output_inside_a_source_directory_is_not_read_and_is_said(
    outputs, owner, tmp_path, tokenizer_dir, s3_bucket
):
    """Rule: a source directory's documents are its user's files; another command's output inside it
    (a training run's metrics.jsonl, an evaluation's items.jsonl, an export's parquet) is skipped, as a
    stage's is, and said on stderr; named as the source itself, it is refused (exit 2). Locally and on
    an object store. Before, its files were read as documents: tokenize failed shards naming them,
    with the advice to pass --text-column."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "docs.jsonl").write_text(_docs(5))
    (src / ".hidden.jsonl").write_text(_docs(2))  # not read either, and said (on a store too)
    if owner == "run":  # a workflow run (tests/test_workflow.py runs one): its record and a model in it
        run = src / "runs" / "r"
        shutil.copytree(outputs["train"][0], run / "models" / "m")
        (run / "run.json").write_text(json.dumps({**RUN_RECORD, "outputs": ["models"]}))  # as the runner's
        inside = [run]
    else:
        inside = [shutil.copytree(d, src / "made" / d.name) for d in outputs[owner]]
    for where in (str(src), upload(src, f"{s3_bucket}/corpus")):
        code, text = _tokenize(where, tmp_path / where.replace("/", "_"), tokenizer_dir)
        assert code == 0, text
        assert "5 docs in, 5 docs out" in text and "0 rejected" in text, text
        said = text.split("director(ies) holding another entroweight command's output not read", 1)
        assert len(said) == 2 and all(d.name in said[1] for d in inside), text
        assert "1 hidden file(s) or director(ies) not read: " in text and ".hidden.jsonl" in text, text
    code, text = _tokenize(inside[0], tmp_path / "alone", tokenizer_dir)
    assert code == 2 and f"is the output of `entroweight {owner}`, not documents" in text, text
    assert "Traceback" not in text and not (tmp_path / "alone").exists()


@pytest.mark.parametrize("owner", sorted({o for _, o in output.marks()}))
def test_a_glob_or_a_file_into_an_output_is_refused(outputs, owner, tmp_path, tokenizer_dir, s3_bucket):
    """Rule: as a stage's files are, another command's are refused where a glob matches them or a file
    is named (a directory skips them: above): locally and on an object store. A glob read them as
    documents, without a word."""
    src = tmp_path / "corpus"
    src.mkdir()
    (src / "docs.jsonl").write_text(_docs(5))
    (src / ".hidden.jsonl").write_text(_docs(2))  # a wildcard matches no hidden name, on a store too
    if owner == "run":
        made = src / "runs" / "r"
        made.mkdir(parents=True)
        (made / "run.json").write_text(json.dumps({**RUN_RECORD, "outputs": []}))
    else:
        made = shutil.copytree(outputs[owner][0], src / "made" / outputs[owner][0].name)
    named = next(p for p in sorted(made.iterdir()) if p.is_file() and file_format(p))
    remote = upload(src, f"{s3_bucket}/corpus")
    for spec in (f"{src}/**/*", str(named), f"{remote}/**/*"):
        code, text = _tokenize(spec, tmp_path / f"out-{len(spec)}", tokenizer_dir)
        assert code == 2 and f"belongs to the output of `entroweight {owner}`" in text, (spec, text)
        assert "Traceback" not in text
    # a glob that matches none of its files reads the rest
    for spec in (f"{src}/*.jsonl", f"{remote}/*.jsonl"):
        code, text = _tokenize(spec, tmp_path / f"rest-{len(spec)}", tokenizer_dir)
        assert code == 0 and "5 docs in, 5 docs out" in text, text


# (a hidden mark, train-tokenizer's record, is no documents either way: hidden names are never read)
MARKS_OF_KEYS = sorted(
    m.name for m, _ in output.marks() if m.holds is not None and not m.name.startswith(".")
)


@pytest.mark.parametrize("mark", MARKS_OF_KEYS)
def test_a_users_file_named_as_a_mark_is_read_as_documents(mark, tmp_path, tokenizer_dir):
    """A record's name alone marks nothing, nor does one of its keys: a user's `items.jsonl` of
    multiple-choice documents (with `choices`), a scraper's `export.json` (with `format`), ... in a
    source directory's subfolder is read, with its siblings (its declared Mark: all a record holds).
    Named as the source itself, the folder is read too."""
    sub = tmp_path / "corpus" / "part"
    sub.mkdir(parents=True)
    want = next(m.holds for m, _ in output.marks() if m.name == mark)
    if isinstance(want, tuple):  # documents that share the record's first key
        lines = [json.dumps({"text": f"a user's document {i}.", want[0]: ["x"]}) for i in range(3)]
        (sub / mark).write_text("\n".join(lines) + "\n")
        n = 5
    else:  # a text mark: a user's note of that name beside the documents
        (sub / mark).write_text("checksums of my own files\n")
        n = 2
    (sub / "more.jsonl").write_text(_docs(2))
    for where in (tmp_path / "corpus", sub):
        code, text = _tokenize(where, tmp_path / f"out-{where.name}", tokenizer_dir)
        assert code == 0 and f"{n} docs in, {n} docs out" in text and "command's output" not in text, text


def upload(local, url) -> str:
    import fsspec

    fsspec.filesystem("s3").put(str(local), url.removeprefix("s3://"), recursive=True)
    return url
