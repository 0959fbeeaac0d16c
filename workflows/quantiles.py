"""The reference quantiles of a global-scale weighting (`--quantiles-from`, a workflow's
`quantiles_from:`), read by every front end through one function that refuses values of another
unit: L1-occlusion quantiles applied to values in nats would make every weight 0."""

from __future__ import annotations

import json


def values_unit(location) -> str | None:
    """The `unit` a scored directory's (or file's) metadata records for its values; None when it
    records none (scored before units were recorded) or holds no part."""
    import pyarrow.parquet as pq

    from entroweight import storage
    from entroweight.schemas.arrow import METADATA_KEY

    names = storage.listing(location)
    parts = sorted(n for n in names if n.startswith("part-") and n.endswith(".parquet"))
    files = [storage.path(location) / parts[0]] if parts else [] if names else [storage.path(location)]
    for f in files:
        with storage.open_input(f) as fh:
            meta = pq.read_schema(fh).metadata or {}
        if METADATA_KEY in meta:
            return json.loads(meta[METADATA_KEY]).get("unit")
    return None


def scorer_unit(scorer: str, options: dict) -> str | None:
    """The unit of the values `scorer` with `options` writes (an occlusion's depends on its metric);
    None when it cannot be told without loading a model."""
    from entroweight.scorers.registry import get_scorer_class

    try:
        cls = get_scorer_class(scorer)
        unit = cls.__dict__.get("unit", getattr(cls, "unit", None))
        if isinstance(unit, str):
            return unit
        return cls(**options).unit  # a property of its options: constructing loads nothing
    except Exception:  # an unknown scorer or bad options: refused elsewhere, with their own message
        return None


def reference_quantiles(location, unit: str | None, field: str = "--quantiles-from") -> tuple[float, ...]:
    """The quantiles of `location`'s values, refused (ValueError naming `field` and both units) when
    they are in another unit than the values they will weigh (`unit`)."""
    from entroweight.transforms.weigh import entropy_quantiles

    theirs = values_unit(location)
    if unit and theirs and theirs != unit:
        raise ValueError(
            f"{field} {location} holds values in unit {theirs!r}, but the values to weigh are in "
            f"{unit!r}: its quantiles would put every weight at 0 or 1; take the quantiles of a run "
            f"scored in {unit!r}"
        )
    return entropy_quantiles(location)
