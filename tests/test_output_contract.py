"""The contract of a command's output (entroweight/output.py), held over every declared command and
shown on a toy writing command declared in this file alone.

Every declared output: its marks are told apart from a user's file of the name, the path rule knows
whose output a directory is, and its files are the only names it may leave. A new writing command is
one `declare` and one `writing` block: the toy below gets every rule (the path rule, a URL with a
slash missing, the lock, the rerun, a record of other options refused unless --overwrite, a changed
input made again, a kill before the seal) without a line of any other module changing.
"""

from __future__ import annotations

import json

import pytest

from entroweight import output, storage

DECLARED = sorted(o.command for o in output.declared())


def test_the_registry_holds_every_builtin_writing_command():
    """The built-ins declare themselves where they live; storage names none of them."""
    assert {"train", "train-tokenizer", "export-data", "export-hf", "evaluate", "run"} <= set(DECLARED)
    source = (output.Path(storage.__file__)).read_text()
    for command in DECLARED:
        assert f'"{command}"' not in source, f"storage.py names {command}"


@pytest.mark.parametrize("command", DECLARED)
def test_a_declared_mark_makes_a_directory_its_commands_output(command, tmp_path):
    """Each mark, as the command writes it, marks its command's output (the path rule refuses another
    command there, source discovery skips it); a user's file of the same name marks nothing."""
    decl = output.declaration(command)
    for mark in decl.marks:
        d = tmp_path / mark.name
        d.mkdir()
        if isinstance(mark.holds, tuple):
            (d / mark.name).write_text(json.dumps(dict.fromkeys(mark.holds, 1)) + "\n")
        elif mark.holds is not None:
            (d / mark.name).write_text(f"{'0' * 64}  tokenizer.json\n")
        else:
            (d / mark.name).write_text("{}")
        assert output.output_owner(d) == command
        assert output.command_output(d, [mark.name]) == command
        with pytest.raises(storage.OutputRefused, match=f"holds the output of `{command}`"):
            output.check_output(d, [], "a-toy")
        if mark.holds is not None:  # a user's file of the name
            (d / mark.name).write_text(json.dumps({"text": "a user's document"}) + "\n")
            assert output.command_output(d, [mark.name]) is None


@pytest.mark.parametrize("command", DECLARED)
def test_a_users_file_in_a_declared_output_is_never_removed(command, tmp_path):
    decl = output.declaration(command)
    d = tmp_path / "out"
    d.mkdir()
    # (a workflow run's names are those its run.json records: none here)
    (d / decl.marks[0].name).write_text(json.dumps({"outputs": []}))
    (d / "notes.txt").write_text("mine")
    assert output.foreign_files(d, command, "a-toy") == ["notes.txt"]
    with pytest.raises(storage.OutputRefused):
        output.check_output(d, [], "a-toy", overwrite=True)
    assert (d / "notes.txt").read_text() == "mine"


# -- a toy writing command: one declaration, one `writing` block

TOY = output.Output(
    "toy-count",
    marks=(output.Mark("toy.json", ("made_of", "count")),),
    files=("toy.json", "counts.txt"),
    record="toy.json",
)


@pytest.fixture(autouse=True)
def declared_toy(monkeypatch):
    monkeypatch.setitem(output._DECLARED, TOY.command, TOY)


def toy(src, out, n: int, overwrite=False, wait=0.0, stop_before_seal=False) -> str:
    """Count `src`'s lines, `n` times each, into OUT/counts.txt: what a new writing command is."""
    made_of = {"options": {"n": n}, "inputs": {"src": list(storage.stat(src))}}
    with output.writing(TOY, out, [("SRC", src)], made_of, overwrite=overwrite, wait=wait) as w:
        if w.nothing_to_do:
            return "nothing to do"
        w.dest.mkdir(parents=True, exist_ok=True)
        count = len(src.read_text().splitlines()) * n
        (w.dest / "counts.txt").write_text(f"{count}\n")
        if stop_before_seal:
            raise KeyboardInterrupt  # a kill after the files, before the record
        w.record = {"count": count}
    return "wrote"


@pytest.fixture
def src(tmp_path):
    p = tmp_path / "src.txt"
    p.write_text("a\nb\n")
    return p


def test_the_toy_gets_the_rerun_rule(src, tmp_path):
    out = tmp_path / "out"
    assert toy(src, out, 2) == "wrote"
    record = json.loads((out / "toy.json").read_text())
    assert record["count"] == 4 and not output.edited(record) and record["files"].keys() == {"counts.txt"}
    before = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert toy(src, out, 2) == "nothing to do"
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == before
    assert output.output_owner(out) == "toy-count"


def test_the_toy_refuses_other_options_unless_overwrite(src, tmp_path):
    out = tmp_path / "out"
    toy(src, out, 2)
    with pytest.raises(storage.OutputRefused, match=r"of other options \(n: 2 -> 3\).*--overwrite"):
        toy(src, out, 3)
    assert (out / "counts.txt").read_text() == "4\n"
    assert toy(src, out, 3, overwrite=True) == "wrote"
    assert (out / "counts.txt").read_text() == "6\n"


def test_the_toy_makes_a_changed_input_or_a_damaged_output_again(src, tmp_path):
    out = tmp_path / "out"
    toy(src, out, 1)
    src.write_text("a\nb\nc\n")  # an input changed since
    assert toy(src, out, 1) == "wrote" and (out / "counts.txt").read_text() == "3\n"
    (out / "counts.txt").write_text("9\n")  # a file edited
    assert toy(src, out, 1) == "wrote" and (out / "counts.txt").read_text() == "3\n"
    record = json.loads((out / "toy.json").read_text())
    (out / "toy.json").write_text(json.dumps({**record, "count": 7}))  # its record edited
    assert toy(src, out, 1) == "wrote"


def test_a_kill_before_the_seal_leaves_no_sealed_record_and_the_rerun_makes_it(src, tmp_path):
    """The mark is written first, unsealed, the record sealed last: a run stopped between leaves its
    files marked as its own (not a user's, which the rerun would refuse) and not done."""
    out = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        toy(src, out, 1, stop_before_seal=True)
    assert output.edited(json.loads((out / "toy.json").read_text()))
    assert not (out / storage.LOCK_FILE).exists()
    assert toy(src, out, 1) == "wrote" and toy(src, out, 1) == "nothing to do"


def test_the_toy_gets_the_path_rule(src, tmp_path):
    with pytest.raises(storage.OutputRefused, match="which toy-count reads"):
        toy(src, src.parent, 1)  # holds what it reads
    with pytest.raises(storage.OutputRefused, match="is empty"):
        toy(src, " ", 1)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("x")
    with pytest.raises(storage.OutputRefused, match="holds files of no entroweight command"):
        toy(src, mine, 1)
    stage = tmp_path / "stage"
    stage.mkdir()
    (stage / ".stage.json").write_text(json.dumps({"stage": "tokenize"}))
    with pytest.raises(storage.OutputRefused, match="holds the output of `tokenize`"):
        toy(src, stage, 1)
    with pytest.raises(storage.OutputRefused, match="lies inside"):
        toy(src, stage / "sub", 1)
    assert toy(src, stage, 1, overwrite=True) == "wrote"  # replaced whole when asked
    assert not (stage / ".stage.json").exists()


def test_the_toy_gets_the_url_rule(src, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(storage.StorageError, match="is not a URL: write s3://bucket/x"):
        toy(src, "s3:/bucket/x", 1)
    assert not (tmp_path / "s3:").exists()


def test_the_toy_gets_the_lock(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    held = storage.lock(storage.lock_location(out))
    try:
        with pytest.raises(storage.OutputHeld, match="another entroweight run holds"):
            toy(src, out, 1)
        assert not (out / "toy.json").exists()
    finally:
        held.release()
    assert toy(src, out, 1) == "wrote"  # free again


def test_a_kept_toy_refuses_what_is_not_this_very_output_unless_overwrite(src, tmp_path, monkeypatch):
    """`kept` (a tokenizer, an export: what was made with it depends on it): a changed input, an edited
    file, files with no record are refused unless --overwrite, where the default makes them again; a
    run stopped before its seal is made again either way."""
    kept = output.Output(TOY.command, TOY.marks, TOY.files, TOY.record, kept=True)
    monkeypatch.setattr(__import__(__name__), "TOY", kept)
    monkeypatch.setitem(output._DECLARED, kept.command, kept)
    out = tmp_path / "out"
    toy(src, out, 1)
    src.write_text("a\nb\nc\n")
    with pytest.raises(storage.OutputRefused, match=r"of inputs changed since \(src\).*--overwrite"):
        toy(src, out, 1)
    assert (out / "counts.txt").read_text() == "2\n"
    assert toy(src, out, 1, overwrite=True) == "wrote"
    (out / "counts.txt").write_text("9\n")
    with pytest.raises(storage.OutputRefused, match="whose files differ from its record"):
        toy(src, out, 1)
    (out / "toy.json").write_text("[1, 2]")  # a record edited into no record
    with pytest.raises(storage.OutputRefused, match="with no record of what it is made of"):
        toy(src, out, 1)
    toy(src, out, 1, overwrite=True)
    with pytest.raises(KeyboardInterrupt):
        toy(src, out, 2, overwrite=True, stop_before_seal=True)
    assert toy(src, out, 2) == "wrote" and toy(src, out, 2) == "nothing to do"


def test_a_block_refused_on_the_way_takes_back_what_it_wrote(src, tmp_path):
    """A refusal inside the block (a shard that differs from its manifest, found while writing):
    `out` is left as it was found, its lock and the directory made for it gone."""
    out = tmp_path / "new" / "out"
    with pytest.raises(ValueError, match="refused"), output.writing(TOY, out, [("SRC", src)], None) as w:
        (w.dest / "counts.txt").write_text("1\n")
        raise ValueError("refused on the way")
    assert not (tmp_path / "new").exists()


def test_a_resumable_declaration_continues_its_same_record_from_its_step(src, tmp_path):
    """A resumable command (train) keeps its own record as it goes: the contract's answer to the same
    record is "continue from step N", to no record or another's None (the command refuses that unless
    told to continue or replace it); the current made_of is asked only where there is a record."""

    def progress(directory):
        try:
            return json.loads((directory / "progress.json").read_text())
        except OSError:
            return None

    counter = output.Output("toy-counter", marks=(output.Mark("progress.json"),), resumable=progress)
    out, asked = tmp_path / "out", []
    made_of = {"options": {"n": 2}, "inputs": {"src": list(storage.stat(src))}}

    def now():
        asked.append(1)
        return made_of

    assert output.continues(out, counter, now) is None and not asked  # nothing there: nothing asked
    out.mkdir()
    (out / "progress.json").write_text(json.dumps([made_of, 3]))
    assert output.continues(out, counter, now) == 3 and asked
    assert output.continues(out, counter, {**made_of, "options": {"n": 3}}) is None  # other options
    src.write_text("a\nb\nc\n")  # an input changed since
    assert output.continues(out, counter, {**made_of, "inputs": {"src": list(storage.stat(src))}}) is None
    assert output.continues(out, counter, lambda: None) is None  # inputs that cannot be read


def test_whose_output_a_directory_is_holds_while_a_file_in_it_vanishes(tmp_path, monkeypatch):
    """A run writing beside the check (a worker renaming its temp file into place, Ray's workers of a
    killed driver) removes a file between the directory's listing and its size: the listing keeps the
    rest. It read as empty, so a stage's parts were taken for a user's files (test_engines'
    SIGKILL-then-rerun under Ray, seen once in a fresh-clone check)."""
    import os

    from entroweight import storage

    out = tmp_path / "out"
    out.mkdir()
    for name in ("part-00000.parquet", ".part-00001.parquet.tmp-1", ".stage.json"):
        (out / name).write_bytes(b"{}" if name == ".stage.json" else b"x")
    scandir = os.scandir

    class Vanishing:  # the listing is taken, then the temp file goes before its size is read
        def __init__(self, d):
            self.entries = list(scandir(d))
            (out / ".part-00001.parquet.tmp-1").unlink(missing_ok=True)

        def __enter__(self):
            return iter(self.entries)

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(os, "scandir", Vanishing)
    assert storage.listing(out) == {"part-00000.parquet": 1, ".stage.json": 2}
