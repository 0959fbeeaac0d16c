"""workflows/stats.py against published values: textbook examples (R's `sleep` data, Hollander &
Wolfe's signed-rank example, Agresti's McNemar table) and statsmodels 0.15 (`multipletests`,
`mcnemar`, `TTestPower`), whose numbers are written here because statsmodels is not a dependency;
the McNemar power by brute-force enumeration of the test as implemented."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from scipy import stats as sps

from entroweight.workflows import stats as S

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


def test_wilcoxon_is_hollander_wolfe():
    # Hollander & Wolfe (1973, p. 29), R's wilcox.test(x, y, paired = TRUE): V = 40, two-sided
    # p = 0.03906 (scipy reports the smaller rank sum, 45 - 40 = 5)
    x = [1.83, 0.50, 1.62, 2.48, 1.68, 1.88, 1.55, 3.06, 1.30]
    y = [0.878, 0.647, 0.598, 2.05, 1.06, 1.29, 1.06, 3.14, 1.29]
    r = S.wilcoxon(x, y)
    assert r["p"] == pytest.approx(0.0390625, rel=1e-12) and r["statistic"] == 5.0


def test_wilcoxon_needs_six_pairs_to_reach_005():
    """Below 6 pairs the exact two-sided p of the most extreme ranking is 2/2^n >= 0.0625: no test."""
    assert S.MIN_WILCOXON_SEEDS == 6
    assert S.wilcoxon([1, 2, 3, 4, 5], [0, 0, 0, 0, 0]) is None
    assert S.wilcoxon([1, 2, 3, 4, 5, 6], [0] * 6)["p"] == pytest.approx(2 / 2**6)
    assert 2 / 2**5 > S.ALPHA > 2 / 2**6
    assert S.wilcoxon([1.0] * 6, [1.0] * 6)["p"] == 1.0


@pytest.mark.parametrize(
    ("b", "c", "statistic", "p", "method"),
    [
        # Agresti (2007), presidential approval, 794/150/86/570; statsmodels mcnemar(exact=False)
        (150, 86, 16.81779661016949, 4.114562281345944e-05, "chi-square, continuity corrected"),
        # statsmodels mcnemar(exact=True): binomial, statistic min(b, c)
        (2, 8, 2.0, 0.109375, "exact binomial"),
        (21, 3, 3.0, 0.0002771615982055664, "exact binomial"),
        (0, 0, 0.0, 1.0, "no discordant pair"),
    ],
)
def test_mcnemar_is_statsmodels(b, c, statistic, p, method):
    r = S.mcnemar(b, c)
    assert r["statistic"] == pytest.approx(statistic, rel=1e-12)
    assert r["p"] == pytest.approx(p, rel=1e-9)
    assert r["method"] == method


def test_mcnemar_switches_to_chi_square_at_25_discordant_pairs():
    assert S.mcnemar(5, 19)["method"] == "exact binomial"
    assert S.mcnemar(5, 20)["method"] == "chi-square, continuity corrected"


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


@functools.cache
def _rejects(n: int, alpha: float = 0.05) -> list[np.ndarray]:
    """Per number of discordant pairs d <= n, the counts c (run right) S.mcnemar(d - c, c) rejects."""
    return [
        np.array([k for k in range(d + 1) if S.mcnemar(d - k, k)["p"] < alpha], int) for d in range(n + 1)
    ]


def _enumerated_power(n: int, psi: float, delta: float) -> float:
    """P(mcnemar rejects) over every (D discordant, c run-right) outcome, through S.mcnemar itself."""
    q = (1 + delta / psi) / 2
    return sum(sps.binom.pmf(d, n, psi) * sps.binom.pmf(c, d, q).sum() for d, c in enumerate(_rejects(n)))


@pytest.mark.parametrize(("n", "psi"), [(60, 0.2), (60, 0.5), (40, 0.6)])
def test_mde_mcnemar_has_the_power_it_claims(n, psi):
    delta = S.mde_mcnemar(n, psi)
    assert 0 < delta <= psi
    assert _enumerated_power(n, psi, delta) == pytest.approx(S.POWER, abs=1e-6)
    assert S.power_mcnemar(n, psi, delta) == pytest.approx(_enumerated_power(n, psi, delta), abs=1e-9)
    assert _enumerated_power(n, psi, 0.0) <= S.ALPHA  # the test keeps its size


def test_mde_mcnemar_nears_connors_formula_for_many_items():
    """Connor (1987): n δ² = (z_{1-α/2} √ψ + z_{0.8} √(ψ - δ²))² — the normal approximation the
    exact power tends to as the discordant pairs grow."""
    n, psi = 20_000, 0.25
    za, zb = sps.norm.ppf(0.975), sps.norm.ppf(0.8)
    delta = S.mde_mcnemar(n, psi)
    assert n * delta**2 == pytest.approx((za * np.sqrt(psi) + zb * np.sqrt(psi - delta**2)) ** 2, rel=0.02)


def test_mde_mcnemar_out_of_reach():
    assert S.mde_mcnemar(10, 0.1) is None  # one discordant pair expected: nothing reaches 80 %
    assert S.mde_mcnemar(100, 0.0) is None


def test_compare_accuracy_pools_items_over_seeds():
    ref = {0: [1, 1, 0, 0, 1, 0], 1: [1, 0, 1, 0, 1, 1], 2: [0, 0, 0, 0, 0, 0]}
    run = {0: [1, 0, 1, 1, 1, 0], 1: [True, True, True, False, False, True]}  # seed 2: not run yet
    r = S.compare_accuracy(ref, run)
    # seed 0: b (ref right, run wrong) = 1, c = 2; seed 1: b = 1, c = 1
    assert (r["mcnemar"]["b"], r["mcnemar"]["c"]) == (2, 3)
    assert r["p"] == S.mcnemar(2, 3)["p"] and r["mcnemar"]["method"] == "exact binomial"
    assert (r["seeds"], r["n_pairs"], r["n_items"]) == ([0, 1], 12, 6)
    assert r["delta"] == pytest.approx((3 - 2) / 12)
    assert r["acc_ref"] == {0: 0.5, 1: 4 / 6} and r["acc_run"] == {0: 4 / 6, 1: 4 / 6}
    assert r["delta"] == pytest.approx(
        np.mean(list(r["acc_run"].values())) - np.mean(list(r["acc_ref"].values()))
    )
    seeds = r["seeds_test"]
    assert seeds["p"] == pytest.approx(S.paired_t([4 / 6, 4 / 6], [0.5, 4 / 6])["p"])
    assert seeds["wilcoxon"] is None  # 2 seeds


def test_compare_accuracy_large_and_many_seeds():
    rng = np.random.default_rng(0)
    ref = {s: rng.random(500) < 0.40 for s in range(6)}
    run = {s: np.where(rng.random(500) < 0.2, ~ref[s], ref[s]) | (rng.random(500) < 0.05) for s in range(6)}
    r = S.compare_accuracy(ref, run)
    b = sum(int(np.sum(ref[s] & ~run[s])) for s in range(6))
    c = sum(int(np.sum(~ref[s] & run[s])) for s in range(6))
    assert (r["mcnemar"]["b"], r["mcnemar"]["c"]) == (b, c)
    assert r["mcnemar"]["method"] == "chi-square, continuity corrected"
    assert r["mcnemar"]["statistic"] == pytest.approx((abs(b - c) - 1) ** 2 / (b + c))
    assert r["seeds_test"]["wilcoxon"] is not None  # 6 seeds


def test_compare_accuracy_refuses_mismatched_items():
    with pytest.raises(ValueError, match="seed 0: the reference answered 3 items and the run 2"):
        S.compare_accuracy({0: [1, 0, 1]}, {0: [1, 0]})
    with pytest.raises(ValueError, match="0/1"):
        S.compare_accuracy({0: [1, 0, 2]}, {0: [1, 0, 1]})


def test_decide_primary_unadjusted_others_holm_with_their_mde():
    ref = {s: 1.0 + 0.01 * (-1) ** s for s in range(6)}
    runs = {
        "primary": {s: v + 0.003 * (s % 3 - 1) + 0.001 for s, v in ref.items()},  # within noise
        "better": {s: v - 0.05 + 0.001 * s for s, v in ref.items()},
        "noisy": {s: v + 0.01 * (s % 2) - 0.005 for s, v in ref.items()},
        "one-seed": {0: 0.5},
    }
    comps = [{"run": name} | S.compare_seeds(ref, seeds) for name, seeds in runs.items()]
    S.decide(comps, "primary", lower_is_better=True)
    by = {c["run"]: c for c in comps}
    p = by["primary"]
    assert p["primary"] and p["p_adjusted"] == p["p"] and p["alpha"] == S.ALPHA
    assert p["outcome"] == "within noise"
    assert p["mde"] == pytest.approx(S.mde_paired_t(p["sd"], 6, S.ALPHA))
    family = [by["better"], by["noisy"]]  # one-seed has no p: outside the family
    assert [c["p_adjusted"] for c in family] == pytest.approx(S.holm([c["p"] for c in family]))
    assert all(c["alpha"] == S.ALPHA / 2 and not c["primary"] for c in family)
    assert by["better"]["outcome"] == "better" and by["better"]["mde"] is None
    assert by["noisy"]["outcome"] == "within noise"
    assert by["noisy"]["mde"] == pytest.approx(S.mde_paired_t(by["noisy"]["sd"], 6, S.ALPHA / 2))
    assert by["one-seed"]["outcome"] == "undecided" and by["one-seed"]["p"] is None
    assert by["primary"]["wilcoxon"] is not None


def test_decide_accuracy_direction_and_mde():
    ref = {0: [1, 0] * 200, 1: [0, 1] * 200}
    better = {s: [1] * 400 for s in ref}
    worse = {s: [0] * 400 for s in ref}
    same = {s: v[::-1] for s, v in ref.items()}  # every answer swapped: discordant, balanced
    comps = [
        {"run": n} | S.compare_accuracy(ref, r)
        for n, r in (("better", better), ("worse", worse), ("same", same))
    ]
    S.decide(comps, None, lower_is_better=False)
    assert [c["outcome"] for c in comps] == ["better", "worse", "within noise"]
    assert all(not c["primary"] and c["alpha"] == S.ALPHA / 3 for c in comps)
    assert comps[2]["mde"] == pytest.approx(S.mde_mcnemar(800, 1.0, S.ALPHA / 3))
