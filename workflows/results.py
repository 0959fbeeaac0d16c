"""A workflow step's result record (an evaluation, the agreement table, an accuracy), sealed with the
sha256 of its own content: a record edited by hand since its step wrote it is seen, by the run
(which makes it again) and by the report (which refuses it), as a checkpoint's weights are by their
recorded sha256. A record without its seal is one too (the seal removed with the edit), and so is a
result written before seals (2026-11-28): the run makes it again once, sealed."""

from __future__ import annotations

import hashlib
import json
from typing import Any

SEAL = "record_sha256"


def _digest(record: dict) -> str:
    body = {k: v for k, v in record.items() if k != SEAL}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def sealed(record: dict) -> dict:
    """`record` with its seal, as a step writes it."""
    return {**record, SEAL: _digest(record)}


def edited(record: Any) -> bool:
    """Whether a result read back is not as its step wrote it: no seal, or one its content no longer
    matches."""
    return not isinstance(record, dict) or record.get(SEAL) != _digest(record)
