"""How a run is compared with another (the reference, or its own control): the unit of inference is
what varies independently, the training seed and the evaluated document.

Pure functions of numbers (numpy and scipy only); the report (report/data.py) calls them. The rule
they implement, as the report states it (`RULE`; docs/experiments.md#statistics):

- **The data of one comparison**: per seed, per cluster j (a held-out document, or a block of about
  `trainers.bpb.BLOCK_BYTES` of an evaluation text), the run's and the other's totals (bits, items
  right, log-likelihood margins) over the cluster's size `n_j` (bytes, items). The estimate is
  Δ = mean over seeds of Σ_j (run − other)_sj / Σ_j n_j: the difference in BPB, in accuracy, in mean
  margin. A number per seed with no clusters is one cluster of size 1.
- **Its variance** (`two_way`): the two-way cluster-robust variance of Cameron, Gelbach & Miller
  (2011) over seeds × clusters of the linearised estimate, V = V_seed + max(0, V_cluster − V_cell),
  each with its small-sample factor G/(G − 1). V_seed is exactly the paired t-test's s²_d / S over
  the per-seed differences: training noise, which a pooled test of items over seeds never sees
  (pooled McNemar, the earlier rule, called equal arms different in a quarter of simulated
  experiments: tests/test_stats.py). V_cluster adds what the choice of documents adds: a run that
  differs from the other on some documents and not on others. Documents can only add uncertainty,
  so V never falls below V_seed.
- **It decides**: t = Δ / √V on S − 1 degrees of freedom (fewer clusters than seeds: J − 1), two-sided
  p; the 95 % interval Δ ± t₀.₉₇₅ √V. Beside it, the exact sign-flip permutation test of the S
  per-seed differences (no normality assumed; its p cannot fall under 2/2^S, 0.031 at 6 seeds).
- **One primary comparison, named in advance** (`report.primary`), read at ALPHA = 0.05 unadjusted;
  every other comparison of the same table is Holm-corrected over those.
- **Within noise** shows the interval and the smallest difference the comparison could have
  detected (`mde`): 80 % power (POWER), two-sided, at the alpha it faces (0.05/m for one of m
  corrected comparisons), by the noncentral t on S − 1 df with the per-seed standard deviation
  √(S·V) the comparison measured.

`tests/test_stats.py` simulates experiments with two arms equal in distribution (seed noise larger
than item noise, overlapping items from few documents) and checks that this rule calls a difference
at its nominal 5 %, and a second simulation with a real difference checks the power it claims.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np

ALPHA = 0.05
POWER = 0.80
CONFIDENCE = 0.95
EXACT_SIGN_FLIPS = 16  # up to this many seeds the sign-flip test enumerates every sign pattern

RULE = (
    f"A run differs from the one it is compared with when p < {ALPHA:g}, p from t = Δ / √V on the "
    "seeds' degrees of freedom, V the two-way cluster-robust variance over training seeds × held-out "
    "documents (blocks of the evaluation text for BPB): each seed's run against the same seed's "
    f"other run, on the same documents. The {CONFIDENCE:.0%} interval is Δ ± t √V. The primary "
    "comparison is read unadjusted; every other p is Holm-corrected over the other comparisons of the "
    f"same table. Within noise: the smallest difference the comparison could have detected "
    f"({POWER:.0%} power, two-sided, at the alpha it faces) at its per-seed noise. Beside it: the exact "
    "sign-flip test of the per-seed differences."
)


# -- the tests
def paired_t(run: Sequence[float], ref: Sequence[float]) -> dict:
    """Paired t-test of run − ref (equal lengths, ≥ 2 pairs): mean and std (ddof 1) of the
    differences, t, df, two-sided p. Identical differences (std 0): p = 0 if they are not 0, else 1."""
    from scipy import stats

    d = np.asarray(run, np.float64) - np.asarray(ref, np.float64)
    if len(d) < 2:
        raise ValueError(f"a paired t-test needs at least 2 pairs, got {len(d)}")
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        t, p = (math.copysign(math.inf, mean), 0.0) if mean != 0 else (0.0, 1.0)
    else:
        r = stats.ttest_rel(run, ref)
        t, p = float(r.statistic), float(r.pvalue)
    return {"n": len(d), "delta": mean, "sd": sd, "t": t, "df": len(d) - 1, "p": p}


def sign_flip(d: Sequence[float]) -> float:
    """The two-sided p of the sign-flip permutation test of mean(d) = 0: the share of sign patterns
    whose |mean| reaches the observed one (every pattern up to EXACT_SIGN_FLIPS values, else 2**16
    seeded draws). Valid whenever each difference is symmetric about 0 under the null."""
    d = np.asarray(d, np.float64)
    n = len(d)
    if n == 0 or not np.any(d):
        return 1.0
    if n <= EXACT_SIGN_FLIPS:
        signs = 1 - 2 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)
    else:
        signs = np.random.default_rng(0).choice([-1, 1], size=(2**16, n))
    means = np.abs(signs @ d) / n
    return float(np.mean(means >= abs(d.mean()) * (1 - 1e-12)))


def two_way(diff: np.ndarray, sizes: np.ndarray) -> dict:
    """Δ and its two-way cluster-robust variance (module docstring) from `diff[s, j]`, seed s's
    total of run − other over cluster j, and `sizes[j]`, each cluster's denominator."""
    diff = np.asarray(diff, np.float64)
    sizes = np.asarray(sizes, np.float64)
    n_seeds, n_clusters = diff.shape
    total = sizes.sum()
    per_seed = diff.sum(axis=1) / total
    delta = float(per_seed.mean())
    # the estimate linearised per cell: its mean over cells is Δ − Δ = 0, its seed means d_s − Δ
    u = (diff - delta * sizes) * n_clusters / total

    def clustered(sums: np.ndarray, cells: int) -> float:
        g = len(sums)
        return float(np.sum(sums**2)) / cells**2 * g / (g - 1) if g > 1 else 0.0

    cells = n_seeds * n_clusters
    v_seed = clustered(u.sum(axis=1), cells)
    v_cluster = clustered(u.sum(axis=0), cells) if n_clusters > 1 else 0.0
    v_cell = clustered(u.ravel(), cells) if n_clusters > 1 else 0.0
    return {
        "delta": delta,
        "per_seed": per_seed.tolist(),
        "var": v_seed + max(0.0, v_cluster - v_cell),
        "var_seed": v_seed,
        "var_cluster": max(0.0, v_cluster - v_cell),
    }


def holm(pvalues: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the input order: the k-th smallest p times (m − k + 1),
    made non-decreasing along that order, capped at 1."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    out, running = [0.0] * m, 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        out[i] = running
    return out


# -- the smallest detectable difference
def mde_paired_t(sd: float, n: int, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The smallest |mean difference| a two-sided paired t-test on n pairs whose differences have
    standard deviation `sd` detects with probability `power` at `alpha` (noncentral t, df n − 1).
    None below 2 pairs."""
    from scipy import optimize, stats

    if n < 2:
        return None
    if sd == 0.0:
        return 0.0
    df = n - 1
    crit = stats.t.ppf(1 - alpha / 2, df)

    def short(effect: float) -> float:  # power at standardised effect `effect`, less the goal
        nc = effect * math.sqrt(n)
        wrong_side = stats.nct.cdf(-crit, df, nc)  # rejecting on the other side; scipy's NaN where it is ~0
        return stats.nct.sf(crit, df, nc) + (0.0 if math.isnan(wrong_side) else wrong_side) - power

    hi = 1.0
    while short(hi) < 0:
        hi *= 2
    return float(optimize.brentq(short, 0.0, hi, xtol=1e-10)) * sd


def seeds_for(sd: float, half_width: float, confidence: float = CONFIDENCE) -> int | None:
    """The fewest seeds whose interval Δ ± t √(sd²/S) is no wider than ±`half_width` at the per-seed
    standard deviation `sd` (what to run next time for a stated precision)."""
    from scipy import stats

    if sd <= 0 or half_width <= 0:
        return None
    for n in range(2, 10_000):
        if stats.t.ppf(0.5 + confidence / 2, n - 1) * sd / math.sqrt(n) <= half_width:
            return n
    return None


def mde(comparison: dict, alpha: float) -> float | None:
    """The comparison's smallest detectable difference at `alpha`, at its per-seed noise."""
    return mde_paired_t(comparison["sd"], comparison["n"], alpha)


# -- one comparison
def compare(
    ref_by_seed: Mapping[int, float | Sequence[float]],
    run_by_seed: Mapping[int, float | Sequence[float]],
    sizes: Sequence[float] | None = None,
) -> dict:
    """The run against the other (`ref`) over the seeds both have: per seed a number, or the totals
    per cluster (each seed's the same clusters, in the same order) over `sizes` (default 1 each).
    Decided by `two_way` (module docstring): `delta`, its `ci`, `p`, `sign_flip` beside; `n` < 2
    seeds: `p` None (undecidable)."""
    seeds = [s for s in ref_by_seed if s in run_by_seed]
    out = {"test": "two_way_t", "seeds": seeds, "n": len(seeds), "clusters": None, "delta": None}
    out |= {k: None for k in ("per_seed", "sd", "se", "t", "df", "p", "ci", "sign_flip")}
    if not seeds:
        return out
    rows = []
    for s in seeds:
        a = np.atleast_1d(np.asarray(run_by_seed[s], np.float64))
        b = np.atleast_1d(np.asarray(ref_by_seed[s], np.float64))
        if a.shape != b.shape or (rows and a.shape != rows[0].shape):
            raise ValueError(
                f"seed {s}: the runs hold {a.shape[0]} and {b.shape[0]} values where every seed of both "
                "must hold the same clusters (items, documents) in the same order"
            )
        rows.append(a - b)
    diff = np.stack(rows)
    n_seeds, n_clusters = diff.shape
    sizes = np.ones(n_clusters) if sizes is None else np.asarray(sizes, np.float64)
    if sizes.shape != (n_clusters,) or not (sizes > 0).all():
        raise ValueError(f"sizes must be {n_clusters} positive numbers, one per cluster")
    w = two_way(diff, sizes)
    out |= {"clusters": n_clusters, "delta": w["delta"], "per_seed": w["per_seed"]}
    if n_seeds < 2:
        return out
    from scipy import stats

    df = (n_seeds if n_clusters == 1 else min(n_seeds, n_clusters)) - 1
    se = math.sqrt(w["var"])
    if se == 0.0:
        t, p = (math.copysign(math.inf, w["delta"]), 0.0) if w["delta"] else (0.0, 1.0)
    else:
        t = w["delta"] / se
        p = float(2 * stats.t.sf(abs(t), df))
    reach = float(stats.t.ppf(0.5 + CONFIDENCE / 2, df)) * se
    return out | {
        "sd": se * math.sqrt(n_seeds),  # the per-seed noise the interval implies
        "se": se,
        "var_seed": w["var_seed"],
        "var_cluster": w["var_cluster"],
        "t": t,
        "df": df,
        "p": p,
        "ci": [w["delta"] - reach, w["delta"] + reach],
        "sign_flip": sign_flip(w["per_seed"]),
    }


def by_cluster(values: Sequence[float], clusters: Sequence) -> tuple[np.ndarray, np.ndarray]:
    """Per-item values summed per cluster (the item's document), clusters in order of first
    appearance: (totals, sizes). No clusters given: each item its own."""
    v = np.asarray(values, np.float64)
    if clusters is None:
        return v, np.ones(len(v))
    if len(clusters) != len(v):
        raise ValueError(f"{len(v)} items but {len(clusters)} cluster labels")
    keys, index = np.unique(np.asarray(clusters), return_inverse=True)
    totals, sizes = np.zeros(len(keys)), np.zeros(len(keys))
    np.add.at(totals, index, v)
    np.add.at(sizes, index, 1.0)
    return totals, sizes


def compare_items(
    ref_items_by_seed: Mapping[int, Sequence[float]],
    run_items_by_seed: Mapping[int, Sequence[float]],
    clusters: Sequence | None = None,
) -> dict:
    """Per-item values (0/1 answers, log-likelihood margins; each seed's vector the same items in the
    same order) compared seed by seed with the items clustered by `clusters` (each item's document:
    items cut from one document are not independent). Δ is the difference in the mean per item."""
    seeds = [s for s in ref_items_by_seed if s in run_items_by_seed]
    lengths = {len(v) for s in seeds for v in (ref_items_by_seed[s], run_items_by_seed[s])}
    if len(lengths) > 1:
        raise ValueError(
            f"the item vectors hold {sorted(lengths)} items: every seed of both runs must list the same "
            "items in the same order"
        )
    sizes = None
    ref, run = {}, {}
    for s in seeds:
        ref[s], sizes = by_cluster(ref_items_by_seed[s], clusters)
        run[s], _ = by_cluster(run_items_by_seed[s], clusters)
    out = compare(ref, run, sizes)
    return out | {"n_items": lengths.pop() if lengths else 0}


# -- the rule over one table
def decide(comparisons: list[dict], primary: str | None, lower_is_better: bool) -> list[dict]:
    """Apply the rule (module docstring) to one table's comparisons, each a dict with `run`, `p`
    (None: undecidable) and `delta` from `compare`/`compare_items`: adds `primary`, `p_adjusted`
    (Holm over the non-primary comparisons that have a p; the primary's own p), `alpha` (the alpha
    its MDE is computed at), `outcome` (better | worse | within noise | undecided) and, within
    noise, `mde`. Returns the same dicts, in order."""
    family = [c for c in comparisons if c["run"] != primary and c["p"] is not None]
    for c, p in zip(family, holm([c["p"] for c in family]), strict=True):
        c["p_adjusted"] = p
    m = len(family)
    for c in comparisons:
        c["primary"] = c["run"] == primary
        if c["primary"]:
            c["p_adjusted"] = c["p"]
        c.setdefault("p_adjusted", None)
        c["alpha"] = ALPHA if c["primary"] else ALPHA / max(m, 1)
        c["mde"] = None
        if c["p_adjusted"] is None:
            c["outcome"] = "undecided"
        elif c["p_adjusted"] < ALPHA:
            c["outcome"] = "better" if (c["delta"] < 0) == lower_is_better else "worse"
        else:
            c["outcome"] = "within noise"
            c["mde"] = mde(c, c["alpha"])
    return comparisons
