"""One contract for a command's output, as `pipelines.run_stage` is for a stage's shards.

A command that writes declares its output (`Output`): its command name, the files that mark a
directory as its output and what each holds when the command wrote it (`Mark`), the names it writes
directly there, and the sealed JSON record it writes last. The declaration is registered (`declare`)
where the command lives; the built-in commands' modules are named in `BUILTIN` and loaded on the
first question, so source discovery and the path rule know every command's output without the
storage layer naming any.

`writing(output, out, reads, made_of, ...)` applies every rule, in this order, and is the only way
a declared command writes: the location (blank, a URL with a slash missing: `storage.path`), a run
writing there now (exit 3), the path rule (`check_output`: never where it reads, never over another
command's output or a user's files unless --overwrite may replace it), the lock, then under it the
record: the same record (same options, same inputs, every file as written) is nothing to do; a record
of other options is refused unless --overwrite; one of changed inputs, incomplete or edited, is made
again (a `kept` output is refused unless --overwrite instead: what was made with it depends on it);
then the output is written into staging, its record sealed last; a block refused on the way takes
back what it wrote. A new rule for every
writing command is a change here; a new writing command is one `declare` (tests/test_output_contract.py).

The resumable command, `train`, writes as it goes (each save a checkpoint, its own record; a
torchrun's lock held by rank 0): it asks the same rules in the same order (trainers/loop.py), its
rerun judged here too: the same record continues (`continues`), another is refused.

The stages' outputs are the stage mechanism's (`.stage.json` names its stage): not declared here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fnmatch
import hashlib
import importlib
import json
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from . import storage
from .storage import OutputRefused, blank, listing, path, some_of

#: the modules that declare the built-in commands' outputs (each calls `declare` when imported);
#: light modules all: source discovery asks the registry while it lists what tokenize reads
BUILTIN = (
    "entroweight.workflows.engine.outputs",
    "entroweight.trainers.outputs",
    "entroweight.pipelines.export_data",
    "entroweight.transforms.train_tokenizer",
)
STAGE_RECORD = ".stage.json"  # a stage's record, naming its stage inside (pipelines/stage.py)
#: The owner of a directory holding a stage's shards but no stage record (`.stage.json` removed).
UNKNOWN_STAGE = "a stage whose .stage.json is gone"
MARK_BYTES = 1 << 20  # a mark is a small record: a larger file of its name is a user's
#: What a command's sealed record holds beside its own facts: what the output is made of (`options`
#: a user chose, `inputs`' fingerprints) and the sha256 of each file it wrote; `SEAL` the sha256 of
#: the record's own content (a record edited since is seen: `edited`).
MADE_OF, FILES, SEAL = "made_of", "files", "record_sha256"


@dataclasses.dataclass(frozen=True)
class Mark:
    """A file that marks a directory as a command's output, and what it holds where the command wrote
    it: keys of its JSON object (of its first line, for JSON lines), every one, or for a text mark a
    pattern of its content; None for a name of this project's alone. A user's file of the name (a
    multiple-choice dataset's `items.jsonl`, a scraper's `export.json`) marks nothing."""

    name: str
    holds: tuple[str, ...] | re.Pattern | None = None

    def reads_as_ours(self, directory) -> bool:
        if self.holds is None:
            return True
        try:
            with storage.open_input(path(directory) / self.name) as f:
                head = f.read(MARK_BYTES + 1)
            if len(head) > MARK_BYTES:
                return False
            if isinstance(self.holds, re.Pattern):
                return self.holds.fullmatch(head.decode("utf-8")) is not None
            record = json.loads(head.split(b"\n", 1)[0] if self.name.endswith(".jsonl") else head)
        except (OSError, ValueError):
            return False  # unreadable or not JSON: no record of ours
        return isinstance(record, dict) and all(k in record for k in self.holds)


@dataclasses.dataclass(frozen=True)
class Output:
    """What a command that writes declares of its output.

    `marks`: the files that mark a directory as its output (the first it writes comes last, so a run
    stopped before it is still its own where another mark is written early: evaluate's items).
    `files`: the names (fnmatch patterns) it writes directly in its output; any other name there is a
    user's file, which no --overwrite removes. `files_of`: where the names are what the output records
    (a workflow run's run.json), the function reading them (None: not recorded, none told apart).
    `record`: the JSON record `writing` seals last (None: the command keeps its own record).
    `leftovers`: a run stopped before its mark leaves its other files, which the command takes back
    (a training run's first save, a tokenizer written before its sha256).
    `kept`: what was made with the output depends on it (data tokenized with a tokenizer, a trainer
    reading an export): one that is not this very output (of inputs changed since, its files or record
    edited, no record) is refused unless --overwrite, where the default makes it again; a run stopped
    on its way (its mark written first, never sealed) is made again either way.
    `resumable`: a command that continues its output (train) keeps its own record, rewritten by each
    save (a checkpoint's): the function reading from a directory what that record says the output is
    made of and where it stopped ((made_of, step)), None where it holds none one command made; its
    same record is not "nothing to do" but "continue from step N" (`continues`)."""

    command: str
    marks: tuple[Mark, ...]
    files: tuple[str, ...] = ("*",)
    record: str | None = None
    leftovers: bool = False
    kept: bool = False
    files_of: Callable[[object], list[str] | None] | None = None
    resumable: Callable[[object], tuple[dict, int] | None] | None = None

    def names_written(self) -> set[str]:
        return set(self.files) - {m.name for m in self.marks}

    def holds_its_files(self, directory) -> bool:
        """Whether `directory` holds a file of a name this output writes (a mark, or one of `files`)."""
        names = (*self.files, *(m.name for m in self.marks))
        return any(fnmatch.fnmatchcase(n, p) for n in _entries(directory) for p in names)


_DECLARED: dict[str, Output] = {}


def declare(output: Output) -> Output:
    """Register `output` (a command's declaration; once per command)."""
    _DECLARED[output.command] = output
    return output


def declared() -> list[Output]:
    """Every declared command's output: the built-ins and any declared since."""
    for module in BUILTIN:
        importlib.import_module(module)
    return list(_DECLARED.values())


def declaration(command: str) -> Output | None:
    return next((o for o in declared() if o.command == command), None)


def marks() -> list[tuple[Mark, str]]:
    """Every declared mark and its command, in the order they are asked."""
    return [(m, o.command) for o in declared() for m in o.marks]


# ------------------------------------------------------------------ whose output a directory is


def output_owner(directory) -> str | None:
    """The command whose output `directory` holds (a stage's by its record, else a declared mark), or
    None (absent, empty, or no mark). Refuses a stage record that is not one (a non-JSON
    `.stage.json`): its owner is unknown."""
    names = listing(directory)
    if STAGE_RECORD in names:
        try:
            return str(json.loads((path(directory) / STAGE_RECORD).read_bytes())["stage"])
        except (ValueError, KeyError, TypeError):
            raise OutputRefused(
                f"{storage.url(path(directory))}/{STAGE_RECORD} is not a stage record (not JSON naming its "
                "stage): write elsewhere, or pass --overwrite to replace the directory whole"
            ) from None
    for output in declared():
        if any(m.name in names for m in output.marks):
            return output.command
    if any(n == ".shards.json" or n.startswith(("part-", ".part-")) for n in names):
        return UNKNOWN_STAGE  # a stage's shards whose record is gone: whose they are is unknown
    return None


def command_output(directory, names) -> str | None:
    """The command, other than a stage, whose output `directory` holds, `names` being the files
    directly in it: a declared mark is there and reads as its command writes it; else None. Sources
    skip such a directory (a training run's metrics.jsonl, an evaluation's items): its files are
    records, not documents."""
    for output in declared():
        for mark in output.marks:
            if mark.name in names and mark.reads_as_ours(directory):
                return output.command
    return None


def named(owner: str) -> str:
    """A command as a refusal names it (`tokenize`); an owner told in words as it is."""
    return owner if " " in owner else f"`{owner}`"


def foreign_files(directory, owner: str | None, command: str) -> list[str]:
    """The entries directly in `directory` that no entroweight command wrote there, sorted: with no
    owner, every one not hidden but what `command`'s own stopped run leaves (`Output.leftovers`); in
    a command's output, every one not hidden but what that command writes there (a stage's shards, as
    pipelines/verify.py counts them; a declared output's files). Hidden names are not counted: the
    commands keep their bookkeeping there (a lock, a stage record, manifests)."""
    names = [n for n in _entries(directory) if not n.startswith(".")]
    if owner is None:
        mine = _DECLARED.get(command) if command in _DECLARED else declaration(command)
        left = mine.names_written() if mine is not None and mine.leftovers else set()
        return sorted(n for n in names if n not in left)
    if owner == UNKNOWN_STAGE or STAGE_RECORD in listing(directory):
        return sorted(n for n in names if not n.startswith("part-"))
    theirs = declaration(owner)
    if theirs is None:
        return []
    if theirs.files_of is not None:
        recorded = theirs.files_of(directory)
        marks = {m.name for m in theirs.marks}
        return [] if recorded is None else sorted(set(names) - marks - set(recorded))
    return sorted(n for n in names if not any(fnmatch.fnmatchcase(n, p) for p in theirs.files))


def _entries(directory) -> list[str]:
    """The names directly in `directory`, files and directories ([] when it does not exist)."""
    d = path(directory)
    if storage.is_local(d):
        return [e.name for e in Path(d).iterdir()] if Path(d).is_dir() else []
    return list(listing(d))


def check_apart(out, flag: str, reads=()) -> None:
    """Refuse an `out` inside a directory that holds a command's output (but those of `reads`)."""
    allowed = {k for _, read in reads if read is not None for k in storage.forms(read)}
    for above in storage.parents(out):
        if above in allowed:
            continue
        try:
            owner = output_owner(above)
        except OutputRefused:
            owner = "a stage whose record is not JSON"
        except Exception:  # noqa: BLE001 - unreachable (no bucket, no credentials): check_writable says why
            return
        if owner is not None:
            raise OutputRefused(
                f"{flag} {out} lies inside {above}, the output of {named(owner)}; a command's output never goes "
                "inside another's (it would mix into what that one reads and rewrites): write elsewhere"
            )


# ------------------------------------------------------------------ the path rule


def check_output(
    out,
    reads,
    command: str,
    flag: str = "--out",
    overwrite: bool | None = False,
    owners: tuple[str, ...] = (),
    may_lie_inside: bool = False,
    apart: bool = False,
    file: bool = False,
) -> str | None:
    """The one path rule, asked by `writing` and by the stage planner before anything is created:
    `out` may not be, lie inside or hold anything it reads (`reads`: (flag, location) pairs; symlinks
    followed, URLs compared by key), nor hold another command's output (a stage of another name, a
    training run, an export, a workflow run) unless `overwrite`, which replaces it whole. `owners`:
    the other commands whose output this one may continue. `may_lie_inside`: a file written inside
    what it reads by design (`report`'s RUN_DIR/report.html). `apart` (a command run by hand): `out`
    may not lie inside another command's output either (a workflow run, a stage's shards, a training
    run): it would mix into what that command reads and rewrites, and --overwrite cannot help there
    (a workflow writes inside its own run directory, so its steps do not ask this).
    `overwrite` None: the command has no --overwrite, so no refusal advises it. `file`: `out` is one
    file the command writes (report's .html), not a directory to write into.
    A user's own files are never written among nor removed, --overwrite or not (`foreign_files`): an
    `out` holding files of no command is refused, and so is the output of a stage with files beside
    its shards when --overwrite would replace it.
    Returns the other command whose output `overwrite` will replace (the caller removes `out` whole
    once every other check passed), else None. Raises OutputRefused."""
    if blank(out):
        raise OutputRefused(f"{flag} is empty (an unset variable?): name the location to write")
    for what, read in reads:
        if blank(read):
            raise OutputRefused(f"{what} is empty (an unset variable?): name what {command} reads")
    for what, read in reads:
        if read is None or str(read).startswith(("hf:", "hf://")):
            continue  # the hub is read-only: no output can be among its files
        how = storage.relation(out, read)
        if how and not (how == "lies inside" and may_lie_inside):
            raise OutputRefused(
                f"{flag} {out} {how} {what} {read}, which {command} reads; write to a location apart "
                "from what it reads"
            )
    storage.check_place(out, flag, file)
    if apart:
        check_apart(out, flag, reads if may_lie_inside else ())
    try:
        owner = output_owner(out)
    except OutputRefused:
        if overwrite:
            return "unknown"
        raise
    except Exception:  # noqa: BLE001 - unreachable (no bucket, no credentials): check_writable says why
        return None
    replaced = owner is not None and owner != command and owner not in owners
    # `out` replaced whole: another command's output, or this command's own made again
    removed = bool(overwrite and owner is not None)
    if not file and (owner is None or not replaced or removed):  # written into, or replaced whole
        theirs = foreign_files(out, owner, command)
        if theirs and owner is None:
            raise OutputRefused(
                f"{flag} {out} holds files of no entroweight command ({some_of(theirs)}), which `{command}` "
                "would mix its own among or replace: write to a new or empty directory"
            )
        if theirs:  # what verify calls "not a shard of this directory", and a workflow step's check
            raise OutputRefused(
                f"{flag} {out} holds the output of {named(owner)} and files no command wrote ("
                f"{some_of(theirs)}), which "
                + ("--overwrite would remove with it" if removed else f"`{command}` would write among")
                + ": move them out first, or write elsewhere"
            )
    if not replaced:
        return None
    if overwrite:
        return owner
    advice = "" if overwrite is None else ", or pass --overwrite to replace it whole"
    raise OutputRefused(
        f"{flag} {out} holds the output of {named(owner)}, not of `{command}`; write elsewhere{advice}"
    )


# ------------------------------------------------------------------ the record, sealed last


def _digest(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def sealed(record: dict) -> dict:
    """`record` with its seal (the sha256 of its content), as a command or a step writes it."""
    return {**record, SEAL: _digest(record)}


def edited(record) -> bool:
    """Whether a record read back is not as it was written: no seal, or one its content no longer
    matches."""
    return not isinstance(record, dict) or record.get(SEAL) != _digest(record)


def files_sha256(directory, names) -> dict[str, str]:
    """{name: sha256} of those of the files `names` (paths relative to `directory`) that are there."""
    out = {}
    for name in names:
        try:
            out[name] = storage.sha256(path(directory) / name)
        except OSError:  # gone: not the output recorded
            continue
    return out


def written_files(directory, output: Output) -> list[str]:
    """The files of an output its record lists (paths relative to `directory`): every file below it
    but its record and what is hidden (bookkeeping, a tool's scratch)."""
    return sorted(
        rel
        for rel in storage.walk(directory)
        if rel != output.record and not any(part.startswith(".") for part in rel.split("/"))
    )


def _remove_new(directory: Path, before: set[str]) -> None:
    """Remove the entries of `directory` not among `before` (what a refused block wrote)."""
    for name in set(_entries(directory)) - before:
        p = directory / name
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)


class Differs(OutputRefused):
    """`out` holds this command's output of other options: refused unless --overwrite."""


def recorded(out, output: Output, made_of: dict) -> tuple[str | None, str]:
    """What `out` holds of `output` for a run made of `made_of` ({"options": ..., "inputs": ...}), and
    why in words: "same" where its sealed record says this very output (the same options and inputs,
    every file as recorded): a rerun has nothing to do; "again" where it is to be made again whole (of
    changed inputs, incomplete, edited, or recorded by an older version: why says which, "" for a run
    stopped on its way); None where there is no record. One of other options raises Differs, naming
    what differs. Asked under the lock on `out`."""
    record = storage.json_record(path(out) / output.record)
    if record is None:
        return None, ""
    if record.keys() == {MADE_OF}:  # its mark, written first and never sealed: a run stopped on its way
        return "again", ""
    made = record.get(MADE_OF)
    was = made.get("options") if isinstance(made, dict) else None
    if not isinstance(was, dict) or was.keys() != made_of["options"].keys():
        return "again", "recorded by another version (or its record edited)"
    if was != made_of["options"]:
        from .options import setting_changes

        raise Differs("; ".join(setting_changes(was, made_of["options"])))
    files = record.get(FILES)
    if edited(record) or not isinstance(files, dict) or not isinstance(made.get("inputs"), dict):
        return "again", "whose record is edited"
    if made != made_of:
        changed = [k for k in made_of["inputs"] if made["inputs"].get(k) != made_of["inputs"][k]]
        return "again", f"of inputs changed since ({', '.join(changed) or 'others'})"
    if files_sha256(out, files) != files:
        return "again", "whose files differ from its record (edited, or removed)"
    return "same", ""


def continues(out, output: Output, made_of: dict | Callable[[], dict | None] | None) -> int | None:
    """Where a resumable command (`Output.resumable`) continues `out` from: the step its record says it
    stopped at, where `out` holds this very output (the same options and inputs: `made_of`, or the
    function computing it, asked only where there is a record; None: inputs that cannot be read, refused
    where the command reads them). At its last step the command has nothing left to do. None where
    `out` holds no record of it, or another's, which the command refuses unless told to continue it
    or to replace it (--overwrite). Asked under the lock on `out`."""
    held = output.resumable(out)
    if held is None:
        return None
    if callable(made_of):
        made_of = made_of()
    was, step = held
    return step if made_of is not None and was == made_of else None


def standing(
    out, output: Output, made_of: dict | None, overwrite, what: str, flag: str = "--out"
) -> str | None:
    """What `out` holds of `output` for a run made of `made_of`, as a rerun takes it (`recorded`): "same"
    (nothing to do), "again" (made again whole), None (nothing of it); refused (OutputRefused) where it
    holds this output of other options, unless `overwrite`, and for a `kept` output where it holds one
    that is not this very output (of other inputs, edited, no record). `made_of` None: inputs that
    cannot be listed or recorded (never "the same"). Asked by `writing` under the lock, and by a
    workflow step that writes this output before its run starts (its plan refuses what the run would)."""
    advice = "" if overwrite is None else ", or pass --overwrite to replace it"
    try:
        state, why = recorded(out, output, made_of) if made_of is not None else (None, "")
    except Differs as e:
        if not overwrite:
            raise OutputRefused(
                f"{flag} {out} holds {what} of other options ({e}); write elsewhere{advice}"
            ) from None
        return "again"
    if output.kept and not overwrite:
        if state is None and output.holds_its_files(out):  # its files (or a user's of their names), no record
            state, why = "again", "with no record of what it is made of"
        if state == "again" and why:
            raise OutputRefused(
                f"{flag} {out} holds {what} {why}; what was made with it depends on it: write elsewhere{advice}"
            )
    return state


@dataclasses.dataclass
class Writing:
    """A command's write in progress (`writing`): `state` "same" (nothing to do: `dest` is None) or
    "new" / "again"; `dest` the local directory to write the output into (staging for a URL);
    `record` what the command adds to its sealed record (its own facts: counts, where it came from)."""

    out: object
    output: Output
    made_of: dict
    state: str
    dest: Path | None = None
    record: dict = dataclasses.field(default_factory=dict)

    @property
    def nothing_to_do(self) -> bool:
        return self.state == "same"


def seal(directory, output: Output, made_of: dict, facts: dict | None = None) -> None:
    """Write `output`'s sealed record in local `directory`: the command's own `facts`, `made_of` and
    each written file's sha256. Last of all in `writing`; alone, where an output its command wrote
    before it kept this record is taken as it is (a workflow's tokenizer of an older version)."""
    record = {
        **(facts or {}),
        MADE_OF: made_of,
        FILES: files_sha256(directory, written_files(directory, output)),
    }
    storage.write_json_atomic(sealed(record), Path(directory) / output.record)


@contextlib.contextmanager
def writing(
    output: Output,
    out,
    reads,
    made_of: dict | Callable[[], dict | None] | None,
    *,
    overwrite: bool | None = False,
    wait: float = 0,
    what: str | None = None,
    flag: str = "--out",
    advise_wait: bool = True,
    apart: bool = True,
    check: Callable[[], None] | None = None,
) -> Iterator[Writing]:
    """Every rule of a command's output, in order (the module's docstring), around the block that
    writes it. `made_of` ({"options": what the user chose, "inputs": the fingerprints of what it
    reads}) may be a function, called once the path rule holds, under the lock (a checkpoint's tokenizer read). Refusals are OutputRefused (exit 2) or storage.OutputHeld (exit 3), raised before
    anything in `out` is touched. `check`: the command's own refusals that need the lock held and
    nothing yet written (a checkpoint loaded, a task's data found), asked after the record. The block
    writes its files into `w.dest` (nothing when `w.nothing_to_do`); once it returns, the record
    (`output.record`: `w.record`, `made_of` and each written file's sha256) is sealed last, and a URL's
    staging uploaded with it last. A block that raises seals nothing: a rerun makes the output again."""
    what = what or f"the output of `{output.command}`"
    storage.wait_unheld(out, wait, advise_wait)  # a run writing there now: its files are not yet marked
    foreign = check_output(out, reads, output.command, flag=flag, overwrite=overwrite, apart=apart)
    if storage.is_url(out):  # no bucket, no credentials: now, not after the work (one probe object)
        try:
            storage.check_writable(out)
        except OSError as e:
            raise OutputRefused(f"cannot write to {flag} {out}: {e.strerror or e}") from None
    with storage.holding_output(out, wait, advise_wait=advise_wait):
        if callable(made_of):  # what needs reading the inputs: under the lock, which a refusal takes back
            made_of = made_of()
        state = None if foreign else standing(out, output, made_of, overwrite, what, flag)
        if state == "same":
            yield Writing(out, output, made_of, "same")
            return
        if check is not None:
            check()
        if foreign or state:  # replaced whole (the lock stays)
            storage.clear_output(out)
        w = Writing(out, output, made_of, state or "new")
        with storage.staged(out, last=(output.record,)) as dest:
            w.dest = Path(dest)
            before = set(_entries(w.dest))
            mark = w.dest / output.record
            if output.record in {m.name for m in output.marks}:  # marked first: a run stopped on the
                # way leaves its own files (taken back by a rerun), not what reads as a user's
                w.dest.mkdir(parents=True, exist_ok=True)
                storage.write_json_atomic({MADE_OF: made_of}, mark)
            try:
                yield w
            except KeyboardInterrupt:  # stopped (Ctrl-C, SIGTERM): its files stay marked, made again
                if not written_files(w.dest, output):  # nothing of it left: no mark of it either
                    mark.unlink(missing_ok=True)
                raise
            except BaseException:  # refused on the way: what it wrote goes, `out` is as it was
                _remove_new(w.dest, before)
                raise
            seal(w.dest, output, made_of, w.record)


__all__ = [
    "BUILTIN",
    "Differs",
    "Mark",
    "Output",
    "Writing",
    "check_apart",
    "check_output",
    "command_output",
    "continues",
    "declare",
    "declared",
    "edited",
    "foreign_files",
    "named",
    "output_owner",
    "recorded",
    "seal",
    "sealed",
    "standing",
    "writing",
]
