"""The statistics behind every accuracy claim: intervals for one evaluation (the trainers' and the reward
models'), and the paired tests that compare two runs on the same held-out problems (``cohortrl report``). A
module of its own so that no layer imports another for them."""

from __future__ import annotations

import math

import numpy as np


def wilson_interval(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% Wilson score interval for a proportion (better than the normal approximation near 0 and 1)."""
    if n == 0:
        return (0.0, 1.0)
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return (max(0.0, centre - half), min(1.0, centre + half))


def mean_interval(values: list[float], z: float = 1.96) -> tuple[float, float, float]:
    """The mean of per-problem fractions (each problem's share of k samples right) with its normal 95% interval,
    mean ± z·sd/√n clipped to [0, 1]: (mean, low, high); (mean, 0, 1) for fewer than two values. The problems are
    the units, so the interval is over problems, not over the n·k samples (which are not independent)."""
    n = len(values)
    mean = math.fsum(values) / n if n else 0.0
    if n < 2:
        return mean, 0.0, 1.0
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = z * sd / math.sqrt(n)
    return mean, max(0.0, mean - half), min(1.0, mean + half)


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value for two evaluations of the same problems: ``only_a`` problems right in A
    and wrong in B, ``only_b`` the reverse (the problems both got right or both wrong carry no information).
    Under H0 each discordant problem goes either way with probability 1/2, so the count is Binomial(n, 1/2),
    n = only_a + only_b; p = min(1, 2·P(X ≤ min(only_a, only_b))) (McNemar 1947; the exact form avoids the
    chi-squared approximation's failure at small n). No discordant problem: p = 1."""
    n = only_a + only_b
    if n == 0:
        return 1.0
    tail = sum(math.comb(n, k) for k in range(min(only_a, only_b) + 1)) / 2**n
    return min(1.0, 2 * tail)


def paired_bootstrap(diffs_SN: list[list[float]], resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """The mean paired difference over seeds × problems, with a percentile interval from a two-level bootstrap:
    each resample draws S seed pairs with replacement, then, within each drawn pair, its N problems with
    replacement (both arms keep the same problems: the pairing is preserved). Resampling the seeds puts the
    seed-to-seed spread into the interval; resampling the problems, the finite held-out set. ``diffs_SN``: per
    seed pair, one value per problem (B's correctness − A's: -1, 0 or 1); pairs may hold different problem
    counts. Returns (mean difference, low, high); deterministic for a given ``seed``."""
    if not diffs_SN or any(len(d) == 0 for d in diffs_SN):
        raise ValueError("paired_bootstrap needs at least one seed pair, each with at least one problem")
    rng = np.random.default_rng(seed)
    groups = [np.asarray(d, dtype=float) for d in diffs_SN]
    total = sum(len(g) for g in groups)
    mean = float(sum(g.sum() for g in groups) / total)
    stats = np.empty(resamples)
    if len({len(g) for g in groups}) == 1:
        # Every pair holds the same problems (the usual case): one draw of S × N indices per resample gives the
        # same numbers as S draws of N (the generator fills the array in order), and the sums of -1/0/1 values
        # are exact in any order, so this is the loop below with one generator call per resample instead of S.
        table = np.stack(groups)
        S, N = table.shape
        for r in range(resamples):
            picked = rng.integers(S, size=S)
            stats[r] = table[picked[:, None], rng.integers(N, size=(S, N))].sum() / (S * N)
    else:
        for r in range(resamples):
            picked = rng.integers(len(groups), size=len(groups))
            sums, counts = 0.0, 0
            for s in picked:
                g = groups[s]
                sums += g[rng.integers(len(g), size=len(g))].sum()
                counts += len(g)
            stats[r] = sums / counts
    alpha = (1 - level) / 2
    low, high = np.quantile(stats, [alpha, 1 - alpha])
    return mean, float(low), float(high)
