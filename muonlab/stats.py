"""Small-sample statistics for comparing runs across seeds, in plain Python (no SciPy here).

Student's t distribution is computed from the regularized incomplete beta function (a continued
fraction, as in Numerical Recipes' ``betacf``), accurate to about 1e-12; its quantile by bisection.
On top of it: a mean with its t confidence interval, the paired t-test (runs paired by seed: the
same initial model and batches, so the seed-to-seed noise cancels in each difference) and
Welch's unequal-variance t-test (unpaired samples).

A permutation test is no help at a few seeds: with 3 seeds the exact paired sign-flip test has
2^3 = 8 arrangements, so its smallest two-sided p-value is 2/8 = 0.25, never significant at 5%
however large and consistent the difference. The t-tests assume roughly normal differences;
at 3 seeds that cannot be checked, so read a p-value near the threshold as "run more seeds".
A test that cannot weigh a difference against the noise (too few values, or none varying) is
undecided, never significant (``TestResult.verdict``).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Estimate", "TestResult", "mean_ci", "paired_t_test", "t_cdf", "t_quantile", "welch_t_test"]

_EPS = 1e-15
_TINY = 1e-300


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    """The continued fraction of I_x(a, b) (modified Lentz), converging for x < (a + 1) / (a + b + 2)."""
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > _TINY else _TINY)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for numerator in (m * (b - m) * x / ((qam + m2) * (a + m2)),
                          -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > _TINY else _TINY)
            c = 1.0 + numerator / c
            c = c if abs(c) > _TINY else _TINY
            h *= d * c
        if abs(d * c - 1.0) < _EPS:
            return h
    raise ArithmeticError(f"incomplete beta did not converge for a={a}, b={b}, x={x}")


def regularized_beta(x: float, a: float, b: float) -> float:
    """I_x(a, b), the regularized incomplete beta function, for 0 <= x <= 1 and a, b > 0."""
    if not 0.0 <= x <= 1.0:
        raise ValueError(f"x must be in [0, 1], got {x}")
    if x in (0.0, 1.0):
        return x
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    front = math.exp(log_front)
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_continued_fraction(a, b, x) / a
    return 1.0 - front * _beta_continued_fraction(b, a, 1.0 - x) / b  # the fraction converges there


def _check_df(df: float) -> None:
    if isinstance(df, bool) or not isinstance(df, (int, float)) or not df > 0 or math.isinf(df):
        raise ValueError(f"df (degrees of freedom) must be a finite number > 0, got {df!r}")


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with ``df`` degrees of freedom (``df`` need not be whole: Welch's isn't)."""
    _check_df(df)
    if math.isnan(t):
        return math.nan
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * regularized_beta(df / (df + t * t), df / 2.0, 0.5)  # P(T > |t|)
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The t with P(T <= t) = ``p``, by bisection on ``t_cdf`` (to about 1e-12 relative)."""
    _check_df(df)
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be strictly between 0 and 1, got {p!r}")
    if p == 0.5:
        return 0.0
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:  # the tail of df=1 (Cauchy) is heavy: widen until it brackets p
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def _check_confidence(confidence: float) -> None:
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be a number strictly between 0 and 1 (e.g. 0.95), got {confidence!r}")


def _finite_values(name: str, values: Sequence[float]) -> list[float]:
    try:
        out = [float(v) for v in values]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a sequence of numbers, got {values!r}") from None
    bad = [v for v in out if not math.isfinite(v)]
    if bad:
        raise ValueError(f"{name} holds non-finite values {bad}: leave diverged runs out before testing")
    return out


def _variance(xs: list[float], mean: float) -> float:
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)


@dataclass(frozen=True)
class Estimate:
    """A mean and its two-sided t confidence interval; ``low``/``high`` are NaN for fewer than 2 values."""

    mean: float
    low: float
    high: float
    n: int
    confidence: float = 0.95

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def mean_ci(values: Sequence[float], confidence: float = 0.95) -> Estimate:
    """The mean of ``values`` and its t interval: mean +- t_{(1+c)/2, n-1} * sd / sqrt(n)."""
    _check_confidence(confidence)
    xs = _finite_values("values", values)
    if not xs:
        return Estimate(math.nan, math.nan, math.nan, 0, confidence)
    mean = sum(xs) / len(xs)
    if len(xs) < 2:
        return Estimate(mean, math.nan, math.nan, 1, confidence)
    half = t_quantile((1 + confidence) / 2, len(xs) - 1) * math.sqrt(_variance(xs, mean) / len(xs))
    return Estimate(mean, mean - half, mean + half, len(xs), confidence)


@dataclass(frozen=True)
class TestResult:
    """A two-sided t-test of mean(a) - mean(b) = 0.

    ``difference``: mean(a) - mean(b) (paired: the mean of the differences), with its confidence
    interval ``low``..``high``; ``t``, ``df`` and the two-sided ``p_value``. Where the test cannot
    weigh the difference against the noise, the interval, ``t`` and ``p_value`` are NaN and the
    result is undecided (``decided`` False, ``note`` says why): fewer values than the test needs,
    or no spread at all (every seed gave the same difference: a t-test would call any nonzero one
    certain, from as few as 2 seeds, though nothing measured the noise it would have to beat).
    """

    test: str
    difference: float
    low: float
    high: float
    t: float
    df: float
    p_value: float
    n_a: int
    n_b: int
    confidence: float = 0.95
    note: str = ""

    @property
    def decided(self) -> bool:
        """Whether the test weighed the difference (False: ``note`` says why it could not)."""
        return not math.isnan(self.p_value)

    def significant(self, alpha: float = 0.05) -> bool:
        return self.decided and self.p_value < alpha

    def verdict(self, alpha: float = 0.05) -> str:
        """"significant" or "not significant" at ``alpha``, or "undecided" (``note`` says why)."""
        if not self.decided:
            return "undecided"
        return "significant" if self.significant(alpha) else "not significant"


def _t_result(test: str, diff: float, se: float, df: float, n_a: int, n_b: int, confidence: float) -> TestResult:
    t = diff / se
    half = t_quantile((1 + confidence) / 2, df) * se
    p = 2.0 * (1.0 - t_cdf(abs(t), df))
    return TestResult(test, diff, diff - half, diff + half, t, df, min(1.0, p), n_a, n_b, confidence)


def _undecided(test: str, diff: float, n_a: int, n_b: int, confidence: float, why: str) -> TestResult:
    nan = math.nan
    return TestResult(test, diff, nan, nan, nan, nan, nan, n_a, n_b, confidence, note=why)


def _no_spread(values: list[float], scale: float) -> bool:
    """All ``values`` equal but for rounding: a few ulps of ``scale``, the largest magnitude they were
    computed from. Equal differences of unequal losses (0.3 - 0.2 against 0.4 - 0.3) differ in their
    last bits, and their exact variance of ~1e-34 would make t huge and p tiny."""
    return max(values) - min(values) <= 8 * sys.float_info.epsilon * scale


def paired_t_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> TestResult:
    """Paired t-test on d_i = a_i - b_i (df = n - 1): for runs matched one to one, here by seed."""
    _check_confidence(confidence)
    xs, ys = _finite_values("a", a), _finite_values("b", b)
    if len(xs) != len(ys):
        raise ValueError(f"a paired test needs as many values in a as in b, got {len(xs)} and {len(ys)}")
    d = [x - y for x, y in zip(xs, ys)]
    mean = sum(d) / len(d) if d else math.nan
    if len(xs) < 2:
        return _undecided("paired t", mean, len(xs), len(ys), confidence,
                          f"{len(xs)} pair(s): a paired test needs at least 2")
    if _no_spread(d, max(abs(v) for v in xs + ys)):
        return _undecided("paired t", mean, len(xs), len(ys), confidence,
                          f"no spread: all {len(d)} pairs differ by the same amount")
    return _t_result("paired t", mean, math.sqrt(_variance(d, mean) / len(d)), len(d) - 1, len(xs), len(ys),
                     confidence)


def welch_t_test(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> TestResult:
    """Welch's t-test: t = (mean a - mean b) / sqrt(s_a^2/n_a + s_b^2/n_b), with the
    Welch-Satterthwaite degrees of freedom (not a whole number in general)."""
    _check_confidence(confidence)
    xs, ys = _finite_values("a", a), _finite_values("b", b)
    diff = (sum(xs) / len(xs) - sum(ys) / len(ys)) if xs and ys else math.nan
    if len(xs) < 2 or len(ys) < 2:
        return _undecided("Welch t", diff, len(xs), len(ys), confidence,
                          f"{len(xs)} and {len(ys)} values: Welch's test needs at least 2 on each side")
    if all(_no_spread(side, max(abs(v) for v in side)) for side in (xs, ys)):
        return _undecided("Welch t", diff, len(xs), len(ys), confidence,
                          "no spread: the values on each side are all the same")
    ma, mb = sum(xs) / len(xs), sum(ys) / len(ys)
    qa, qb = _variance(xs, ma) / len(xs), _variance(ys, mb) / len(ys)
    se = math.sqrt(qa + qb)
    df = (qa + qb) ** 2 / (qa ** 2 / (len(xs) - 1) + qb ** 2 / (len(ys) - 1))
    return _t_result("Welch t", ma - mb, se, df, len(xs), len(ys), confidence)
