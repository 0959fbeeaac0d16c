"""A workflow step's result record (an evaluation, the agreement table, an accuracy), sealed with the
sha256 of its own content: a record edited by hand since its step wrote it is seen, by the run
(which makes it again) and by the report (which refuses it), as a checkpoint's weights are by their
recorded sha256. A record without its seal is one too (the seal removed with the edit), and so is a
result written before seals (2026-11-28): the run makes it again once, sealed."""

from __future__ import annotations

from pathlib import Path

from entroweight import storage
from entroweight.models.checkpoint import CONFIG, WEIGHTS, edited_config
from entroweight.output import SEAL, edited, sealed  # noqa: F401 - the seal is the contract's
from entroweight.trainers.checkpoint import STATE, is_the_file_saved

STEP_FILE = ".workflow-step.json"  # the holdout's and the accuracy items' record: the key each was built with


def step_record(path: Path) -> dict:
    """A step's own JSON record (its marker, a cached result, a checkpoint's state), or {} where there
    is none that can be read: absent, cut short, edited into something else. A step whose record is
    unreadable is not done, so it is made again (no run is blocked by a derived file gone bad)."""
    return storage.json_record(path) or {}


def file_stat(path: Path) -> tuple[int, int] | tuple[None, None]:
    try:
        st = path.stat()
    except OSError:
        return None, None
    return st.st_size, st.st_mtime_ns


def weights_damage(ckpt: Path, state: dict) -> str | None:
    """Why a finished checkpoint's weights are not the file its training wrote, or its config.json not
    the model they were saved as (`edited_config`) (None: they are). Each
    step that loads them checks their sha256 only then, so a file cut short or edited would stay "up to
    date" and fail every later run. The size its trainer_state.json records is checked always; the
    sha256 it records, whenever the file's size or mtime is not what the save recorded (a checkpoint
    saved before they were recorded: every time). Hashing reads the whole file, about a second for a
    few hundred MB, and a file untouched since its training is not read at all."""
    weights = ckpt / WEIGHTS
    size, mtime = file_stat(weights)
    if size is None:
        return f"{WEIGHTS} is gone"
    if changed := edited_config(ckpt):  # settings the weights' shapes do not show (mask_pads, ...)
        return f"{CONFIG} does not describe the model its weights were saved as ({changed})"
    if state.get("weights_bytes") not in (None, size):
        return f"{WEIGHTS} is {size} bytes, {state['weights_bytes']} as trained (cut short or edited)"
    if (size, mtime) == (state.get("weights_bytes"), state.get("weights_mtime_ns")):
        return None  # untouched since its training wrote it
    if not is_the_file_saved(ckpt, WEIGHTS, state):
        return f"{WEIGHTS} is not the file trained (its sha256 is not the one {STATE} records): edited or damaged"
    return None


def checkpoint_damage(ckpt: Path) -> str | None:
    """Why the finished checkpoint in `ckpt` (a train or model step's) is not as its training wrote it
    (`weights_damage`), by the records beside it; None where it is, or where none is finished."""
    state = step_record(ckpt / STATE)
    if not state.get("step"):
        return None
    return weights_damage(ckpt, state)
