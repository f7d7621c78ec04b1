"""muonlab.stats against closed forms, hand computations and a numerical integral of the t density."""

from __future__ import annotations

import math
import random

import pytest

from muonlab.stats import mean_ci, paired_t_test, regularized_beta, t_cdf, t_quantile, welch_t_test


def _t_cdf_closed(t: float, df: int) -> float:
    """Student's t CDF where it has a closed form (df = 1, 2, 4)."""
    if df == 1:
        return 0.5 + math.atan(t) / math.pi
    if df == 2:
        return 0.5 + t / (2 * math.sqrt(2 + t * t))
    if df == 4:
        u = t * t / 4
        return 0.5 + 0.375 * t / math.sqrt(1 + u) * (1 - u / (3 * (1 + u)))
    raise ValueError(df)


def _t_cdf_integrated(t: float, df: float, n: int = 20_000) -> float:
    """P(T <= t) as 1/2 + the integral of the t density from 0 to t (Simpson's rule)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)

    def density(x):
        return c * (1 + x * x / df) ** (-(df + 1) / 2)

    h = t / n
    total = density(0) + density(t) + sum((4 if k % 2 else 2) * density(k * h) for k in range(1, n))
    return 0.5 + total * h / 3


@pytest.mark.parametrize("df", [1, 2, 4])
@pytest.mark.parametrize("t", [-7.5, -2.0, -0.3, 0.0, 0.8, 2.5, 40.0])
def test_t_cdf_matches_the_closed_forms(t, df):
    assert t_cdf(t, df) == pytest.approx(_t_cdf_closed(t, df), abs=1e-13)


@pytest.mark.parametrize("t, df", [(2.2514363, 5.5207877), (1.3, 2.7), (3.0, 17.0), (0.4, 0.6)])
def test_t_cdf_at_fractional_df_matches_the_integrated_density(t, df):
    assert t_cdf(t, df) == pytest.approx(_t_cdf_integrated(t, df), abs=1e-9)


def test_t_quantile_inverts_the_cdf_and_has_the_known_values():
    assert t_quantile(0.975, 1) == pytest.approx(math.tan(math.pi * 0.475), rel=1e-12)  # 12.7062...
    assert t_quantile(0.975, 2) == pytest.approx(0.95 * math.sqrt(2 / (4 * 0.975 * 0.025)), rel=1e-12)  # 4.3027
    assert t_quantile(0.975, 1e7) == pytest.approx(1.959963984540054, rel=1e-6)  # the normal's
    assert t_quantile(0.025, 3) == -t_quantile(0.975, 3)
    for p, df in ((0.9, 3), (0.995, 2), (0.6, 11.5)):
        assert t_cdf(t_quantile(p, df), df) == pytest.approx(p, abs=1e-12)


def test_regularized_beta_has_its_known_values():
    assert regularized_beta(0.3, 1, 1) == pytest.approx(0.3)  # uniform
    assert regularized_beta(0.3, 2, 1) == pytest.approx(0.09)  # x^a for b = 1
    assert regularized_beta(0.3, 1, 3) == pytest.approx(1 - 0.7 ** 3)  # 1 - (1-x)^b for a = 1
    assert regularized_beta(0.9, 2, 3) == pytest.approx(1 - regularized_beta(0.1, 3, 2))  # symmetry


def test_mean_ci_by_hand():
    # [1, 2, 3]: mean 2, sd 1, se 1/sqrt(3), t_{0.975, 2} = 4.302652729749...
    e = mean_ci([1.0, 2.0, 3.0])
    half = 4.302652729749464 / math.sqrt(3)
    assert (e.mean, e.n) == (2.0, 3)
    assert (e.low, e.high) == (pytest.approx(2 - half, abs=1e-11), pytest.approx(2 + half, abs=1e-11))
    assert mean_ci([1.0, 2.0, 3.0], confidence=0.5).half_width < half  # narrower at lower confidence
    one = mean_ci([4.0])
    assert one.mean == 4.0 and math.isnan(one.low) and math.isnan(one.high)
    assert mean_ci([]).n == 0


def test_welch_by_hand():
    # a: mean 2.5, var 5/3; b: mean 6, var 10. se^2 = 5/12 + 2, t = -3.5 / se,
    # df = se^4 / ((5/12)^2 / 3 + 2^2 / 4)
    r = welch_t_test([1, 2, 3, 4], [2, 4, 6, 8, 10])
    se2 = 5 / 12 + 2
    df = se2 ** 2 / ((5 / 12) ** 2 / 3 + 4 / 4)
    assert r.test == "Welch t" and r.difference == pytest.approx(-3.5)
    assert r.t == pytest.approx(-3.5 / math.sqrt(se2), rel=1e-12)
    assert r.df == pytest.approx(df, rel=1e-12)  # 5.5208
    assert r.p_value == pytest.approx(2 * (1 - _t_cdf_integrated(abs(r.t), df)), abs=1e-9)  # 0.0691
    assert not r.significant() and r.low < 0 < r.high  # the interval covers 0 exactly when p > 0.05


def test_paired_by_hand():
    # d = a - b = [-0.5, -0.1, -0.9]: mean -0.5, sd 0.4, t = -0.5 / (0.4 / sqrt(3)), df = 2,
    # two-sided p = 1 - |t| / sqrt(2 + t^2) (the df = 2 closed form)
    r = paired_t_test([1.0, 2.0, 3.0], [1.5, 2.1, 3.9])
    t = -0.5 / (0.4 / math.sqrt(3))
    assert (r.test, r.df, r.n_a) == ("paired t", 2, 3)
    assert r.t == pytest.approx(t, rel=1e-12)
    assert r.p_value == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t), abs=1e-12)  # 0.1628
    # pairing removes the spread between pairs: the same numbers unpaired are far from significant
    assert welch_t_test([1.0, 2.0, 3.0], [1.5, 2.1, 3.9]).p_value > 0.5
    consistent = paired_t_test([1.0, 2.0, 3.0], [1.30, 2.31, 3.29])
    assert consistent.significant() and consistent.p_value < 0.001


def test_no_spread_and_too_few_values_are_undecided_never_significant():
    """A t-test cannot weigh a difference without a measured noise: every seed giving the same
    difference, one seed, or fewer values than the test needs give "undecided" and say why."""
    cases = {
        "same difference in every pair": paired_t_test([1.5, 2.5, 3.5], [1.0, 2.0, 3.0]),
        # equal differences of unequal numbers differ in their last bits (0.09999999999999998 and
        # 0.10000000000000003): their variance of ~1e-34 gave p < 1e-15
        "same difference but for rounding": paired_t_test([0.3, 0.4, 0.5, 0.7], [0.2, 0.3, 0.4, 0.6]),
        "two seeds, steps to target -2 in both": paired_t_test([7.0, 9.0], [9.0, 11.0]),
        "identical runs": paired_t_test([1.0, 2.0, 3.0], [1.0, 2.0, 3.0]),
        "each side constant (Welch)": welch_t_test([4.0, 4.0, 4.0], [4.25, 4.25]),
        "one pair": paired_t_test([1.0], [2.0]),
        "no pair": paired_t_test([], []),
        "one value on a side (Welch)": welch_t_test([1.0, 2.0], [3.0]),
    }
    for what, r in cases.items():
        assert r.verdict() == "undecided" and not r.decided and not r.significant(0.99), what
        assert r.note and math.isnan(r.p_value) and math.isnan(r.low) and math.isnan(r.t), what
    assert cases["same difference in every pair"].difference == 0.5
    assert cases["same difference in every pair"].note.startswith("no spread")
    assert cases["two seeds, steps to target -2 in both"].difference == -2.0
    assert "at least 2" in cases["one pair"].note and math.isnan(cases["no pair"].difference)
    assert "at least 2 on each side" in cases["one value on a side (Welch)"].note
    assert cases["one value on a side (Welch)"].difference == pytest.approx(-1.5)


def test_a_clear_difference_is_significant_and_an_a_a_comparison_is_not():
    clear = paired_t_test([1.0, 2.0, 3.0], [1.30, 2.31, 3.29])  # b above a by 0.29..0.31 in every pair
    assert clear.decided and clear.verdict() == "significant" and clear.p_value < 0.001
    assert clear.verdict(alpha=1e-4) == "not significant"  # p = 3.7e-4
    gen = random.Random(11)  # A/A: both sides drawn from one normal, paired and unpaired
    a, b = [gen.gauss(4.0, 0.1) for _ in range(5)], [gen.gauss(4.0, 0.1) for _ in range(5)]
    for r in (paired_t_test(a, b), welch_t_test(a, b)):
        assert r.decided and r.verdict() == "not significant" and r.p_value > 0.2, r
    # a constant side next to a varying one is an ordinary Welch test
    assert welch_t_test([4.0, 4.0, 4.0], [4.3, 4.35, 4.4]).verdict() == "significant"


def test_bad_input_is_refused_by_name():
    with pytest.raises(ValueError, match="non-finite"):
        paired_t_test([1.0, float("nan")], [1.0, 2.0])
    with pytest.raises(ValueError, match="as many values"):
        paired_t_test([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="confidence"):
        mean_ci([1.0, 2.0], confidence=95)
    with pytest.raises(ValueError, match="df"):
        t_cdf(1.0, 0)
    with pytest.raises(ValueError, match="p must be"):
        t_quantile(1.0, 3)
    with pytest.raises(ValueError, match="sequence of numbers"):
        mean_ci(["a"])
