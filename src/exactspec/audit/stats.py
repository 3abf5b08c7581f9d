"""The statistics of the audit: a goodness-of-fit test per position of the continuation,
built from one test per sampled prefix, Holm's correction, and the smallest deviation a
test detects.

**Per-position conditional tests.** The samples of one prompt form a tree: a node is a
prefix x_<j that n_node samples reached (depth j = 0 .. m-1), its children the next
tokens they drew. At each node the counts of next tokens are compared with the target's
exact conditional p(· | prompt, x_<j) by Pearson's chi-square test. Bins at a node: each
token expected at least :data:`MIN_EXPECTED` times (n_node · p ≥ 5) has its own bin, the
others share one pooled bin (merged into the smallest bin when it is itself expected
fewer than 5 times); a node left with fewer than 2 bins is not tested on its own. Given
how many samples reach each node, its counts are multinomial (the chain rule of the
likelihood) and its bins depend only on n_node and p, never on its own outcomes, so under
the null hypothesis the nodes' statistics are independent and asymptotically chi-square
with their dof. Per position j: X²_j = Σ X²_node and dof_j = Σ dof_node over the nodes at
depth j, p-value from chi2(dof_j). Pearson's statistic rather than G (the log-likelihood
ratio): its null mean is exactly its dof at any sample size, while G's exceeds it when
counts are small, a bias that a sum over many small nodes accumulates into false alarms
above the level (Koehler & Larntz 1980, *JASA* 75: 336, on sparse multinomials). A sampled token of probability 0
at its node is no matter of statistics: it is reported as an impossible continuation.

**The remainder.** Deep in the tree most prefixes are reached too rarely to be tested on
their own, so the samples at the untested nodes of a depth are tested together: each
drawn token x becomes its randomized probability integral transform U = F(x-) + V p(x),
V ~ Uniform(0, 1), with F the node's distribution function over tokens ordered by
decreasing probability (Czado, Gneiting & Held 2009, *Biometrics* 65: 1254, randomized
PIT). Under the null hypothesis the U are independent and exactly Uniform(0, 1) whatever
their nodes, and at one node the law of U is as far from uniform, in total variation, as
the sampler from the target; the U of a position are binned into up to
:data:`REMAINDER_BINS` equal-width bins (each expected ≥ 5 times) and their chi-square
statistic and dof are added to the position's (only when fewer than 10 such samples sit
at a depth do they go untested). Prefixes after which the target allows a single token
carry no information beyond the check for impossible tokens, so they are left out of the
remainder (their U would be pure noise).

**Power, in the least favourable direction.** Asymptotically the power of a chi-square
(Pearson or G) goodness-of-fit test depends only on its dof and the noncentrality
λ = n w², with Cohen's effect size w² = Σ dᵢ² / pᵢ for a deviation d of the bin
probabilities p (Cohen 1988, *Statistical Power Analysis for the Behavioral Sciences*,
ch. 7; power from the noncentral chi-square, ``scipy.stats.ncx2``). Let δ = ½ Σ |dᵢ| be
the deviation's total variation, A the bins with dᵢ > 0 and B the rest, so
Σ_A dᵢ = δ = -Σ_B dᵢ. For fixed A, Cauchy-Schwarz gives δ² = (Σ_A dᵢ)² ≤ (Σ_A dᵢ² / pᵢ)·P(A),
equality for dᵢ ∝ pᵢ; hence

    w² ≥ δ² (1/P(A) + 1/P(B)) = δ² / (P(A) (1 - P(A))) ≥ 4 δ²,

with equality when the mass moves proportionally between two halves of probability ½
each: that is the least favourable direction, and every deviation with w ≥ 2δ is
detected at least as often. So with w₀.₈ = sqrt(λ₀.₈ / n), λ₀.₈ the noncentrality at
which the test at its level and dof reaches power 0.8, any deviation of total variation
δ ≥ w₀.₈ / 2 is detected with power ≥ 0.8 (:func:`detectable_tv`). The bound holds for
any bins (conservative when no subset of bins has probability exactly ½).

For a position test, λ = Σ_nodes n_node w_node² ≥ 4 Σ n_node TV_node²
≥ 4 n_j (Σ (n_node / n_j) TV_node)² (Jensen), n_j the samples at the nodes tested on their
own (the remainder adds its dof to dof_j and a noncentrality ≥ 0 to λ): a sampler whose
conditional TV, averaged over those prefixes (weighted by how often each is reached), is at
least w(dof_j, n_j)/2 is caught with power ≥ 0.8, whatever the direction. TV is measured
on the bins tested (tokens rarer than 5 expected at their node are pooled).

Multiple tests: Holm 1979 over every (prompt, position) test; the power is stated at the
level of Holm's first step, alpha / number of tests.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from scipy import optimize, stats

MIN_EXPECTED = 5.0
"""Tokens expected fewer times than this at their node are pooled (the usual chi-square
rule)."""

POWER = 0.8
"""The power at which the detectable deviation is stated."""

REMAINDER_BINS = 10
"""Most bins of a position's remainder test (equal-width bins of the randomized PIT)."""

Prefix = tuple[int, ...]
Conditionals = Callable[[Sequence[Prefix]], Iterable[tuple[Prefix, np.ndarray]]]
"""Given prefixes (sorted, closed under taking prefixes), yields each prefix with the
target's exact next-token distribution after it (``[vocab]``, float64, sums to 1)."""


@dataclass
class NodeFit:
    """The chi-square test of the next tokens drawn at one prefix.

    Attributes:
        num_samples: n_node, samples that reached the prefix.
        tokens: ``[bins]`` the token of each bin, most probable first; None for the pooled
            bin (last, when there is one).
        exact: ``[bins]`` exact probability of each bin.
        counts: ``[bins]`` samples in each bin.
        merged: whether the pooled tokens were merged into the last token's bin (they
            were expected fewer than 5 times together).
        pooled_mass: exact probability of the tokens without a bin of their own.
        support: tokens of probability > 0 (1: the target allows a single token here).
        statistic: Pearson's X² (0 for an untested node).
        dof: bins - 1, or 0 when the node is not tested (fewer than 2 bins).
        tv: total variation between the empirical and exact bin distributions.
        impossible: ``{token: count}`` drawn tokens of probability 0.
    """

    num_samples: int
    tokens: list[int | None]
    exact: list[float]
    counts: list[int]
    merged: bool
    pooled_mass: float
    support: int
    statistic: float
    dof: int
    tv: float
    impossible: dict[int, int]


def node_fit(counts: Mapping[int, int], probs: np.ndarray,
             min_expected: float = MIN_EXPECTED) -> NodeFit:
    """Chi-square test of next-token ``counts`` (token → count) against ``probs`` (``[vocab]``,
    summing to 1), with the bins of the module docstring."""
    n = sum(counts.values())
    own = np.flatnonzero(probs * n >= min_expected)
    own = own[np.argsort(-probs[own], kind="stable")]
    tokens: list[int | None] = own.tolist()
    exact = probs[own].tolist()
    observed = [counts.get(t, 0) for t in tokens]
    pooled_mass = max(0.0, 1.0 - sum(exact))
    pooled_count = n - sum(observed)
    merged = False
    support = int(np.count_nonzero(probs))
    if support > len(own) or pooled_count:  # some tokens share a bin
        merged = bool(tokens) and pooled_mass * n < min_expected
        if merged:  # the smallest bin absorbs the rest
            exact[-1] += pooled_mass
            observed[-1] += pooled_count
        else:
            tokens.append(None)
            exact.append(pooled_mass)
            observed.append(pooled_count)
    impossible = {t: c for t, c in counts.items() if probs[t] <= 0}
    obs, exp = np.array(observed, dtype=np.float64), np.array(exact) * n
    tv = 0.5 * float(np.abs(obs - exp).sum()) / n
    dof = len(tokens) - 1
    statistic = float(((obs - exp) ** 2 / exp).sum()) if dof else 0.0
    return NodeFit(n, tokens, exact, observed, merged, pooled_mass, support, statistic, dof, tv,
                   impossible)


@dataclass
class PositionFit:
    """The test of one position of the continuation: the chi-square tests of its nodes (the
    prefixes x_<j of length j = position - 1) summed.

    Attributes:
        position: 1 for the first generated token, .. m.
        num_samples: samples that reached this position.
        num_nodes: prefixes tested on their own at this depth (nodes with ≥ 2 bins).
        num_tested: samples at those nodes (n_j of the power statement).
        remainder_samples: samples at the other nodes (< 2 bins), tested together by
            their randomized PIT, except at nodes where the target allows one token.
        forced_samples: samples at nodes where the target allows one token (only checked
            for impossible tokens).
        remainder_dof: the remainder test's dof (0: too few samples to test, < 10).
        statistic: X²_j, the nodes' and the remainder's.
        dof: dof_j, the nodes' and the remainder's (0: nothing to test at this position).
        p_value: chi2(dof_j) tail probability of X²_j (1 when dof_j = 0).
        tv: mean conditional TV over the tested nodes, weighted by their samples (a correct
            sampler shows TV > 0 at finite samples, about sqrt(dof / n) / 2).
        pooled_share: expected share of the samples at this position falling in a pooled
            bin of a tested node (Σ n_node · pooled mass / num_samples).
        detectable_tv: the mean conditional TV detected with power 0.8 in the least
            favourable direction, at the level of Holm's first step (set by the caller,
            see :func:`detectable_tv`).
        rejected: whether Holm's procedure rejects this test.
    """

    position: int
    num_samples: int
    num_nodes: int
    num_tested: int
    remainder_samples: int
    remainder_dof: int
    forced_samples: int
    statistic: float
    dof: int
    p_value: float
    tv: float
    pooled_share: float
    detectable_tv: float = float("inf")
    rejected: bool = False

    @property
    def power_samples(self) -> int:
        """The sample size of the power statement: n_j, the samples at the tested nodes."""
        return self.num_tested


@dataclass
class Impossible:
    """Sampled continuations that the target cannot produce (probability 0).

    Attributes:
        prefix: the tokens before the offending one.
        token: the offending token, or None when the sample's length is impossible.
        count: how many samples did it.
        reason: e.g. ``probability 0`` or ``ended without a stop token``.
    """

    prefix: Prefix
    token: int | None
    count: int
    reason: str


@dataclass
class TreeFit:
    """Every test of one prompt's samples.

    Attributes:
        num_samples: samples tested.
        positions: ``[m]`` one test per position.
        impossible: the impossible continuations found (the audit fails on any).
        first: the first-token node's test (for plots).
    """

    num_samples: int
    positions: list[PositionFit]
    impossible: list[Impossible] = field(default_factory=list)
    first: NodeFit | None = None


def sample_tree(samples: Iterable[Sequence[int]], num_tokens: int,
                stop_ids: Collection[int]) -> tuple[dict[Prefix, Counter], list[Impossible]]:
    """The prefix tree of ``samples``: prefix → Counter of the next tokens drawn, over
    positions 0..num_tokens-1 (a sample ends at its first stop token). Samples whose length
    no sampler of the target can produce (past a stop token, beyond ``num_tokens``, or
    shorter without a stop token) are returned as :class:`Impossible`."""
    children: dict[Prefix, Counter] = defaultdict(Counter)
    shapes: Counter = Counter()
    for sample in samples:
        sample = tuple(sample)
        end = next((j + 1 for j, t in enumerate(sample) if t in stop_ids), len(sample))
        for j in range(min(end, num_tokens)):
            children[sample[:j]][sample[j]] += 1
        if end < len(sample) and end <= num_tokens:
            shapes[sample[:end], sample[end], "continued after a stop token"] += 1
        elif len(sample) > num_tokens:
            shapes[sample[:num_tokens], sample[num_tokens], f"more than {num_tokens} tokens"] += 1
        elif len(sample) < num_tokens and (not sample or sample[-1] not in stop_ids):
            shapes[sample, None, "ended without a stop token"] += 1
    return dict(children), [Impossible(p, t, c, r) for (p, t, r), c in shapes.items()]


def fit_tree(samples: Sequence[Sequence[int]], num_tokens: int, stop_ids: Collection[int],
             conditionals: Conditionals, seed: int = 0) -> TreeFit:
    """The per-position tests of ``samples`` (continuations of at most ``num_tokens``
    tokens) against the exact conditionals (see module docstring); ``seed`` seeds the
    randomized PIT of the remainder."""
    children, impossible = sample_tree(samples, num_tokens, stop_ids)
    rng = np.random.default_rng(seed)
    fits: dict[int, list[NodeFit]] = defaultdict(list)
    remainder: dict[int, list[np.ndarray]] = defaultdict(list)
    first = None
    for prefix, probs in conditionals(sorted(children)):
        fit = node_fit(children[prefix], probs)
        fits[len(prefix)].append(fit)
        if not fit.dof and fit.support > 1:
            remainder[len(prefix)].append(pit_values(children[prefix], probs, rng))
        impossible += [Impossible(prefix, t, c, "probability 0") for t, c in fit.impossible.items()]
        if not prefix:
            first = fit
    positions = [_position(j + 1, fits[j], np.concatenate(remainder[j] or [np.empty(0)]))
                 for j in range(num_tokens)]
    return TreeFit(len(samples), positions, impossible, first)


def pit_values(counts: Mapping[int, int], probs: np.ndarray, rng: np.random.Generator
               ) -> np.ndarray:
    """The randomized PIT F(x-) + V p(x) of each drawn token x (``counts``: token → count),
    tokens ordered by decreasing probability, ties by id (see module docstring)."""
    values = []
    for token, count in sorted(counts.items()):
        p = probs[token]
        before = probs[probs > p].sum() + probs[:token][probs[:token] == p].sum()
        values.append(before + rng.random(count) * p)
    return np.concatenate(values)


def _position(position: int, fits: list[NodeFit], remainder: np.ndarray) -> PositionFit:
    """Sum the node tests of one position (the nodes at depth ``position - 1``) and the
    remainder test of the PIT values ``remainder``."""
    tested = [f for f in fits if f.dof]
    n = sum(f.num_samples for f in fits)
    n_tested = sum(f.num_samples for f in tested)
    statistic = sum(f.statistic for f in tested)
    dof = sum(f.dof for f in tested)
    num_bins = min(REMAINDER_BINS, int(len(remainder) // MIN_EXPECTED))
    if num_bins >= 2:
        observed = np.histogram(remainder, bins=num_bins, range=(0.0, 1.0))[0]
        expected = len(remainder) / num_bins
        statistic += float(((observed - expected) ** 2).sum() / expected)
    remainder_dof = max(0, num_bins - 1)
    dof += remainder_dof
    p_value = float(stats.chi2.sf(statistic, dof)) if dof else 1.0
    tv = sum(f.num_samples * f.tv for f in tested) / n_tested if n_tested else 0.0
    pooled = sum(f.num_samples * f.pooled_mass for f in tested)
    forced = sum(f.num_samples for f in fits if f.support == 1)
    return PositionFit(position, n, len(tested), n_tested, len(remainder), remainder_dof, forced,
                       statistic, dof, p_value, tv, pooled / n if n else 0.0)


def noncentrality(dof: int, level: float, power: float = POWER) -> float:
    """λ at which a chi-square test with ``dof`` degrees of freedom at ``level`` reaches
    ``power`` (noncentral chi-square, Cohen 1988 ch. 7)."""
    critical = stats.chi2.ppf(1 - level, dof)
    return float(optimize.brentq(lambda lam: stats.ncx2.sf(critical, dof, lam) - power,
                                 1e-9, 1e6, xtol=1e-9))


def detectable_tv(dof: int, num_samples: int, level: float, power: float = POWER) -> float:
    """The smallest total variation detected with probability ``power`` by a goodness-of-fit
    test with ``dof`` degrees of freedom on ``num_samples`` samples at ``level``, in the
    least favourable direction: w/2 with w = sqrt(λ/n) (derivation in the module
    docstring). ``inf`` when there is nothing to test."""
    if dof < 1 or num_samples <= 0:
        return float("inf")
    return min(1.0, float(np.sqrt(noncentrality(dof, level, power) / num_samples)) / 2)


def decide_family(positions: Sequence, alpha: float, sample_size: Callable[[object], float],
                  extra: Sequence = ()) -> float:
    """Holm at ``alpha`` over every position test with something to test (``dof`` > 0) and
    the ``extra`` tests (anything with ``p_value`` and ``rejected``): fill each one's
    ``rejected``, and each position's ``detectable_tv`` at the level of Holm's first step
    (returned) for ``sample_size(position)`` samples. Positions are the one-sample
    :class:`PositionFit` or the two-sample
    :class:`~exactspec.audit.two_sample.PositionComparison`."""
    tested = [p for p in positions if p.dof]
    family = tested + list(extra)
    level = alpha / max(1, len(family))
    for test, rejected in zip(family, holm([t.p_value for t in family], alpha)):
        test.rejected = rejected
    for position in tested:
        position.detectable_tv = detectable_tv(position.dof, sample_size(position), level)
    return level


def decide(prompts: Sequence, alpha: float) -> float:
    """The audit's one decision rule: Holm at ``alpha`` over one family, every position test
    of every prompt with something to test and every prompt's ``joint_tests`` (the
    two-sample audit's MMD test; none against exact probabilities). Fills each test's
    ``rejected`` and each position's ``detectable_tv`` for its ``power_samples``, at the
    level of Holm's first step (returned).

    Args:
        prompts: the prompts' tests, one-sample
            (:class:`~exactspec.audit.runner.PromptTest`) or two-sample
            (:class:`~exactspec.audit.two_sample.PromptComparison`).
    """
    return decide_family([p for prompt in prompts for p in prompt.positions], alpha,
                         lambda position: position.power_samples,
                         extra=[t for prompt in prompts for t in prompt.joint_tests])


def holm(p_values: Sequence[float], alpha: float) -> list[bool]:
    """Holm's step-down correction (Holm 1979): which hypotheses are rejected at
    family-wise error rate ``alpha``. The i-th smallest p-value (from 0) is compared with
    alpha / (m − i) until the first that fails. (statsmodels' ``multipletests`` does the
    same but is far slower per call and pulls in pandas.)"""
    m = len(p_values)
    rejected = [False] * m
    for rank, index in enumerate(sorted(range(m), key=lambda i: p_values[i])):
        if p_values[index] > alpha / (m - rank):
            break
        rejected[index] = True
    return rejected
