"""Every command that writes a directory holds the lock on its --out while it writes it.

Two concurrent runs into one --out (train into the same checkpoint directory, say) both exited 0 and
one's output silently replaced the other's: only the stages took a lock. Now each writing command
(found from the click group: an `out` parameter that names a directory) is run while another run
holds its lock, as a live concurrent run holds it (storage.lock at the command's lock location, in
this process). Each must exit 3 with one line saying another run holds --out, and write nothing;
with the lock released, nothing of the holder's is gone. A new writing command is in the table at
once: its row is tests/test_path_rule.py's ROWS (a stage's: real inputs, below, since a stage checks
its inputs before it takes its lock).
"""

from __future__ import annotations

import threading
import time

import pytest
from click.testing import CliRunner
from test_path_rule import ROWS, _argv, _make_input, snapshot
from test_weighted_inputs import model, scored, tokens  # noqa: F401 - fixtures

from entroweight import storage
from entroweight.storage import holding_output as out_lock
from entroweight.storage import lock_location
from entroweight.workflows.cli.main import main


def directory_writers() -> list[str]:
    """The commands whose --out is a directory (report's is one file, which it replaces atomically)."""
    return sorted(
        name
        for name, c in main.commands.items()
        for p in c.params
        if p.name == "out" and getattr(getattr(p.type, "local", None), "file_okay", True) is False
    )


def test_the_directory_writers_are_the_writing_commands_but_report():
    assert directory_writers() == sorted(set(ROWS) - {"report"})


@pytest.fixture(scope="module")
def stage_argv(c4_60, tokenizer_dir, tokens, model, scored):  # noqa: F811 - fixtures
    """command -> its arguments but --out, for the stages: real inputs (they check them first)."""
    return {
        "tokenize": [str(c4_60), "--tokenizer", str(tokenizer_dir), "--n-ctx", "64"],
        "score": [str(tokens), "--scorer", "causal_loss", "--model", str(model), "--batch-size", "8"],
        "weigh": [str(scored), "--weighting", "minmax"],
        "synthesize": ["--model", str(model), "--sequences", "2", "--n-ctx", "8"],
    }


def argv_of(command: str, out, tmp_path, stage_argv) -> list[str]:
    if command in stage_argv:
        return [command, *stage_argv[command], "--out", str(out)]
    inputs = {n: _make_input(tmp_path / "apart" / f"in{i}", n) for i, n in enumerate(ROWS[command][0])}
    return _argv(command, str(out), inputs)


def invoke_while_held(tmp_path, argv, at):
    """The command run while a live run holds the lock at `at` (a file lock in this process: a second
    holder in the same process is refused as one in another process is): its result, and whether
    nothing under tmp_path changed."""
    held = storage.lock(at)
    try:
        before = snapshot(tmp_path)
        result = CliRunner().invoke(main, argv)
        return result, snapshot(tmp_path) == before
    finally:
        held.release()


@pytest.mark.parametrize("existing", [False, True], ids=["new-out", "existing-out"])
@pytest.mark.parametrize("command", directory_writers())
def test_a_second_run_on_a_held_out_exits_3_and_writes_nothing(tmp_path, command, existing, stage_argv):
    out = tmp_path / "out"
    argv = argv_of(command, out, tmp_path, stage_argv)
    # the holder has started writing: a file of its own (hidden: no command counts it as a user's)
    mine = out / ".holders-file"
    if existing:
        mine.parent.mkdir()
        mine.write_text("the first run's")
    # the lock exactly where the command takes it, held as a live run holds it
    result, untouched = invoke_while_held(tmp_path, argv, lock_location(out))
    assert result.exit_code == 3, (command, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert lines and lines[-1].startswith("error: another entroweight run holds "), result.output
    assert str(out) in lines[-1], lines[-1]
    # --wait advised where the command has one
    has_wait = any(p.name == "wait" for p in main.commands[command].params)
    assert ("--wait" in lines[-1]) == has_wait, lines[-1]
    assert "Traceback" not in result.output
    assert untouched, f"{command} wrote while another run held {out}"
    if existing:
        assert mine.read_text() == "the first run's"


@pytest.mark.parametrize("command", directory_writers())
def test_overwrite_never_removes_what_a_running_command_writes(tmp_path, command, stage_argv):
    """A train run writing into --out (its files there, not yet its mark), held: another command with
    --overwrite removed them, lock file and all, and exited 0 (the stages cleared --out before taking
    their lock); without --overwrite it called them a user's files (exit 2, "write elsewhere"). Both
    exit 3 now, nothing touched."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("metrics.jsonl", "tokenizer.json"):  # what a training run writes before its mark
        (out / name).write_text("the running train's")
    argv = argv_of(command, out, tmp_path, stage_argv)
    held = storage.lock(lock_location(out))
    try:
        for extra in (
            ([], ["--overwrite"])
            if any(p.name == "overwrite" for p in main.commands[command].params)
            else ([],)
        ):
            before = snapshot(tmp_path)
            result = CliRunner().invoke(main, argv + extra)
            assert result.exit_code == 3, (command, extra, result.output)
            assert "another entroweight run holds" in result.output, result.output
            assert snapshot(tmp_path) == before, f"{command} {extra} touched a running command's --out"
    finally:
        held.release()


@pytest.mark.parametrize("command", ["train", "train-tokenizer", "evaluate"])
def test_wait_queues_behind_the_holder(tmp_path, command, stage_argv):
    """--wait SECONDS: the second run waits for the holder's release, then runs (here: on to its own
    check of the fake inputs, exit 2, not 3), and its lock file is gone again."""
    out = tmp_path / "out"
    argv = argv_of(command, out, tmp_path, stage_argv) + ["--wait", "30"]
    at = lock_location(out)
    held = storage.lock(at)  # released by this thread, which took it (filelock's locks are per thread)
    result = {}
    second = threading.Thread(target=lambda: result.update(r=CliRunner().invoke(main, argv)))
    start = time.monotonic()
    second.start()
    time.sleep(0.5)
    assert second.is_alive(), "the second run did not wait"
    held.release()
    second.join(60)
    result = result["r"]
    assert time.monotonic() - start >= 0.4
    assert result.exit_code != 3, result.output
    assert not storage.path(at).exists()


def test_the_lock_leaves_no_file_and_no_directory_it_made(tmp_path):
    out = tmp_path / "a" / "b" / "out"
    with out_lock(out):
        assert (out / ".lock").exists()
    assert not (tmp_path / "a").exists()
    out.mkdir(parents=True)
    (out / "mine").write_text("x")
    with out_lock(out):
        pass
    assert sorted(p.name for p in out.iterdir()) == ["mine"]


def test_a_train_step_lock_does_not_meet_its_workflows(tmp_path):
    """A workflow holds run_dir/.lock; its train step's --out is a directory inside, whose lock is its
    own: taken while the run's is held."""
    run_dir = tmp_path / "run"
    run = storage.lock(run_dir / ".lock")
    try:
        with out_lock(run_dir / "train" / "seed-0"):
            pass
    finally:
        run.release()


def test_waiting_for_a_run_leaves_no_lock_file(tmp_path):
    """Waiting on a run (`wait_unheld`, --wait) took the lock once it was free, and the lock made its
    file anew where the run had removed its own: an empty `.lock` in a finished evaluation (an
    audit's finding). The file is removed as a run removes it."""
    out = tmp_path / "out"
    out.mkdir()
    done = threading.Event()

    def hold():
        with out_lock(out):
            done.set()
            time.sleep(0.5)

    t = threading.Thread(target=hold)
    t.start()
    done.wait()
    storage.wait_unheld(out, wait=10)
    t.join()
    assert not lock_location(out).exists()
    assert sorted(p.name for p in out.iterdir()) == []


def test_a_lock_file_left_by_a_killed_run_is_no_users_file(tmp_path, scored):  # noqa: F811 - fixture
    """A SIGKILLed train leaves `out/.lock` (nothing else): export-data, which replaces --out whole,
    called it a user's file (exit 2, even with --overwrite; an audit's finding). A lock file is a
    run's bookkeeping: the export goes ahead."""
    out = tmp_path / "out"
    out.mkdir()
    (out / ".lock").write_text("")
    result = CliRunner().invoke(main, ["export-data", str(scored), "--format", "hf", "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert (out / "export.json").exists()
