"""The statistics of the audit: goodness of fit, total-variation distance, Holm's
correction and the smallest deviation a sample size can detect.

Sources: the G-test (log-likelihood ratio, Sokal & Rohlf) via ``scipy.stats.power_divergence``;
Holm 1979; power from the noncentral chi-square distribution (Cohen
1988, effect size w) via ``scipy.stats.ncx2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import stats

MIN_EXPECTED = 5.0
"""Outcomes expected fewer times than this are pooled (the usual chi-square rule)."""


@dataclass
class FitResult:
    """One goodness-of-fit test of observed counts against exact probabilities.

    Attributes:
        p_value: the G-test's p-value (0 when an outcome of probability 0 was observed).
        statistic: the G statistic.
        num_bins: outcome bins after pooling.
        num_samples: samples tested.
        tv: total-variation distance between the empirical and exact bin distributions.
        tv_ci: a 95 % bootstrap interval for ``tv`` (resampling the observed counts). Even a
            correct sampler shows tv > 0 at finite samples (≈ sqrt(bins / samples) / 2).
    """

    p_value: float
    statistic: float
    num_bins: int
    num_samples: int
    tv: float
    tv_ci: tuple[float, float]


def goodness_of_fit(counts, probs, seed: int = 0, bootstrap: int = 1000) -> FitResult:
    """G-test of ``counts`` ``[bins]`` against ``probs`` ``[bins]`` (summing to 1; bins are
    expected to hold ≥ :data:`MIN_EXPECTED` samples each, see :func:`pool_bins`), with a
    ``bootstrap``-resample interval for the TV distance (NaNs with 0 resamples).

    Raises:
        ValueError: if the shapes differ or there are no samples.
    """
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    if counts.shape != probs.shape or counts.ndim != 1:
        raise ValueError(f"counts {counts.shape} and probs {probs.shape} must be 1-D and alike")
    n = counts.sum()
    if n <= 0:
        raise ValueError("no samples to test")
    probs = probs / probs.sum()
    tv = total_variation(counts / n, probs)
    low = high = float("nan")
    if bootstrap:
        boot = np.random.default_rng(seed).multinomial(int(n), counts / n, size=bootstrap) / n
        low, high = np.quantile(0.5 * np.abs(boot - probs).sum(axis=1), [0.025, 0.975])
    if counts[probs == 0].sum() > 0:
        return FitResult(0.0, float("inf"), len(counts), int(n), tv, (float(low), float(high)))
    keep = probs > 0
    if keep.sum() < 2:
        return FitResult(1.0, 0.0, int(keep.sum()), int(n), tv, (float(low), float(high)))
    result = stats.power_divergence(counts[keep], probs[keep] * n, lambda_="log-likelihood")
    return FitResult(float(result.pvalue), float(result.statistic), int(keep.sum()), int(n), tv,
                     (float(low), float(high)))


def total_variation(p, q) -> float:
    """½ Σ |p − q| for two distributions over the same bins."""
    return 0.5 * float(np.abs(np.asarray(p, dtype=np.float64) - np.asarray(q, dtype=np.float64)).sum())


def pool_bins(probs, num_samples: int, min_expected: float = MIN_EXPECTED) -> np.ndarray:
    """Map outcomes to bins: each outcome expected ≥ ``min_expected`` times keeps its own bin,
    the rest share one pooled bin (merged into the smallest bin if it is itself too small).

    Args:
        probs: ``[outcomes]`` exact probabilities.
    Returns:
        ``[outcomes]`` bin index of each outcome (bins numbered from 0).
    """
    probs = np.asarray(probs, dtype=np.float64)
    expected = probs * num_samples
    order = np.argsort(-expected, kind="stable")
    big = [i for i in order if expected[i] >= min_expected]
    bins = np.full(len(probs), len(big), dtype=np.int64)
    for b, i in enumerate(big):
        bins[i] = b
    pooled = expected[bins == len(big)].sum()
    if big and (bins == len(big)).any() and pooled < min_expected:
        bins[bins == len(big)] = len(big) - 1  # the smallest kept bin absorbs the rest
    return bins


def holm(p_values, alpha: float) -> list[bool]:
    """Holm's step-down correction (Holm 1979): which hypotheses are rejected at
    family-wise error rate ``alpha``. The i-th smallest p-value (from 0) is compared with
    alpha / (m − i) until the first that fails. (statsmodels' ``multipletests`` does the
    same but costs ≈ 0.2 s per call and pulls in pandas.)"""
    m = len(p_values)
    rejected = [False] * m
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        if p_values[index] > alpha / (m - rank):
            break
        rejected[index] = True
    return rejected


def detectable_tv(probs, num_samples: int, alpha: float, power: float = 0.8) -> float:
    """The smallest total-variation deviation from ``probs`` (``[bins]``) that a test with
    ``num_samples`` samples at level ``alpha`` detects with probability ``power``, whatever
    its direction: the chi-square effect size w reached at that power, turned into TV for the
    hardest deviation (mass moved between the two likeliest bins: w² = tv² (1/p₁ + 1/p₂)).
    Returns ``inf`` for fewer than 2 bins."""
    probs = np.sort(np.asarray(probs, dtype=np.float64))[::-1]
    if len(probs) < 2 or num_samples <= 0:
        return float("inf")
    dof = len(probs) - 1
    critical = stats.chi2.ppf(1 - alpha, dof)
    low, high = 0.0, 1e6
    for _ in range(100):  # bisect the noncentrality reaching the power
        mid = (low + high) / 2
        if stats.ncx2.sf(critical, dof, mid) >= power:
            high = mid
        else:
            low = mid
    w = np.sqrt(high / num_samples)
    return float(min(1.0, w / np.sqrt(1 / probs[0] + 1 / probs[1])))
