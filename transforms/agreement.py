"""Agreement of two scorers on the same sequences: R², Pearson, Spearman over real tokens.

The write-up's comparison (L1 vs cosine occlusion R² 0.42, L1 vs loss 0.01, decomposition vs a small
causal model 0.33): R² is that of the least-squares line of one on the other, i.e. Pearson r²; the
line itself (`slope`, `intercept`) is B's values on A's, `b ≈ slope · a + intercept`: the write-up's
"y vs x" rows are `compare_dirs(x, y)`.
Sequences are matched by `seq_id` (their `input_ids` must then be equal) and only those in both
directories count; pads never do, nor positions a scorer excluded (`excluded`, schemas/weighted.py). Everything is read into memory: meant for a sample (millions of
tokens), not a whole corpus.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
from scipy.stats import rankdata  # 1-based average ranks (ties share their mean), float64

from entroweight.schemas import read_file_metadata
from entroweight.schemas.compat import TOGETHER, Incompatible, check_compatible
from entroweight.schemas.datadir import DataDirError, data_files
from entroweight.schemas.weighted import EXCLUDED, WEIGHT, excluded_mask, matrix, weights_matrix

COLUMNS = ("entropy", "weight")

#: The write-up's agreement tables ("y vs x": the least-squares line of y on x, over the same tokens):
#: key -> (what it compares, slope m, intercept b, R²). Its L¹ occlusion is min-max normalised per
#: row, cosine occlusion is 1 − cos, losses are nats, decomposition is the single-model pad-shift
#: entropy in nats, and the large model (Llama 3.2 1B) is mapped onto the small tokenizer with `mean`.
#: (Its prose gives R² 0.1360 for decomposition vs Llama, its table 0.1424: the table's is kept.)
WRITEUP = {
    "l1-cosine": ("L1 occlusion vs cosine occlusion", 0.9566, 0.1431, 0.4195),
    "l1-loss": ("L1 occlusion vs small causal model loss", 0.0063, 0.3894, 0.0107),
    "decomposition-small": ("decomposition vs small causal model loss", 1.4685, -1.1879, 0.3285),
    "decomposition-large": ("decomposition vs large causal model loss", 1.0540, 0.1097, 0.1424),
    "small-large": ("small vs large causal model loss", 0.7334, 0.8398, 0.4922),
}


class AgreementError(ValueError):
    """Two directories that cannot be compared; the message says why."""


def _read(dir_: str | Path, column: str) -> tuple[dict, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """{seq_id: (real token ids, their `column` values)} of a weighted directory (score or weigh
    output, local or a URL) or one of its files; positions the scorer excluded get NaN (left out of the comparison)."""
    try:  # a directory: complete, of one configuration, each shard checked against its manifest
        d, files = data_files(dir_, "weighted", hint="score it first (`entroweight score`), then compare")
        if not d.is_file:
            d.require_one_config()
    except DataDirError as e:
        raise AgreementError(str(e)) from None
    meta = read_file_metadata(files[0]) if d.is_file else d.metadata
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for f in files:
        try:
            source = d.open(f)
        except DataDirError as e:
            raise AgreementError(str(e)) from None
        with source as fh:
            pf = pq.ParquetFile(fh)
            names = pf.schema_arrow.names
            if not {"seq_id", "input_ids", "n_pad"} <= set(names):
                raise AgreementError(f"{f} is not entroweight data (no seq_id, input_ids, n_pad columns)")
            if column not in names:
                hint = (
                    " (it was written with --drop-entropy; compare --column weight)"
                    if column == "entropy"
                    else ""
                )
                raise AgreementError(f"{f} has no `{column}` column{hint}")
            cols = ["seq_id", "input_ids", "n_pad", column] + ([EXCLUDED] if EXCLUDED in names else [])
            t = pf.read(columns=cols)
        ids = matrix(t.column("input_ids"))
        width = ids.shape[1] if ids.ndim == 2 else 0
        col = t.column(column)
        vals = (weights_matrix(col, width) if column == WEIGHT else matrix(col, width=width)).astype(
            np.float64
        )
        excluded = excluded_mask(t.column(EXCLUDED), width) if EXCLUDED in cols else None
        if excluded is not None:
            vals[excluded] = np.nan
        n_pad = t.column("n_pad").to_numpy()
        for sid, r, p in zip(t.column("seq_id").to_pylist(), range(t.num_rows), n_pad, strict=True):
            rows[sid] = (ids[r, p:], vals[r, p:])
    return meta, rows


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    den = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / den) if den > 0 else float("nan")


def line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """(slope, intercept) of the least-squares line of y on x."""
    dx = x - x.mean()
    var = float((dx * dx).sum())
    slope = float((dx * (y - y.mean())).sum() / var) if var > 0 else float("nan")
    return slope, float(y.mean() - slope * x.mean())


def compare_dirs(dir_a: str | Path, dir_b: str | Path, column: str = "entropy") -> dict:
    """R², Pearson and Spearman of `column` between two scored directories over the real tokens of the
    sequences both hold, and the least-squares line of B on A. Returns {r2, pearson, spearman, slope,
    intercept, n_tokens, n_sequences, only_a, only_b, constant, ...}; a statistic a side of one value
    leaves undefined is None (`constant` names that side)."""
    if column not in COLUMNS:
        raise AgreementError(f"column must be one of {', '.join(COLUMNS)}, not {column!r}")
    meta_a, a = _read(dir_a, column)
    meta_b, b = _read(dir_b, column)
    try:  # the same tokens: tokenizer, vocabulary, n_ctx, layout (the values' units may differ)
        fields = {k: v for k, v in TOGETHER.items() if k not in ("unit", "weight_dtype")}
        check_compatible([(str(dir_a), meta_a), (str(dir_b), meta_b)], fields)
    except Incompatible as e:
        raise AgreementError(f"{e.fact}: score the same tokenized directory with both scorers") from None
    common = sorted(set(a) & set(b))
    if not common:
        raise AgreementError(
            f"{dir_a} and {dir_b} share no sequence (seq_id): score the same tokenized directory with both"
        )
    xs, ys = [], []
    for sid in common:
        (ids_a, va), (ids_b, vb) = a[sid], b[sid]
        if not np.array_equal(ids_a, ids_b):
            raise AgreementError(
                f"sequence {sid} holds different tokens in {dir_a} and {dir_b}: they were not scored from "
                "the same tokenized directory"
            )
        keep = ~(np.isnan(va) | np.isnan(vb))  # positions a scorer excluded count in neither
        xs.append(va[keep])
        ys.append(vb[keep])
    x, y = np.concatenate(xs), np.concatenate(ys)
    r = pearson(x, y)
    slope, intercept = line(x, y)

    def stat(v: float) -> float | None:  # undefined (a side of one value): null, never a NaN in JSON
        return v if np.isfinite(v) else None

    return {
        "column": column,
        "r2": stat(r * r),
        "pearson": stat(r),
        "slope": stat(slope),
        "intercept": stat(intercept),
        "spearman": stat(pearson(rankdata(x), rankdata(y))),
        # the sides whose values are all one value: what leaves the statistics undefined
        "constant": [side for side, v in (("A", x), ("B", y)) if v.size == 0 or np.ptp(v) == 0],
        "n_tokens": int(x.size),
        "n_sequences": len(common),
        "only_a": len(a) - len(common),
        "only_b": len(b) - len(common),
        "scorer_a": meta_a.get("scorer"),
        "scorer_b": meta_b.get("scorer"),
    }


# -- the estimator benchmark: each scorer's values against the truth of a synthetic corpus
TARGETS = ("entropy", "surprisal")  # the truth's columns (pipelines/synthesize.py)
INTERVAL = (2.5, 97.5)  # percentiles of the bootstrap: a 95 % interval


def _row_sums(rows: list[tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """(rows, 6) per-row n, Σx, Σy, Σx², Σy², Σxy: what a Pearson over any multiset of rows needs."""
    return np.array(
        [[x.size, x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()] for x, y in rows], np.float64
    )


def _pearson_of_sums(s: np.ndarray) -> np.ndarray:
    """Pearson r from summed sufficient statistics (..., 6)."""
    n, sx, sy, sxx, syy, sxy = np.moveaxis(s, -1, 0)
    cov = sxy - sx * sy / n
    var = (sxx - sx * sx / n) * (syy - sy * sy / n)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(var > 0, cov / np.sqrt(np.where(var > 0, var, 1.0)), np.nan)


def _bootstrap(rows: list[tuple[np.ndarray, np.ndarray]], counts: np.ndarray) -> dict:
    """Pearson r and r² over the rows, with each statistic's interval over the resampled rows
    (`counts`: resamples × rows, how often each row is drawn)."""
    sums = _row_sums(rows)
    r = float(_pearson_of_sums(sums.sum(0)))
    boot = _pearson_of_sums(counts @ sums)
    boot = boot[np.isfinite(boot)]

    def interval(v: np.ndarray) -> list[float] | None:
        return [float(q) for q in np.percentile(v, INTERVAL)] if v.size else None

    if not np.isfinite(r):  # a side of one value: undefined, never a NaN in JSON
        return {"r": None, "r_ci": None, "r2": None, "r2_ci": None}
    return {"r": r, "r_ci": interval(boot), "r2": r * r, "r2_ci": interval(boot * boot)}


def truth_table(
    truth_dir: str | Path, dirs: dict[str, str | Path], resamples: int = 1000, seed: int = 0
) -> dict:
    """Each directory's `entropy` values (an estimator's) against the truth of `truth_dir` (a
    synthesize output: the exact entropy and the surprisal of each token) over the real tokens of the
    rows both hold: Pearson, Spearman and R², each with a 95 % interval by a bootstrap over rows
    (the rows resampled with replacement, `resamples` times, from `seed`; a row's tokens are not
    independent, so rows are the unit). Spearman is the Pearson of the ranks over all tokens, which
    the bootstrap resamples without ranking again; `spearman_within_position` the same less each
    position's mean rank (a correlation that is only the shared position trend is 0 there). The
    teacher's own surprisal is the first
    estimator of the entropy ("surprisal"): what a model's loss at the truth would reach."""
    meta, truth = _read(truth_dir, "entropy")
    if meta.get("stage") != "synthesize":
        raise AgreementError(f"{truth_dir} is not a synthesize output: it holds no truth")
    _, surprisal = _read(truth_dir, "surprisal")
    targets = {"entropy": truth, "surprisal": surprisal}
    estimators = {"surprisal": (str(truth_dir), surprisal)}
    for name, d in dirs.items():
        m, vals = _read(d, "entropy")
        try:
            fields = {k: v for k, v in TOGETHER.items() if k not in ("unit", "weight_dtype")}
            check_compatible([(str(truth_dir), meta), (str(d), m)], fields)
        except Incompatible as e:
            raise AgreementError(f"{name}: {e.fact}: score the synthetic corpus itself") from None
        estimators[name] = (str(d), vals)
    rng = np.random.default_rng(seed)
    out = []
    for name, (where, vals) in estimators.items():
        common = sorted(set(vals) & set(truth))
        if not common:
            raise AgreementError(
                f"{where} shares no row (seq_id) with {truth_dir}: score the synthetic corpus"
            )
        for sid in common:
            if not np.array_equal(vals[sid][0], truth[sid][0]):
                raise AgreementError(f"row {sid} holds other tokens in {where} than in {truth_dir}")
        counts = rng.multinomial(len(common), np.full(len(common), 1 / len(common)), size=resamples).astype(
            np.float64
        )
        row = {"scorer": name, "n_rows": len(common)}
        for target in TARGETS:
            if target == name:
                continue
            pairs = []
            for sid in common:
                x, y = vals[sid][1], targets[target][sid][1]
                keep = ~(np.isnan(x) | np.isnan(y))
                pairs.append((x[keep], y[keep]))
            row["n_tokens"] = int(sum(x.size for x, _ in pairs))
            flat_x, flat_y = np.concatenate([x for x, _ in pairs]), np.concatenate([y for _, y in pairs])
            rx, ry = rankdata(flat_x), rankdata(flat_y)
            ranked, at = [], 0
            for x, _ in pairs:
                ranked.append((rx[at : at + x.size], ry[at : at + x.size]))
                at += x.size
            p, sp = _bootstrap(pairs, counts), _bootstrap(ranked, counts)
            # the same ranks less each position's mean rank: what is left once the trend both share
            # with the position in the row (early tokens have less context) is taken out
            pos = np.concatenate([np.arange(x.size) for x, _ in pairs])
            per_pos = np.maximum(np.bincount(pos), 1)
            dx = rx - (np.bincount(pos, rx) / per_pos)[pos]
            dy = ry - (np.bincount(pos, ry) / per_pos)[pos]
            within, at = [], 0
            for x, _ in pairs:
                within.append((dx[at : at + x.size], dy[at : at + x.size]))
                at += x.size
            wp = _bootstrap(within, counts)
            row[target] = {
                "pearson": p["r"],
                "pearson_ci": p["r_ci"],
                "r2": p["r2"],
                "r2_ci": p["r2_ci"],
                "spearman": sp["r"],
                "spearman_ci": sp["r_ci"],
                "spearman_within_position": wp["r"],
                "spearman_within_position_ci": wp["r_ci"],
            }
        out.append(row)
    return {"resamples": resamples, "seed": seed, "interval": list(INTERVAL), "rows": out}
