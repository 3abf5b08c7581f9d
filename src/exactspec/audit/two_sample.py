"""Two-sample tests: do engines A and B sample the same distribution? For engines reached
only through their API (:mod:`exactspec.audit.endpoint`), with no exact probabilities at
hand: A with speculation on against B with it off, or against another engine.

**Per-position conditional tests (the verdict's).** The samples of one prompt, A's and B's
together, form a prefix tree (as in :mod:`exactspec.audit.stats`): at a prefix x_<j that
both reached, the next tokens A drew and those B drew make a 2 × K contingency table, K
bins chosen from the pooled counts (each token drawn at least :data:`MIN_POOLED` times
by both together has its own bin, the rest share one, merged into the smallest bin when
it is itself rarer). Its G statistic (the log-likelihood ratio of homogeneity) tests
p_A(· | x_<j) = p_B(· | x_<j); a position's statistic is the sum over its prefixes. The
p-value is a permutation test's: under the null hypothesis, given which prefix each
sample reached, the next tokens at a prefix are exchangeable between A and B, so the A/B
labels are permuted within each prefix (for each table, A's row drawn from the
multivariate hypergeometric law of its margins; the bins depend only on the pooled
counts, which permuting leaves alone). This is exact at any count, however small, with
Monte Carlo draws stopped sequentially (Besag & Clifford 1991, *Biometrika* 78: 301: stop
at the draw l that brings the :data:`EXCEEDANCES`-th permuted statistic at least as large
as the observed one, p = h / l; else after ``max_draws``, p = (g + 1) / (max_draws + 1):
:func:`sequential_p_value`). Holm over every (prompt,
position), as in the one-sample audit.

**Power.** The asymptotic noncentrality of the homogeneity test at one prefix is
λ = n_A n_B / (n_A + n_B) · Σ_k (p_A,k − p_B,k)² / p̄_k, p̄ the pooled bin probabilities;
the Cauchy-Schwarz argument of :mod:`exactspec.audit.stats` (Σ d² / p̄ ≥ 4 δ², δ the total
variation between A's and B's bin distributions) gives λ ≥ 4 n_eff δ², n_eff = n_A n_B /
(n_A + n_B). Summed over a position's prefixes with Jensen, a mean TV (weighted by n_eff)
of at least sqrt(λ₀.₈ / Σ n_eff) / 2 is detected with power ≥ 0.8 in the least favourable
direction (:func:`~exactspec.audit.stats.detectable_tv` with Σ n_eff samples). Two
samples of n each give n_eff = n / 2: a two-sample audit needs about twice the samples
of a one-sample audit against exact probabilities for the same detectable deviation.

**The MMD test with a Hamming kernel** (Gao, Liang & Guestrin 2024, "Model Equality
Testing", arXiv 2410.20247) on the same samples: k(x, y) = (1/m) Σ_j [x_j = y_j] over the
first m tokens (padded), the unbiased MMD² and a permutation p-value over the pooled
samples (sequential as above). With this kernel MMD² is (1/m) Σ_j ‖f_A,j − f_B,j‖² (minus
the diagonal terms), f_·,j the frequencies of each token at position j: it compares the
marginal distribution of each position, all positions in one test. The two tests are
powerful against different deviations: the conditional tests against a deviation of the
conditionals after some prefixes, which the marginals can blur or cancel (a test here
builds one with equal marginals: only they catch it), and they say where it is and how
large a deviation each position rules out; the MMD test against a deviation spread over
every position in one direction, such as a temperature shift, which it pools into one
test where the conditional tests split it over positions and prefixes (measured on the
audit's temperature control: ``subsample_power``). So the verdict uses both: each
prompt's MMD test joins its position tests in one Holm family.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np

from exactspec.audit.stats import holm

MIN_POOLED = 5
"""A token drawn fewer times than this by A and B together shares the pooled bin."""
EXCEEDANCES = 20
"""Sequential Monte Carlo: stop after this many permuted statistics ≥ the observed one."""
BATCH = 500
"""Permutation draws per round."""
BOOTSTRAP = 200
"""Bootstrap draws for the TV's interval."""

Sample = Sequence[Hashable]


@dataclass
class Table:
    """One prefix's 2 × K table (rows A and B, bins from the pooled counts).

    Attributes:
        bins: ``[K]`` the token of each bin, most drawn first; None for the pooled bin.
        counts_a, counts_b: ``[K]`` A's and B's counts.
    """

    bins: list
    counts_a: np.ndarray
    counts_b: np.ndarray

    @property
    def n_a(self) -> int:
        return int(self.counts_a.sum())

    @property
    def n_b(self) -> int:
        return int(self.counts_b.sum())

    @property
    def effective(self) -> float:
        """n_eff = n_A n_B / (n_A + n_B)."""
        return self.n_a * self.n_b / (self.n_a + self.n_b)

    def tv(self) -> float:
        """Total variation between A's and B's empirical bin distributions."""
        return float(tv_rows(self.counts_a[None], self.counts_b[None])[0])


@dataclass
class PositionComparison:
    """The test of one position: the G statistics of its prefixes' tables summed.

    Attributes:
        position: 1 for the first generated token, .. m.
        num_a, num_b: A's and B's samples that reached the position.
        num_tables: prefixes tested (both engines reached them, ≥ 2 bins).
        effective_samples: Σ n_eff over those prefixes (the power's sample size).
        dof: Σ (K − 1) over them (0: nothing to test).
        statistic: Σ G.
        p_value: the permutation test's (1 when nothing is tested).
        draws: permutations drawn.
        tv: mean TV between A's and B's observed conditionals over the tested prefixes,
            weighted by n_eff (the plug-in estimate, > 0 at finite samples even for equal
            engines).
        tv_estimate: the same, bias-corrected by the bootstrap (2 tv − mean of the
            bootstrap tvs, at least 0).
        tv_interval: its 95 % basic bootstrap interval (2 tv − the 97.5 % and 2.5 %
            bootstrap quantiles, at least 0), which corrects the plug-in's upward bias; a
            description of the estimate's spread, not a test (at TV = 0, the edge of its
            range, the bootstrap covers badly and the interval can exclude 0).
        detectable_tv: the mean TV detected with power 0.8 in the least favourable
            direction at Holm's first-step level (set by :func:`~exactspec.audit.stats.decide`).
        rejected: Holm's decision.
    """

    position: int
    num_a: int
    num_b: int
    num_tables: int
    effective_samples: float
    dof: int
    statistic: float
    p_value: float
    draws: int
    tv: float
    tv_estimate: float
    tv_interval: tuple[float, float]
    detectable_tv: float = float("inf")
    rejected: bool = False

    @property
    def power_samples(self) -> float:
        """The sample size of the power statement: Σ n_eff."""
        return self.effective_samples


@dataclass
class MMDTest:
    """The Hamming-kernel MMD permutation test (module docstring): unbiased MMD², its
    p-value, the permutations drawn and Holm's decision (:func:`~exactspec.audit.stats.decide`)."""

    statistic: float
    p_value: float
    permutations: int
    rejected: bool = False


@dataclass
class PromptComparison:
    """Every test of one prompt's samples from A and B.

    Attributes:
        first: the first token's table (for plots), None when not tested.
        mmd: the MMD test on the same samples.
    """

    prompt_index: int
    num_a: int
    num_b: int
    positions: list[PositionComparison]
    mmd: MMDTest
    first: Table | None = None

    @property
    def rejected(self) -> bool:
        return self.mmd.rejected or any(p.rejected for p in self.positions)

    @property
    def num_samples(self) -> int:
        """A's samples (the audited engine's)."""
        return self.num_a

    @property
    def joint_tests(self) -> list[MMDTest]:
        """Tests of the whole prompt in the positions' Holm family: the MMD test, where it
        drew permutations."""
        return [self.mmd] if self.mmd.permutations else []


def tables(samples_a: Sequence[Sample], samples_b: Sequence[Sample], num_tokens: int
           ) -> dict[int, list[Table]]:
    """depth j (0-based) → the tables of the prefixes of length j that both A and B reached
    with ≥ 2 bins (module docstring), in sorted prefix order."""
    children: dict[tuple, tuple[Counter, Counter]] = defaultdict(lambda: (Counter(), Counter()))
    for side, samples in enumerate((samples_a, samples_b)):
        for sample in samples:
            sample = tuple(sample)
            for j in range(min(len(sample), num_tokens)):
                children[sample[:j]][side][sample[j]] += 1
    out: dict[int, list[Table]] = defaultdict(list)
    for prefix in sorted(children, key=lambda p: (len(p), [repr(t) for t in p])):
        a, b = children[prefix]
        if not a or not b:
            continue
        pooled = a + b
        own = sorted((t for t, c in pooled.items() if c >= MIN_POOLED),
                     key=lambda t: (-pooled[t], repr(t)))
        bins: list = list(own)
        rows = [[a[t] for t in own], [b[t] for t in own]]
        rest_a = sum(a.values()) - sum(rows[0])
        rest_b = sum(b.values()) - sum(rows[1])
        if rest_a + rest_b:
            if rest_a + rest_b >= MIN_POOLED or not bins:
                bins.append(None)
                rows[0].append(rest_a)
                rows[1].append(rest_b)
            else:  # the smallest bin absorbs the rest
                rows[0][-1] += rest_a
                rows[1][-1] += rest_b
        if len(bins) >= 2:
            out[len(prefix)].append(Table(bins, np.array(rows[0]), np.array(rows[1])))
    return out


def g_statistics(counts_a: np.ndarray, counts_b: np.ndarray) -> np.ndarray:
    """G = 2 Σ O ln(O / E) of 2 × K tables, rows ``[..., K]`` (0 ln 0 = 0); returns ``[...]``."""
    totals = counts_a + counts_b
    n_a = counts_a.sum(-1, keepdims=True)
    n_b = counts_b.sum(-1, keepdims=True)
    n = n_a + n_b
    g = np.zeros(counts_a.shape[:-1])
    for observed, size in ((counts_a, n_a), (counts_b, n_b)):
        expected = size * totals / n
        with np.errstate(divide="ignore", invalid="ignore"):
            terms = np.where(observed > 0, observed * np.log(observed / expected), 0.0)
        g += terms.sum(-1)
    return 2 * g


def tv_rows(counts_a: np.ndarray, counts_b: np.ndarray) -> np.ndarray:
    """Total variation between the rows' empirical distributions, ``[..., K]`` → ``[...]``."""
    return 0.5 * np.abs(counts_a / counts_a.sum(-1, keepdims=True)
                        - counts_b / counts_b.sum(-1, keepdims=True)).sum(-1)


def sequential_p_value(exceeds: Callable[[int], np.ndarray], max_draws: int,
                       batch: int = BATCH) -> tuple[float, int]:
    """A Monte Carlo permutation p-value stopped sequentially (Besag & Clifford 1991):
    ``exceeds(size)`` draws ``size`` permuted statistics and says which are at least the
    observed one; stop at the draw l that brings the :data:`EXCEEDANCES`-th exceedance,
    p = h / l, else after ``max_draws``, p = (g + 1) / (max_draws + 1). Returns the
    p-value and the draws made."""
    exceed = drawn = 0
    while drawn < max_draws:
        found = exceeds(min(batch, max_draws - drawn))
        hits = np.flatnonzero(found)
        if exceed + len(hits) >= EXCEEDANCES:
            at = drawn + int(hits[EXCEEDANCES - exceed - 1]) + 1
            return EXCEEDANCES / at, at
        exceed, drawn = exceed + len(hits), drawn + len(found)
    return (exceed + 1) / (drawn + 1), drawn


def permutation_p_value(position_tables: Sequence[Table], observed: float,
                        rng: np.random.Generator, max_draws: int) -> tuple[float, int]:
    """The permutation p-value of a position's summed G (module docstring) and the draws
    it took."""
    def exceeds(size: int) -> np.ndarray:
        total = np.zeros(size)
        for table in position_tables:
            colours = table.counts_a + table.counts_b
            a = rng.multivariate_hypergeometric(colours, table.n_a, size=size)
            total += g_statistics(a, colours - a)
        return total >= observed - 1e-9 * max(1.0, observed)

    return sequential_p_value(exceeds, max_draws)


def position_test(position_tables: Sequence[Table], rng: np.random.Generator,
                  max_draws: int) -> tuple[float, float, int]:
    """A position's summed G, its permutation p-value and the draws it took."""
    statistic = float(sum(g_statistics(t.counts_a, t.counts_b) for t in position_tables))
    return (statistic, *permutation_p_value(position_tables, statistic, rng, max_draws))


def bootstrap_tv(position_tables: Sequence[Table], observed: float, rng: np.random.Generator
                 ) -> tuple[float, tuple[float, float]]:
    """The bias-corrected mean TV and its 95 % basic bootstrap interval (see
    :class:`PositionComparison`), resampling each row of each table from its own counts."""
    weights = np.array([t.effective for t in position_tables])
    draws = np.zeros((BOOTSTRAP, len(position_tables)))
    for i, table in enumerate(position_tables):
        a = rng.multinomial(table.n_a, table.counts_a / table.n_a, size=BOOTSTRAP)
        b = rng.multinomial(table.n_b, table.counts_b / table.n_b, size=BOOTSTRAP)
        draws[:, i] = tv_rows(a, b)
    means = draws @ weights / weights.sum()
    low, high = np.percentile(means, [2.5, 97.5])
    return (max(0.0, float(2 * observed - means.mean())),
            (max(0.0, float(2 * observed - high)), max(0.0, float(2 * observed - low))))


def hamming_mmd(samples_a: Sequence[Sample], samples_b: Sequence[Sample], num_tokens: int,
                rng: np.random.Generator, max_draws: int) -> MMDTest:
    """The MMD test with the Hamming kernel over the first ``num_tokens`` tokens (module
    docstring), padded after a sample's end; permutations stopped by
    :func:`sequential_p_value`."""
    n_a, n_b = len(samples_a), len(samples_b)
    if n_a < 2 or n_b < 2:
        return MMDTest(float("nan"), 1.0, 0)
    pad = object()
    codes = np.zeros((n_a + n_b, num_tokens), dtype=np.int64)
    sizes = []
    for j in range(num_tokens):
        index: dict = {}
        for i, sample in enumerate(list(samples_a) + list(samples_b)):
            token = sample[j] if j < len(sample) else pad
            codes[i, j] = index.setdefault(token, len(index))
        sizes.append(len(index))
    totals = [np.bincount(codes[:, j], minlength=sizes[j]) for j in range(num_tokens)]

    def statistic(in_a: np.ndarray) -> float:
        value = 0.0
        for j in range(num_tokens):
            a = np.bincount(codes[in_a, j], minlength=sizes[j]).astype(np.float64)
            b = totals[j] - a
            value += ((a @ a - n_a) / (n_a * (n_a - 1)) + (b @ b - n_b) / (n_b * (n_b - 1))
                      - 2 * (a @ b) / (n_a * n_b))
        return value / num_tokens

    labels = np.zeros(n_a + n_b, dtype=bool)
    labels[:n_a] = True
    observed = statistic(labels)
    p_value, drawn = sequential_p_value(
        lambda size: np.array([statistic(rng.permutation(labels)) >= observed - 1e-12
                               for _ in range(size)]), max_draws, batch=50)
    return MMDTest(float(observed), float(p_value), drawn)


def compare_prompt(samples_a: Sequence[Sample], samples_b: Sequence[Sample], num_tokens: int,
                   max_draws: int, index: int = 0, seed: int = 0) -> PromptComparison:
    """Every test of one prompt (undecided: :func:`~exactspec.audit.stats.decide` applies Holm).

    Args:
        samples_a, samples_b: the continuations (tokens, then
            :data:`~exactspec.audit.endpoint.END` where one stopped early).
        num_tokens: m, the positions tested.
        max_draws: the most permutations per position (≥ 20 / the smallest level at
            which a p-value will be compared).
        seed: seeds the permutations and the bootstrap.
    """
    rng = np.random.default_rng([seed, index])
    by_depth = tables(samples_a, samples_b, num_tokens)
    reach = [(sum(len(s) > j for s in samples_a), sum(len(s) > j for s in samples_b))
             for j in range(num_tokens)]
    positions = []
    for j in range(num_tokens):
        found = by_depth.get(j, [])
        if not found:
            positions.append(PositionComparison(j + 1, *reach[j], 0, 0.0, 0, 0.0, 1.0, 0,
                                                0.0, 0.0, (0.0, 0.0)))
            continue
        statistic, p_value, draws = position_test(found, rng, max_draws)
        effective = sum(t.effective for t in found)
        tv = float(sum(t.effective * t.tv() for t in found) / effective)
        positions.append(PositionComparison(
            j + 1, *reach[j], len(found), effective, sum(len(t.bins) - 1 for t in found),
            statistic, p_value, draws, tv, *bootstrap_tv(found, tv, rng)))
    first = (by_depth.get(0) or [None])[0]
    return PromptComparison(index, len(samples_a), len(samples_b), positions,
                            hamming_mmd(samples_a, samples_b, num_tokens, rng, max_draws), first)


def max_draws_for(alpha: float, num_tests: int) -> int:
    """Permutations enough to resolve p-values at Holm's first-step level:
    ``EXCEEDANCES / (alpha / num_tests)``, at least 1,000 (``num_tests``: positions and
    MMD tests together)."""
    return max(1000, int(np.ceil(EXCEEDANCES * max(1, num_tests) / alpha)))


@dataclass
class PowerEstimate:
    """The share of random half-size subsamples (of both sets) on which each test rejects
    at ``alpha``: the conditional tests (Holm over positions) and the MMD test."""

    subsamples: int
    size_a: int
    size_b: int
    conditional: float
    mmd: float
    alpha: float


def subsample_power(samples_a: Sequence[Sample], samples_b: Sequence[Sample], num_tokens: int,
                    alpha: float, subsamples: int = 10, seed: int = 0) -> PowerEstimate:
    """How often each test catches the difference between ``samples_a`` and ``samples_b``
    (a control's) on random halves of them: the two tests' power compared on the same
    samples."""
    rng = np.random.default_rng([seed, 7])
    half_a, half_b = len(samples_a) // 2, len(samples_b) // 2
    caught = [0, 0]
    for s in range(subsamples):
        a = [samples_a[i] for i in rng.choice(len(samples_a), half_a, replace=False)]
        b = [samples_b[i] for i in rng.choice(len(samples_b), half_b, replace=False)]
        p_values = [position_test(found, rng, max_draws_for(alpha, num_tokens))[1]
                    for found in tables(a, b, num_tokens).values()]
        caught[0] += any(holm(p_values, alpha))
        caught[1] += hamming_mmd(a, b, num_tokens, rng,
                                 max_draws_for(alpha, 1)).p_value <= alpha
    return PowerEstimate(subsamples, half_a, half_b, float(caught[0] / subsamples),
                         float(caught[1] / subsamples), alpha)
