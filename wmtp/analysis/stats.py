"""Statistics for the measurements (DESIGN §5, §6): Wilson intervals on α_j, the α_j ↔ H[n] ↔ AL
round trip, mean and Student-t confidence intervals over runs, and the OLS latency-model fit.

Pure Python (no numpy / scipy needed at run time). Invariants, tested in ``tests/test_analysis.py``:

- ``wilson_interval(k, n)`` contains k/n and lies in [0, 1]; n = 0 gives (nan, nan).
- ``acceptance_length_from_alphas(alphas_from_histogram(H)) == acceptance_length(H)`` and
  ``histogram_from_alphas(alphas_from_histogram(H), sum(H)) == H`` (up to float rounding).
- ``ols_fit`` matches ``numpy.polyfit`` and the textbook standard errors.
- ``t_quantile`` matches ``scipy.stats.t.ppf`` to 1e-3 for the tabulated levels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import NormalDist

from wmtp.engine.metrics import acceptance_length, alphas_from_histogram

NAN = float("nan")

# ---- Wilson intervals and the acceptance profile ------------------------------------------------


def wilson_interval(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a binomial proportion k/n; (nan, nan) when n == 0."""
    if not 0 <= k <= n:
        raise ValueError(f"wilson_interval: need 0 <= k <= n (got k={k}, n={n})")
    if n == 0:
        return NAN, NAN
    p = k / n
    den = 1.0 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    lo = 0.0 if k == 0 else max(0.0, centre - half)  # exact ends: rounding must not exclude p = 0 or 1
    hi = 1.0 if k == n else min(1.0, centre + half)
    return lo, hi


@dataclass(frozen=True)
class AlphaEstimate:
    """α_j = k / n with k = Σ_{m≥j} H[m] (steps that accepted draft j), n = Σ_{m≥j−1} H[m] (steps that
    reached draft j), and its Wilson interval [lo, hi]."""

    j: int
    k: int
    n: int
    alpha: float
    lo: float
    hi: float


def alpha_intervals(hist: list[int], z: float = 1.96) -> list[AlphaEstimate]:
    """α_j with Wilson intervals for j = 1..γ from an acceptance histogram H[0..γ]."""
    alphas = alphas_from_histogram(hist)
    out = []
    for j, a in enumerate(alphas, start=1):
        k, n = sum(hist[j:]), sum(hist[j - 1 :])
        out.append(AlphaEstimate(j, k, n, a, *wilson_interval(k, n, z)))
    return out


def _survival(alphas: list[float]) -> list[float]:
    """P(accepted ≥ j) = Π_{i≤j} α_i for j = 0..γ. A nan α_j (nobody reached draft j) only follows a
    zero survival, so it contributes 0."""
    out, prod = [1.0], 1.0
    for a in alphas:
        prod = 0.0 if prod == 0.0 else prod * a
        out.append(prod)
    return out


def acceptance_length_from_alphas(alphas: list[float]) -> float:
    """AL = 1 + Σ_j Π_{i≤j} α_i (DESIGN §5); equals ``acceptance_length(H)`` for α from H."""
    return sum(_survival(alphas))


def histogram_from_alphas(alphas: list[float], iterations: float) -> list[float]:
    """Inverse of ``alphas_from_histogram``: H[n] = iterations · P(accepted = n), n = 0..γ."""
    s = _survival(alphas)
    return [iterations * (s[n] - (s[n + 1] if n + 1 < len(s) else 0.0)) for n in range(len(s))]


def acceptance_summary(hist: list[int], z: float = 1.96) -> dict:
    """Measured AL, AL rebuilt from α_j, and the α_j estimates of one histogram (for reports)."""
    alphas = alpha_intervals(hist, z)
    return {
        "iterations": sum(hist),
        "al": acceptance_length(hist),
        "al_from_alphas": acceptance_length_from_alphas([a.alpha for a in alphas]) if sum(hist) else NAN,
        "alphas": alphas,
    }


# ---- Student t and mean confidence intervals ----------------------------------------------------

# Two-sided level -> t quantiles for df = 1..30 (scipy.stats.t.ppf((1 + level) / 2, df), 4 decimals).
_T_TABLE: dict[float, tuple[float, ...]] = {
    0.90: (6.3138, 2.92, 2.3534, 2.1318, 2.015, 1.9432, 1.8946, 1.8595, 1.8331, 1.8125, 1.7959, 1.7823,
           1.7709, 1.7613, 1.7531, 1.7459, 1.7396, 1.7341, 1.7291, 1.7247, 1.7207, 1.7171, 1.7139, 1.7109,
           1.7081, 1.7056, 1.7033, 1.7011, 1.6991, 1.6973),
    0.95: (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.306, 2.2622, 2.2281, 2.201, 2.1788,
           2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.093, 2.086, 2.0796, 2.0739, 2.0687, 2.0639,
           2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423),
    0.99: (63.6567, 9.9248, 5.8409, 4.6041, 4.0321, 3.7074, 3.4995, 3.3554, 3.2498, 3.1693, 3.1058, 3.0545,
           3.0123, 2.9768, 2.9467, 2.9208, 2.8982, 2.8784, 2.8609, 2.8453, 2.8314, 2.8188, 2.8073, 2.7969,
           2.7874, 2.7787, 2.7707, 2.7633, 2.7564, 2.75),
}


def _t_cornish_fisher(z: float, df: int) -> float:
    """Cornish–Fisher expansion of the t quantile around the normal one (error < 1e-5 for df > 30)."""
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4


def t_quantile(level: float, df: int) -> float:
    """Two-sided Student-t critical value: P(|T_df| ≤ t) = level.

    Levels 0.90 / 0.95 / 0.99 use a built-in table for df ≤ 30 and a Cornish–Fisher expansion beyond;
    other levels need scipy.
    """
    if df < 1:
        raise ValueError(f"t_quantile: df must be >= 1 (got {df})")
    key = round(level, 6)
    if key in _T_TABLE:
        if df <= 30:
            return _T_TABLE[key][df - 1]
        return _t_cornish_fisher(NormalDist().inv_cdf((1 + level) / 2), df)
    try:
        from scipy import stats
    except ImportError:  # pragma: no cover - scipy is a dev dependency
        raise ValueError(f"t_quantile: level {level} needs scipy (built-in: {sorted(_T_TABLE)})") from None
    return float(stats.t.ppf((1 + level) / 2, df))


@dataclass(frozen=True)
class MeanCI:
    """Mean of n independent runs with a Student-t interval [lo, hi]; half = nan when n < 2."""

    mean: float
    lo: float
    hi: float
    half: float
    sd: float
    n: int


def mean_ci(values: list[float], level: float = 0.95) -> MeanCI:
    """Mean and level-CI (t distribution, df = n − 1) of per-run values; None entries are dropped."""
    xs = [float(v) for v in values if v is not None]
    n = len(xs)
    if n == 0:
        return MeanCI(NAN, NAN, NAN, NAN, NAN, 0)
    m = math.fsum(xs) / n
    if n == 1:
        return MeanCI(m, NAN, NAN, NAN, NAN, 1)
    sd = math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (n - 1))
    half = t_quantile(level, n - 1) * sd / math.sqrt(n)
    return MeanCI(m, m - half, m + half, half, sd, n)


def _se_mean(c: MeanCI) -> float:
    return c.sd / math.sqrt(c.n) if c.n >= 2 else NAN


def diff_ci(a: list[float], b: list[float], level: float = 0.95) -> MeanCI:
    """mean(a) − mean(b) for independent runs: SE = sqrt(se_a² + se_b²), t with df = min(n_a, n_b) − 1
    (conservative Welch). ``sd`` holds the SE of the difference; n = min(n_a, n_b)."""
    ca, cb = mean_ci(a, level), mean_ci(b, level)
    d, n = ca.mean - cb.mean, min(ca.n, cb.n)
    if n < 2:
        return MeanCI(d, NAN, NAN, NAN, NAN, n)
    se = math.hypot(_se_mean(ca), _se_mean(cb))
    half = t_quantile(level, n - 1) * se
    return MeanCI(d, d - half, d + half, half, se, n)


def ratio_ci(a: list[float], b: list[float], level: float = 0.95) -> MeanCI:
    """mean(a) / mean(b) for independent runs, delta method: rel. SE = sqrt((se_a/a)² + (se_b/b)²),
    t with df = min(n_a, n_b) − 1. ``sd`` holds the SE of the ratio."""
    ca, cb = mean_ci(a, level), mean_ci(b, level)
    r, n = ca.mean / cb.mean, min(ca.n, cb.n)
    if n < 2:
        return MeanCI(r, NAN, NAN, NAN, NAN, n)
    se = abs(r) * math.hypot(_se_mean(ca) / ca.mean, _se_mean(cb) / cb.mean)
    half = t_quantile(level, n - 1) * se
    return MeanCI(r, r - half, r + half, half, se, n)


# ---- Ordinary least squares (latency model T_iter = γ·t_draft_fwd + c) -------------------------


@dataclass(frozen=True)
class LinearFit:
    """y = slope·x + intercept by least squares, with classical standard errors (σ² = SSR/(n−2));
    SEs are nan for n < 3 and r2 is nan when y is constant."""

    slope: float
    intercept: float
    se_slope: float
    se_intercept: float
    r2: float
    n: int

    def __call__(self, x: float) -> float:
        return self.slope * x + self.intercept


def steepest_step(x: list[float], y: list[float]) -> tuple[float, float]:
    """(the largest rise per unit x between consecutive points after sorting by x, the x it rises
    to; the first of equal rises): a depth sweep's worst step, which a cliff makes much steeper than
    the fitted slope."""
    pts = sorted(zip(x, y))
    if len(pts) < 2 or any(a == b for (a, _), (b, _) in zip(pts, pts[1:])):
        raise ValueError(f"steepest_step: need >= 2 points at distinct x (got {[a for a, _ in pts]})")
    return max((((y1 - y0) / (x1 - x0), x1) for (x0, y0), (x1, y1) in zip(pts, pts[1:])), key=lambda s: s[0])


def ols_fit(x: list[float], y: list[float]) -> LinearFit:
    """Least-squares line through (x, y); needs ≥ 2 points and ≥ 2 distinct x."""
    n = len(x)
    if n != len(y) or n < 2:
        raise ValueError(f"ols_fit: need >= 2 paired points (got {n} x, {len(y)} y)")
    mx, my = math.fsum(x) / n, math.fsum(y) / n
    sxx = math.fsum((a - mx) ** 2 for a in x)
    if sxx == 0:
        raise ValueError("ols_fit: all x are equal")
    sxy = math.fsum((a - mx) * (b - my) for a, b in zip(x, y))
    slope = sxy / sxx
    intercept = my - slope * mx
    ssr = math.fsum((b - slope * a - intercept) ** 2 for a, b in zip(x, y))
    syy = math.fsum((b - my) ** 2 for b in y)
    r2 = 1.0 - ssr / syy if syy > 0 else NAN
    if n < 3:
        return LinearFit(slope, intercept, NAN, NAN, r2, n)
    s2 = ssr / (n - 2)
    return LinearFit(slope, intercept, math.sqrt(s2 / sxx), math.sqrt(s2 * (1 / n + mx * mx / sxx)), r2, n)
