"""The reference quantiles of a global-scale weighting (`--quantiles-from`, a workflow's
`quantiles_from:`), read by every front end through one function that refuses values of another
unit: L1-occlusion quantiles applied to values in nats would make every weight 0."""

from __future__ import annotations


def values_unit(location) -> str | None:
    """The `unit` a scored directory's (or file's) metadata records for its values; None when it
    records none (scored before units were recorded) or holds no part."""
    from entroweight.schemas import read_file_metadata
    from entroweight.schemas.datadir import data_files

    try:
        _, files = data_files(location, kind="weighted", complete=False)
    except ValueError:  # not weighted data: refused by whoever reads it, with their own message
        return None
    return read_file_metadata(files[0]).get("unit") if files else None


def scorer_unit(scorer: str, options: dict) -> str | None:
    """The unit of the values `scorer` with `options` writes (an occlusion's depends on its metric);
    None when it cannot be told without loading a model."""
    from entroweight.scorers.registry import get_scorer_class

    try:
        return get_scorer_class(scorer).unit_of(options)  # from the options: nothing is loaded
    except Exception:  # an unknown scorer or bad options: refused elsewhere, with their own message
        return None


def check_units(theirs: str | None, unit: str | None, field: str, location) -> None:
    """The one unit check: quantiles of values in `theirs` may weigh values in `unit`; refused
    (ValueError naming `field`, `location` and both units) when both are known and differ."""
    if unit and theirs and theirs != unit:
        raise ValueError(
            f"{field} {location} holds values in unit {theirs!r}, but the values to weigh are in "
            f"{unit!r}: its quantiles would put every weight at 0 or 1; take the quantiles of a run "
            f"scored in {unit!r}"
        )


#: units of values with no bound (a loss): `raw` weighing reads its values as they are, in [0, 1]
UNBOUNDED = ("nats", "nats_difference")


def check_raw(method: str, unit: str | None, flags: str = "--weighting raw") -> None:
    """`raw` weighs values as they are, clipped to [0, 1] (a distance such as occlusion's cosine): on
    a loss in nats nearly every weight would be 0 (ValueError naming `flags`)."""
    if method == "raw" and unit in UNBOUNDED:
        raise ValueError(
            f"{flags} weighs the values as they are, clipped to [0, 1]: these are in {unit!r} (a loss), "
            "which would put nearly every weight at 0; weigh them with minmax, quantile or topk"
        )


def reference_quantiles(location, unit: str | None, field: str = "--quantiles-from") -> tuple[float, ...]:
    """The quantiles of `location`'s values, refused (`check_units`) when they are in another unit
    than the values they will weigh (`unit`)."""
    import pyarrow as pa

    from entroweight.transforms.weigh import entropy_quantiles

    try:
        check_units(values_unit(location), unit, field, location)
        return entropy_quantiles(location)
    except pa.ArrowException as e:  # not parquet at all (a .jsonl.gz): say which flag and file
        raise ValueError(f"{field} {location} is not scored parquet data ({e})") from None
