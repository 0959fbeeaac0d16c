"""The tests that compare a run with the reference: paired, because the runs share everything but
their weights (per seed: the same init, the same rows in the same order; docs/experiments.md).

Pure functions of numbers (numpy and scipy only); the report (report_data.py) and the accuracy
table call them. The rule they implement, as the report states it (`RULE`):

- **One primary comparison, named in advance** (`report.primary` in the workflow, by default
  `weighted-occlusion` against the reference). Its test is read at ALPHA = 0.05 unadjusted; every
  other run's test in the same table (one measure on one text) is Holm-corrected over those runs.
- **BPB** (or any one number per seed): the paired t-test over the seeds both runs have,
  `d_s = run_s − ref_s` (`compare_seeds`). It decides. With at least 6 seeds the Wilcoxon
  signed-rank test of the same differences is reported beside it (below 6 its exact two-sided p
  cannot fall under 0.05: 2/2⁵ = 0.0625), as a check that does not assume normal differences.
- **Accuracy** (`compare_accuracy`): McNemar's test on the items, pooled over seeds: every (seed,
  item) pair of the reference's and the run's 0/1 answers, `b` = reference right and run wrong,
  `c` = reference wrong and run right. Exact binomial (two-sided, b ~ Bin(b + c, ½)) while
  b + c < 25, else χ² with continuity correction, (|b − c| − 1)² / (b + c). It decides. The paired
  t-test (and Wilcoxon, ≥ 6 seeds) over the per-seed accuracies is reported beside it: pooling
  items treats the seeds as replicates, the per-seed test sees the training noise.
- **Within noise** carries the smallest difference the comparison could have detected (`mde`):
  80 % power (POWER), two-sided, at the alpha the comparison faces — 0.05 for the primary, 0.05/m
  for one of m Holm-corrected comparisons (the threshold a lone real effect must pass) — at the
  comparison's own n and noise: the paired t-test's noncentral t with the observed standard
  deviation of the differences; for McNemar, the test's exact power at the observed share of
  discordant pairs.

Input format of `compare_accuracy`: two mappings seed -> sequence of 0/1 (or bool) per item, one
for the reference and one for the run, each vector in the same item order (item i of the run's
seed s is item i of the reference's seed s) and of the same length within a seed. Only the seeds
both hold are paired; a seed whose vectors differ in length is refused (ValueError). Example::

    compare_accuracy({0: [1, 0, 1, 1], 1: [1, 1, 0, 1]}, {0: [1, 1, 1, 0], 1: [1, 1, 1, 1]})

Then `decide(comparisons, primary, lower_is_better=False)` applies the rule to the list of one
table's comparisons (each carries `run`; `primary` is `Workflow.primary_run()`): Holm, alpha in
effect, MDE, outcome; `report_data.verdict(c, "accuracy")` words each one (tests/test_report.py's
test_accuracy_verdict_from_item_vectors walks that path).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np

ALPHA = 0.05
POWER = 0.80
MIN_WILCOXON_SEEDS = 6  # the fewest pairs whose exact two-sided signed-rank p can be < 0.05
EXACT_BELOW = 25  # McNemar: exact binomial while b + c is below this, else χ² with continuity correction

RULE = (
    f"A run differs from the reference when its test's p < {ALPHA:g}: the paired t-test over seeds "
    "for BPB (each seed's run against the same seed's reference), McNemar's test over items pooled "
    f"over seeds for accuracy. The primary comparison is read unadjusted; every other run's p is "
    f"Holm-corrected over the other runs of the same table. Within noise: the smallest difference "
    f"the comparison could have detected ({POWER:.0%} power, two-sided, at the alpha it faces: "
    f"{ALPHA:g} for the primary, {ALPHA:g}/m for one of m corrected comparisons). With at least "
    f"{MIN_WILCOXON_SEEDS} seeds the Wilcoxon signed-rank p is shown beside the paired t-test's."
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


def wilcoxon(run: Sequence[float], ref: Sequence[float]) -> dict | None:
    """Wilcoxon signed-rank test of run − ref (two-sided; zero differences dropped, scipy's
    default; exact null distribution for small n without ties); None below MIN_WILCOXON_SEEDS pairs."""
    from scipy import stats

    d = np.asarray(run, np.float64) - np.asarray(ref, np.float64)
    if len(d) < MIN_WILCOXON_SEEDS:
        return None
    if not np.any(d):
        return {"n": len(d), "statistic": 0.0, "p": 1.0}
    r = stats.wilcoxon(d)
    return {"n": len(d), "statistic": float(r.statistic), "p": float(r.pvalue)}


def mcnemar(b: int, c: int) -> dict:
    """McNemar's test from the discordant counts: b (reference right, run wrong) and c (reference
    wrong, run right). Exact binomial while b + c < EXACT_BELOW, else χ² (1 df) with continuity
    correction. No discordant pair: p = 1."""
    from scipy import stats

    n = b + c
    if n == 0:
        return {"b": b, "c": c, "statistic": 0.0, "p": 1.0, "method": "no discordant pair"}
    if n < EXACT_BELOW:
        p = float(stats.binomtest(min(b, c), n, 0.5).pvalue)
        return {"b": b, "c": c, "statistic": float(min(b, c)), "p": min(p, 1.0), "method": "exact binomial"}
    chi2 = (abs(b - c) - 1) ** 2 / n
    return {
        "b": b,
        "c": c,
        "statistic": chi2,
        "p": float(stats.chi2.sf(chi2, 1)),
        "method": "chi-square, continuity corrected",
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


def power_mcnemar(n_pairs: int, discordant: float, delta: float, alpha: float = ALPHA) -> float:
    """The exact power of `mcnemar` (as implemented: exact binomial below EXACT_BELOW discordant
    pairs, χ² with continuity correction from there) on `n_pairs` pairs when a share `discordant`
    (ψ) of them disagree and the run's accuracy exceeds the reference's by `delta` (0 ≤ δ ≤ ψ):
    the number of discordant pairs D ~ Bin(n, ψ), and given D, the run-right ones c ~ Bin(D, (1 + δ/ψ)/2)."""
    from scipy import stats

    psi = discordant
    lo_d, hi_d = stats.binom.ppf([1e-12, 1 - 1e-12], n_pairs, psi)
    d = np.arange(max(int(lo_d) - 1, 1), min(int(hi_d) + 1, n_pairs) + 1)
    crit = stats.chi2.isf(alpha, 1)
    # the largest c the test rejects on the low side (run worse), per D; -1: none
    lo = np.ceil((d - 1 - np.sqrt(crit * d)) / 2) - 1
    for i in np.flatnonzero(d < EXACT_BELOW):
        k = np.arange(d[i] + 1)
        rejected = np.flatnonzero(2 * stats.binom.cdf(k, d[i], 0.5) < alpha)
        lo[i] = rejected[-1] if len(rejected) else -1
    hi = d - lo  # the region is symmetric: c ≥ D − lo on the high side
    q = (1 + delta / psi) / 2
    given_d = stats.binom.cdf(lo, d, q) + stats.binom.sf(hi - 1, d, q)
    return float(np.sum(stats.binom.pmf(d, n_pairs, psi) * given_d))


def mde_mcnemar(n_pairs: int, discordant: float, alpha: float = ALPHA, power: float = POWER) -> float | None:
    """The smallest |accuracy difference| that `mcnemar` on `n_pairs` pairs detects with probability
    `power` at `alpha` when a share `discordant` of the pairs disagree (the exact power,
    `power_mcnemar`). None when even δ = ψ (every discordant pair in the run's favour) falls short
    of the power, or nothing disagrees."""
    from scipy import optimize

    psi = discordant
    if n_pairs < 1 or psi <= 0:
        return None
    if power_mcnemar(n_pairs, psi, psi, alpha) < power:
        return None
    return float(
        optimize.brentq(lambda x: power_mcnemar(n_pairs, psi, x, alpha) - power, 0.0, psi, xtol=1e-9)
    )


def mde(comparison: dict, alpha: float) -> float | None:
    """The comparison's smallest detectable difference at `alpha`, by the test that decides it."""
    if comparison["test"] == "mcnemar":
        m = comparison["mcnemar"]
        n = comparison["n_pairs"]
        return mde_mcnemar(n, (m["b"] + m["c"]) / n if n else 0.0, alpha)
    return mde_paired_t(comparison["sd"], comparison["n"], alpha)


# -- one comparison
def _shared(ref: Mapping, run: Mapping) -> list:
    return [s for s in ref if s in run]


def compare_seeds(ref_by_seed: Mapping[int, float], run_by_seed: Mapping[int, float]) -> dict:
    """One number per seed (BPB, an accuracy) of the run against the reference's same seed: the
    paired t-test (it decides: `p`) and Wilcoxon beside it. `n` < 2: undecidable, `p` None."""
    seeds = _shared(ref_by_seed, run_by_seed)
    a = [run_by_seed[s] for s in seeds]
    b = [ref_by_seed[s] for s in seeds]
    out = {
        "test": "paired_t",
        "seeds": seeds,
        "n": len(seeds),
        "delta": None,
        "sd": None,
        "t": None,
        "p": None,
    }
    out["wilcoxon"] = None
    if not seeds:
        return out
    out["delta"] = float(np.mean(np.subtract(a, b)))
    if len(seeds) < 2:
        return out
    out |= {k: v for k, v in paired_t(a, b).items() if k in ("sd", "t", "df", "p")}
    out["wilcoxon"] = wilcoxon(a, b)
    return out


def compare_accuracy(
    ref_items_by_seed: Mapping[int, Sequence[int]], run_items_by_seed: Mapping[int, Sequence[int]]
) -> dict:
    """Accuracy of the run against the reference, item by item (the module docstring gives the
    input format): McNemar pooled over the shared seeds decides (`p`); the per-seed accuracies'
    paired t-test (`seeds_test`, with Wilcoxon from 6 seeds) is beside it. `delta` = the run's
    accuracy minus the reference's over all pooled pairs; `acc_ref`/`acc_run` per seed."""
    seeds = _shared(ref_items_by_seed, run_items_by_seed)
    b = c = n_pairs = 0
    acc_ref, acc_run = {}, {}
    for s in seeds:
        x = _zero_one(ref_items_by_seed[s], f"reference seed {s}")
        y = _zero_one(run_items_by_seed[s], f"run seed {s}")
        if len(x) != len(y):
            raise ValueError(
                f"seed {s}: the reference answered {len(x)} items and the run {len(y)}: "
                "accuracy vectors must list the same items in the same order"
            )
        b += int(np.sum(x & ~y))
        c += int(np.sum(~x & y))
        n_pairs += len(x)
        acc_ref[s], acc_run[s] = float(x.mean()) if len(x) else None, float(y.mean()) if len(y) else None
    test = mcnemar(b, c)
    return {
        "test": "mcnemar",
        "seeds": seeds,
        "n": len(seeds),
        "n_pairs": n_pairs,
        "n_items": n_pairs // len(seeds) if seeds else 0,
        "acc_ref": acc_ref,
        "acc_run": acc_run,
        "delta": (c - b) / n_pairs if n_pairs else None,
        "mcnemar": test,
        "p": test["p"] if n_pairs else None,
        "seeds_test": compare_seeds(acc_ref, acc_run),
    }


def _zero_one(v: Iterable, what: str) -> np.ndarray:
    a = np.asarray(list(v))
    if a.size and not np.isin(a, (0, 1)).all():
        raise ValueError(f"{what}: accuracy items must be 0/1 (or bool)")
    return a.astype(bool)


# -- the rule over one table
def decide(comparisons: list[dict], primary: str | None, lower_is_better: bool) -> list[dict]:
    """Apply the rule (module docstring) to one table's comparisons, each a dict with `run`, `p`
    (None: undecidable) and `delta` from compare_seeds/compare_accuracy: adds `primary`,
    `p_adjusted` (Holm over the non-primary comparisons that have a p; the primary's own p),
    `alpha` (the alpha its MDE is computed at), `outcome` (better | worse | within noise |
    undecided) and, within noise, `mde`. Returns the same dicts, in order."""
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
