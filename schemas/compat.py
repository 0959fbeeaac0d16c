"""The one compatibility check: inputs that cannot be read together are refused before any output
exists, naming the field and both values.

Every command that reads several token datasets together (train on several directories, compare, the
quantiles of `--quantiles-from` against the values they weigh) and every reader of one directory's
shards (each shard against the first: one configuration per directory) calls `check_compatible` on
the facts of each input (`facts`: its file metadata and the weights' stored type)."""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from .arrow import METADATA_KEY
from .weighted import WEIGHT, weight_dtype

# What two datasets read together must share, and how a refusal names it.
TOGETHER = {
    "tokenizer_sha256": "tokenizer (sha256)",
    "vocab_size": "vocabulary size",
    "n_ctx": "n_ctx",
    "packed": "layout (packed)",
    "padding_side": "padding side",
    "pad_id": "pad id",
    "weight_dtype": "weight dtype",
    "unit": "unit of the values",
}


class Incompatible(ValueError):
    """Inputs that cannot go together; the message names the field, both inputs and both values
    (`fact`), then what to do."""

    def __init__(self, fact: str, hint: str):
        self.fact = fact
        super().__init__(f"{fact}; {hint}")


def facts(schema: pa.Schema) -> dict[str, Any]:
    """What a shard says of itself: its `entroweight` metadata, and its weights' stored type."""
    raw = (schema.metadata or {}).get(METADATA_KEY)
    meta = json.loads(raw) if raw else {}
    if WEIGHT in schema.names:
        meta["weight_dtype"] = weight_dtype(schema)
    return meta


def _short(value: Any) -> str:
    text = repr(value)
    return text[:15] + "…'" if isinstance(value, str) and len(value) > 16 else text


def check_compatible(inputs: list[tuple[str, dict[str, Any]]], fields=TOGETHER, what: str = "") -> None:
    """Refuse (Incompatible) the first input whose fact differs from the first input's, for each of
    `fields` (key -> its name in the message); a fact an input does not record (another tool's
    parquet) is not compared."""
    if len(inputs) < 2:
        return
    (where_a, a), rest = inputs[0], inputs[1:]
    for where_b, b in rest:
        for key, name in fields.items():
            if key in a and key in b and a[key] != b[key]:
                hint = (
                    "one configuration per directory: rerun the command that wrote it with --overwrite"
                    if key == "config_hash"
                    else "give inputs made alike"
                )
                fact = f"{what}{name} differs: {where_a} has {_short(a[key])}, {where_b} has {_short(b[key])}"
                raise Incompatible(fact, hint)


def check_part_config(part, schema: pa.Schema) -> None:
    """A committed shard holds the configuration of its directory: the config hash its own metadata
    records is its manifest's (a shard of another run copied in, its manifest edited, is refused)."""
    check_compatible(
        [
            (f"{part.name}'s manifest", {"config_hash": part.manifest.config_hash}),
            (part.location, facts(schema)),
        ],
        {"config_hash": "configuration (config hash)"},
        "one directory, two configurations: ",
    )
