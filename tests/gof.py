"""Goodness-of-fit helpers for the statistical exactness tests: a chi-square test of one
distribution (scipy.stats), and the audit's per-position test of whole continuations."""

from __future__ import annotations

import numpy as np
from scipy import stats

from exactspec.audit import ExactspecEngine, audit_distribution

ALPHA = 1e-4
"""False-alarm rate of each test: seeds are fixed, so a pass or fail is reproducible; a
correct sampler fails with probability ≈ 1e-4 per seed, a broken one must fail."""


def gof_pvalue(counts, probs, min_expected: float = 5.0) -> float:
    """Chi-square p-value of observed ``counts`` against ``probs`` (same length), pooling
    outcomes whose expected count is below ``min_expected`` into one bin. An observation
    of an outcome with probability 0 gives p = 0."""
    counts = np.asarray(counts, dtype=np.float64)
    probs = np.asarray(probs, dtype=np.float64)
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    counts, probs = counts[probs > 0], probs[probs > 0]
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs = list(counts[big]) + ([counts[~big].sum()] if (~big).any() else [])
    exp = list(expected[big]) + ([expected[~big].sum()] if (~big).any() else [])
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def audit_positions(target, generator, prompt_ids, params, num_samples: int,
                    alpha: float = ALPHA):
    """``num_samples`` continuations of ``prompt_ids`` (``params.max_new_tokens`` tokens)
    from ``generator`` (a SpeculativeGenerator or a broken one), tested as the audit tests
    them (:mod:`exactspec.audit.stats`): at every position, the tokens drawn after each
    sampled prefix against the target's exact conditional, Holm over the positions at
    ``alpha``, and any token of probability 0 flagged. Returns the
    :class:`~exactspec.audit.result.DistributionTest`: ``rejected``, the per-position tests and
    the per-block-position drafted and accepted counts."""
    return audit_distribution(target, ExactspecEngine(generator, "under test"), [prompt_ids],
                              params, num_samples, alpha)
