"""workflows/report/stats.py: against published values (R's `sleep` data, statsmodels 0.15's
`multipletests` and `TTestPower`, whose numbers are written here because statsmodels is not a
dependency), and the rule as a property: simulated experiments whose two arms are equal in
distribution, with the structure of ours (seed noise larger than item noise, overlapping items from
few documents), are called different at the nominal 5 %; the pooled McNemar test the rule replaced
is not; and a real difference is found with the power the rule claims."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats as sps

from entroweight.workflows.report import stats as S

SLEEP_1 = [0.7, -1.6, -0.2, -1.2, -0.1, 3.4, 3.7, 0.8, 0.0, 2.0]
SLEEP_2 = [1.9, 0.8, 1.1, 0.1, -0.1, 4.4, 5.5, 1.6, 4.6, 3.4]


def test_paired_t_is_r_sleep():
    # R: t.test(extra ~ group, data = sleep, paired = TRUE): t = -4.0621, df = 9, p-value = 0.002833
    r = S.paired_t(SLEEP_1, SLEEP_2)
    assert r["t"] == pytest.approx(-4.062127683382037, rel=1e-9)
    assert r["p"] == pytest.approx(0.002832890197384273, rel=1e-9)
    assert (r["df"], r["n"]) == (9, 10)
    assert r["delta"] == pytest.approx(-1.58)
    assert r["sd"] == pytest.approx(np.std(np.subtract(SLEEP_1, SLEEP_2), ddof=1))


def test_paired_t_edges():
    assert S.paired_t([1.0, 2.0], [0.5, 1.5])["p"] == 0.0  # every difference the same, not 0
    assert S.paired_t([1.0, 2.0], [1.0, 2.0])["p"] == 1.0
    with pytest.raises(ValueError, match="at least 2 pairs"):
        S.paired_t([1.0], [2.0])


@pytest.mark.parametrize(
    ("p", "adjusted"),
    [
        ([0.01, 0.04, 0.03, 0.005], [0.03, 0.06, 0.06, 0.02]),  # by hand and statsmodels
        ([0.2, 0.001, 0.049, 0.013, 0.5, 0.02], [0.4, 0.006, 0.147, 0.065, 0.5, 0.08]),  # statsmodels
        ([0.9], [0.9]),
        ([], []),
    ],
)
def test_holm_is_statsmodels_multipletests(p, adjusted):
    assert S.holm(p) == pytest.approx(adjusted, rel=1e-12)


@pytest.mark.parametrize(
    ("n", "alpha", "effect"),
    [  # statsmodels TTestPower().solve_power(nobs=n, alpha=alpha, power=0.8, alternative="two-sided")
        (2, 0.05, 11.549889754978167),
        (5, 0.05, 1.6819970833232674),
        (6, 0.05, 1.4345451395119289),
        (10, 0.05, 0.9960019107624178),
        (20, 0.05, 0.6604416544380312),
        (6, 0.0125, 2.005332017705408),
    ],
)
def test_mde_paired_t_is_statsmodels_ttestpower(n, alpha, effect):
    assert S.mde_paired_t(1.0, n, alpha) == pytest.approx(effect, rel=1e-5)  # statsmodels' own tolerance
    assert S.mde_paired_t(0.02, n, alpha) == pytest.approx(0.02 * effect, rel=1e-5)


def test_mde_paired_t_edges():
    assert S.mde_paired_t(1.0, 1) is None
    assert S.mde_paired_t(0.0, 4) == 0.0


# -- the comparison
def test_one_number_per_seed_is_the_paired_t_test():
    ref = dict(enumerate(SLEEP_2))
    run = dict(enumerate(SLEEP_1))
    c = S.compare(ref, run)
    r = S.paired_t(SLEEP_1, SLEEP_2)
    assert c["p"] == pytest.approx(r["p"], rel=1e-9) and c["delta"] == pytest.approx(r["delta"])
    assert c["sd"] == pytest.approx(r["sd"]) and c["df"] == 9 and c["clusters"] == 1
    half = sps.t.ppf(0.975, 9) * r["sd"] / np.sqrt(10)
    assert c["ci"] == pytest.approx([r["delta"] - half, r["delta"] + half])


def test_clusters_that_differ_widen_the_interval_and_never_narrow_it():
    rng = np.random.default_rng(1)
    seeds, docs = 6, 40
    base = rng.normal(0, 1, (seeds, docs))
    flat = {s: base[s] for s in range(seeds)}
    ref = {s: np.zeros(docs) for s in range(seeds)}
    # the same per-seed totals, but the run's difference lives on a few documents: documents matter
    lumpy = {s: base[s] + np.where(np.arange(docs) < 4, 5.0, -0.5) for s in range(seeds)}
    a, b = S.compare(ref, flat), S.compare(ref, lumpy)
    seed_only = S.compare({s: 0.0 for s in ref}, {s: float(lumpy[s].sum() / docs) for s in ref})
    assert a["se"] >= np.sqrt(a["var_seed"]) - 1e-15
    assert b["var_cluster"] > 0 and b["se"] > seed_only["se"]
    assert b["delta"] == pytest.approx(seed_only["delta"])


def test_a_ratio_is_weighted_by_its_cluster_sizes():
    sizes = np.array([1.0, 3.0])
    c = S.compare({0: [0, 0], 1: [0, 0]}, {0: [1.0, 3.0], 1: [2.0, 2.0]}, sizes)
    assert c["per_seed"] == pytest.approx([1.0, 1.0]) and c["delta"] == pytest.approx(1.0)


def test_compare_refuses_mismatched_items():
    with pytest.raises(ValueError, match="same items"):
        S.compare_items({0: [1, 0]}, {0: [1, 0, 1]})
    with pytest.raises(ValueError, match="same clusters"):
        S.compare({0: [1, 2], 1: [1, 2, 3]}, {0: [1, 2], 1: [1, 2, 3]})


@pytest.mark.parametrize("n", [1, 3, 6, 10])
def test_sign_flip_reaches_2_over_2_to_the_n_at_most(n):
    assert S.sign_flip([1.0] * n) == pytest.approx(2 / 2**n)
    assert S.sign_flip([0.0] * n) == 1.0
    # one difference against the rest: its sign pattern and the mirror, and those more extreme
    d = [3.0] + [1.0] * (n - 1)
    assert 2 / 2**n <= S.sign_flip(d) <= 1.0


def test_seeds_for_a_stated_precision():
    n = S.seeds_for(0.02, 0.01)
    assert (
        sps.t.ppf(0.975, n - 1) * 0.02 / np.sqrt(n) <= 0.01 < sps.t.ppf(0.975, n - 2) * 0.02 / np.sqrt(n - 1)
    )


def test_decide_primary_unadjusted_others_holm_with_their_mde():
    ref = {s: 1.0 + 0.01 * (-1) ** s for s in range(6)}
    runs = {
        "primary": {s: v + 0.003 * (s % 3 - 1) + 0.001 for s, v in ref.items()},  # within noise
        "better": {s: v - 0.05 + 0.001 * s for s, v in ref.items()},
        "noisy": {s: v + 0.01 * (s % 2) - 0.005 for s, v in ref.items()},
        "one-seed": {0: 0.5},
    }
    comps = [{"run": name} | S.compare(ref, seeds) for name, seeds in runs.items()]
    S.decide(comps, "primary", lower_is_better=True)
    by = {c["run"]: c for c in comps}
    p = by["primary"]
    assert p["primary"] and p["p_adjusted"] == p["p"] and p["alpha"] == S.ALPHA
    assert p["outcome"] == "within noise" and p["ci"][0] < 0 < p["ci"][1]
    assert p["mde"] == pytest.approx(S.mde_paired_t(p["sd"], 6, S.ALPHA))
    family = [by["better"], by["noisy"]]  # one-seed has no p: outside the family
    assert [c["p_adjusted"] for c in family] == pytest.approx(S.holm([c["p"] for c in family]))
    assert all(c["alpha"] == S.ALPHA / 2 and not c["primary"] for c in family)
    assert by["better"]["outcome"] == "better" and by["better"]["mde"] is None
    assert by["better"]["ci"][1] < 0
    assert by["noisy"]["outcome"] == "within noise"
    assert by["noisy"]["mde"] == pytest.approx(S.mde_paired_t(by["noisy"]["sd"], 6, S.ALPHA / 2))
    assert by["one-seed"]["outcome"] == "undecided" and by["one-seed"]["p"] is None


# -- the rule as a property: simulated experiments of our shape
SEEDS, DOCS, ITEMS_PER_DOC = 6, 100, 21  # experiment.yaml: 6 seeds, ~2,100 items of 100 documents
EXPERIMENTS = 400


def _simulate(shift: float, rng: np.random.Generator):
    """One experiment's 0/1 answers: (reference, run) as {seed: items}, and each item's document.
    Items share their document's difficulty (overlapping cuts); each trained model has its own skill
    (seed noise on the logit) and its own item-by-item luck; the run's logit is `shift` higher."""
    doc = np.repeat(np.arange(DOCS), ITEMS_PER_DOC)
    difficulty = -0.55 + rng.normal(0, 0.6, DOCS)[doc] + rng.normal(0, 0.6, len(doc))

    def arm(offset):
        skill = rng.normal(0, 0.08, (SEEDS, 1))
        luck = rng.normal(0, 1.0, (SEEDS, len(doc)))
        p = 1 / (1 + np.exp(-(difficulty + offset + skill + luck)))
        return dict(enumerate((rng.random(p.shape) < p).astype(np.int8)))

    return arm(0.0), arm(shift), doc


def _pooled_mcnemar_p(ref: dict, run: dict) -> float:
    """The rule this one replaced: McNemar's χ² (continuity corrected) over every (seed, item) pair."""
    b = sum(int(np.sum((ref[s] == 1) & (run[s] == 0))) for s in ref)
    c = sum(int(np.sum((ref[s] == 0) & (run[s] == 1))) for s in ref)
    return float(sps.chi2.sf((abs(b - c) - 1) ** 2 / (b + c), 1))


def _rates(shift: float, seed: int):
    rng = np.random.default_rng(seed)
    called, pooled, deltas, sds, covered = 0, 0, [], [], 0
    for _ in range(EXPERIMENTS):
        ref, run, doc = _simulate(shift, rng)
        c = S.compare_items(ref, run, doc)
        called += c["p"] < S.ALPHA
        pooled += _pooled_mcnemar_p(ref, run) < S.ALPHA
        deltas.append(c["delta"])
        sds.append(c["sd"])
        covered += c["ci"][0] <= 0 <= c["ci"][1]
    return called / EXPERIMENTS, pooled / EXPERIMENTS, np.array(deltas), np.array(sds), covered / EXPERIMENTS


def test_equal_arms_are_called_different_at_the_nominal_rate_and_pooled_mcnemar_is_not():
    rate, pooled, deltas, sds, covered = _rates(0.0, seed=7)
    slack = 2.5 * np.sqrt(S.ALPHA * (1 - S.ALPHA) / EXPERIMENTS)  # the simulation's own error
    # the structure of ours: per-seed noise (sd of an arm's accuracy over seeds) above item noise
    assert np.sqrt(np.mean(sds**2) / 2) > np.sqrt(0.37 * 0.63 / (DOCS * ITEMS_PER_DOC))
    assert rate <= S.ALPHA + slack, f"the rule calls equal arms different {rate:.1%} of the time"
    assert covered >= 1 - S.ALPHA - slack
    assert pooled > 3 * S.ALPHA, f"pooled McNemar kept its size ({pooled:.1%}): the simulation is too kind"


def test_a_difference_of_the_claimed_smallest_detectable_size_is_found_as_often_as_claimed():
    _, _, _, sds, _ = _rates(0.0, seed=11)
    mde = S.mde_paired_t(float(np.sqrt(np.mean(sds**2))), SEEDS)
    shift = mde / (
        0.37 * 0.63 * 0.78
    )  # logit shift giving about that much accuracy (the logistic's slope, thinned by the noise)
    rate, _, deltas, _, _ = _rates(shift, seed=13)
    assert deltas.mean() == pytest.approx(mde, rel=0.2)
    assert rate == pytest.approx(S.POWER, abs=0.1), f"power {rate:.0%} at the claimed detectable {mde:.4f}"
