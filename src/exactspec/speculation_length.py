"""Speculation-length policies: how many tokens to draft in the next cycle.

A policy only chooses k (0 = a plain decoding step: one-token forward, no draft call, except
auto's occasional peek at a free proposer, below); the
verification rule is untouched, so every policy keeps the target's distribution exactly.

    constant    always num_speculative_tokens.
    heuristic   transformers' schedule (``num_assistant_tokens_schedule="heuristic"``):
                +2 after a cycle whose drafts were all accepted, −1 otherwise, within
                [k_min, num_speculative_tokens].
    confidence  num_speculative_tokens, and a draft model stops drafting early once its own
                probability for the token it drafts falls below a threshold (llama.cpp's ``--draft-p-min``;
                transformers' ``assistant_confidence_threshold``; a draft head: the product
                of its drafted tokens' probabilities). Prompt lookup has no probabilities:
                it is refused there.
    auto        a cost model (the default). Online, per generator: the cost of a target
                forward over n = 1..num_speculative_tokens + 1 tokens and of a draft of
                k = 1..num_speculative_tokens tokens in a cycle after a drafting one (each
                the lower median of its last measurements, :class:`ForwardCost`;
                :meth:`AutoPolicy.draft_cost`), and per
                position i the acceptance α_i = P(draft i accepted | drafts < i accepted),
                from decaying counts (a position not tested yet takes the estimate of the
                position before it as its prior). Each cycle picks the k in
                0..num_speculative_tokens maximising expected committed tokens per second,
                    E(k) / (T(k+1) + D(k)),  E(k) = 1 + Σ_{j≤k} Π_{i≤j} α_i,
                Leviathan et al. 2022 (arXiv 2211.17192) §3.1, (1−α^(k+1))/(1−α) generalised
                to per-position α. A forward cost not measured yet comes from a straight
                line T(n) = a + b·n (b ≥ 0) fitted to the measured ones, or, while only one
                is measured, is scaled from it by a prior model
                (:data:`PRIOR_COST_PER_TOKEN`), so that every useful n gets tried and
                measured (the line matters on llama.cpp, where each extra token scored
                costs about half a plain step, unlike PyTorch); acceptance evidence decays
                every cycle, so after a run of k = 0 the prior (α = 0.5) returns and drafting
                is retried where that prior pays. Where it does not (llama.cpp), a proposer
                that costs no model call (prompt lookup) is asked, every
                :data:`PEEK_INTERVAL`-th plain step, for the one token it would draft; the
                token is never verified, but whether the plain step committed it is evidence
                for α_1 (for a point-mass draft, P(committed = d) = p(d) is exactly its
                acceptance probability), so drafting resumes when acceptance rises.
                Nothing it learns can lock it out of drafting: after
                :data:`PROBE_INTERVALS` plain steps in a row (16, then 32, 64, ... up to
                256) it *probes*, drafting the k in 1..num_speculative_tokens with the best
                expected rate, for every proposer (a suffix or prompt-lookup draft costs no model call; a
                model's, one draft step); the probe's acceptance and timing count as any
                cycle's, and a probe whose drafts were all accepted is followed at once by
                another (:data:`MAX_FOLLOW_UPS`). Forward costs are robust to noise and
                forgotten when not measured again (:class:`ForwardCost`).
                For a draft whose probabilities estimate its acceptance (a draft head),
                auto also sets the break-even probability below which it stops drafting
                (:meth:`AutoPolicy.break_even_confidence`).
"""

from __future__ import annotations

import itertools
import operator
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

DEFAULT_K = 4
"""num_speculative_tokens where a command or spec gives none."""
POLICIES = ("auto", "constant", "heuristic", "confidence")
DEFAULT_POLICY = "auto"
DEFAULT_MIN_CONFIDENCE = 0.4
"""transformers' default ``assistant_confidence_threshold``."""
PEEK_INTERVAL = 8
"""auto peeks at a free proposer's first token every this many plain steps (see above)."""
PROBE_INTERVALS = (16, 256)
"""auto's probes (see above): the first after this many plain steps in a row, each next one
after twice as many as the last, at most the second figure."""
MAX_FOLLOW_UPS = 3
"""A probe whose drafts were all accepted is followed by another, this many at most."""
COST_WINDOW = 3
"""Measurements kept per forward size (and of the draft's seconds per token); the estimate
is their lower median."""
COST_MAX_AGE = 256
"""Forwards after which a forward size not measured again is forgotten."""
PRIOR_COST_PER_TOKEN = 0.1
"""Before any timing is measured, auto assumes a forward over n tokens costs
1 + 0.1 (n − 1) single-token forwards (so drafting pays when α > 0.1)."""
PRIOR_ACCEPTANCE = 0.5
"""α_i assumed where nothing is measured (auto's prior; every position under the other
policies)."""


def survival(acceptance: Sequence[float]) -> list[float]:
    """``[len(acceptance)]`` Π_{i≤j} α_i for each position j: the probability that draft
    j + 1 is accepted (every draft before it was). Draft j + 1 adds this to the tokens a
    cycle commits in expectation, so a cycle drafting k commits
    E(k) = 1 + Σ_{j<k} survival[j] (Leviathan et al. 2022, §3.1, per position)."""
    return list(itertools.accumulate(acceptance, operator.mul))


class Choice(NamedTuple):
    """A policy's decision for the next cycle.

    Attributes:
        k: tokens to draft, in 0..num_speculative_tokens (0 = a plain step; the engine may
            lower it near a limit).
        peek: on a plain step, ask the proposer for the one token it would draft, never to
            verify it, only to learn whether the step committed it (see
            :meth:`SpeculationLengthPolicy.observe_peek`).
    """

    k: int
    peek: bool = False


class SpeculationLengthPolicy(Protocol):
    """Chooses k before each cycle and learns from what the cycle did. Policies subclass it
    to inherit the defaults."""

    name: str
    num_speculative_tokens: int
    follows_batch: bool = False
    """Under batched decoding, greedy and unseeded rows let the batch choose their k
    (:func:`batch_speculation_lengths` over every row's :meth:`acceptance`) and record it
    with :meth:`choice`; a policy without this chooses alone in a batch too."""
    min_confidence: float = 0.0
    """A proposer with probabilities of its own stops drafting once its probability for the
    token it would draft falls below this (0 = never; see
    :attr:`~exactspec.proposers.base.Proposer.supports_min_confidence`)."""

    def reset(self, timed: bool) -> None:
        """Start a new generation: forget what the previous one taught about the sequence
        (acceptance, schedule state). With ``timed`` False (seeded sampling) the choices
        must not depend on wall time at all, not even on timings measured in earlier
        generations, so that the choices, and with them the random draws, depend on the
        seed alone and a seed reproduces the output on any generator, fresh or reused."""
        ...

    def choose(self) -> Choice:
        """What the next cycle does: k, and whether a plain step peeks."""
        ...

    def observe(self, num_drafted: int, num_accepted: int, draft_seconds: float | None,
                verify_seconds: float | None) -> None:
        """What the cycle did: tokens drafted (may be fewer than k) and accepted, and the
        seconds spent drafting and verifying (forward over num_drafted + 1 tokens; None
        in an untimed generation, see :meth:`reset`)."""
        ...

    def observe_peek(self, committed_the_draft: bool) -> None:
        """After a plain step that peeked: whether it committed the peeked token (default:
        ignored)."""

    def acceptance(self) -> list[float]:
        """``[num_speculative_tokens]`` estimated α_i per 0-based position i (default: the prior,
        :data:`PRIOR_ACCEPTANCE`, everywhere)."""
        return [PRIOR_ACCEPTANCE] * self.num_speculative_tokens

    def choice(self, k: int) -> Choice:
        """The :class:`Choice` for ``k`` chosen by the batch (only for a policy that
        :attr:`follows_batch`)."""
        raise NotImplementedError(f"the {self.name} policy chooses k on its own")

    def draft_cost(self, k: int) -> float:
        """Seconds the proposer is expected to take to draft ``k`` tokens (default 0: not
        modelled); the batch weighs it when it chooses k (:func:`batch_speculation_lengths`)."""
        return 0.0


class ConstantPolicy(SpeculationLengthPolicy):
    """Always ``num_speculative_tokens``."""

    name = "constant"

    def __init__(self, num_speculative_tokens: int) -> None:
        self.num_speculative_tokens = num_speculative_tokens

    def reset(self, timed: bool) -> None:
        pass

    def choose(self) -> Choice:
        return Choice(self.num_speculative_tokens)

    def observe(self, num_drafted: int, num_accepted: int, draft_seconds: float | None,
                verify_seconds: float | None) -> None:
        pass


class HeuristicPolicy(SpeculationLengthPolicy):
    """+2 after a fully accepted cycle, −1 otherwise, within [k_min,
    num_speculative_tokens] (transformers' heuristic schedule); starts at num_speculative_tokens."""

    name = "heuristic"

    def __init__(self, num_speculative_tokens: int, k_min: int = 1) -> None:
        self.k_min = min(k_min, num_speculative_tokens)
        self.num_speculative_tokens = num_speculative_tokens
        self.k = num_speculative_tokens

    def reset(self, timed: bool) -> None:
        self.k = self.num_speculative_tokens

    def choose(self) -> Choice:
        return Choice(self.k)

    def observe(self, num_drafted: int, num_accepted: int, draft_seconds: float | None,
                verify_seconds: float | None) -> None:
        if num_drafted == 0:
            return
        step = 2 if num_accepted == num_drafted else -1
        self.k = max(self.k_min, min(self.num_speculative_tokens, self.k + step))


class ConfidencePolicy(ConstantPolicy):
    """``num_speculative_tokens`` drafts at most; a draft model stops early below
    ``min_confidence`` (the engine passes it to every ``propose`` call, see
    :class:`~exactspec.proposers.draft_model.DraftModelProposer`)."""

    name = "confidence"

    def __init__(self, num_speculative_tokens: int,
                 min_confidence: float = DEFAULT_MIN_CONFIDENCE) -> None:
        super().__init__(num_speculative_tokens)
        if not 0 < min_confidence < 1:
            raise ValueError(f"min_confidence = {min_confidence!r} is invalid: it must be in (0, 1)")
        self.min_confidence = min_confidence


class AutoPolicy(SpeculationLengthPolicy):
    """The cost model (see module docstring).

    Args:
        num_speculative_tokens: the longest draft considered.
        decay: weight kept by old acceptance evidence per cycle (0 < decay < 1).
        prior_acceptance, prior_weight: α_0's prior, worth ``prior_weight`` observations
            (α_i's prior is the estimate of α_(i−1)).
        peek: every :data:`PEEK_INTERVAL`-th plain step peeks (see the module docstring);
            only for a proposer that costs no model call
            (:attr:`~exactspec.proposers.base.Proposer.drafts_for_free`).
        probe: after :data:`PROBE_INTERVALS` plain steps in a row, draft anyway (see the
            module docstring); off only in tests of the other mechanisms.
        break_even: for a proposer whose confidence estimates that its draft so far is
            accepted (:attr:`~exactspec.proposers.base.Proposer.estimates_acceptance`, a
            draft head): each cycle sets ``min_confidence`` to the break-even probability
            of one more drafted token, its marginal seconds (drafting it, and the longer
            forward) times the committed tokens per second expected at the chosen k, so the
            draft stops where its own probabilities say one more token does not pay
            (EAGLE-2's confidence-driven draft length, from measured costs). A cycle whose
            draft stops before its first token counts as a first draft rejected: it paid
            for drafting and gained nothing, and acceptance measured over the drafts the
            gate let through alone would overstate what a drafting cycle gains.
    """

    name = "auto"
    follows_batch = True

    def __init__(self, num_speculative_tokens: int, decay: float = 0.97,
                 prior_acceptance: float = PRIOR_ACCEPTANCE,
                 prior_weight: float = 1.0, *,
                 peek: bool = False, probe: bool = True, break_even: bool = False) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.peek, self.probe, self.break_even = peek, probe, break_even
        self.decay, self.prior_acceptance, self.prior_weight = decay, prior_acceptance, prior_weight
        self.costs = ForwardCost(num_speculative_tokens + 1)
        self.draft_costs = ForwardCost(num_speculative_tokens, prior=float)  # D(k) (draft_cost)
        self.reset(timed=True)

    def reset(self, timed: bool) -> None:
        """Forget what the last generation taught about its text (acceptance evidence, the
        probe schedule): a new prompt. Measured costs are kept for later timed generations
        (they belong to the machine, not the text); an untimed one uses the prior cost
        model alone (docs/design.md, "What auto remembers")."""
        self.timed = timed
        self.plain_steps = 0  # plain steps chosen so far in this generation
        self.plain_run = 0  # plain steps in a row since the last cycle that drafted
        self.probe_interval = PROBE_INTERVALS[0]
        self.probing = 0  # the cycle under way is the n-th probe in a row (0: not a probe)
        self.drafted_before = False  # the cycle before the one under way drafted
        self.drafting = False  # the cycle under way drafts (k > 0)
        self.follow_ups = 0  # probes in a row so far, when the next choice is to probe again
        self.tested = [0.0] * self.num_speculative_tokens  # decayed count: position i was verified
        self.accepted = [0.0] * self.num_speculative_tokens  # decayed count: position i was accepted

    def acceptance(self) -> list[float]:
        """``[num_speculative_tokens]`` estimated α_i (0-based position i). Position 0's prior is
        ``prior_acceptance``; each later position's prior is the estimate of the one before
        it (acceptance is strongly correlated along a draft), so a position never tested
        yet is expected to do as well as the last one tested, not reset to the prior."""
        estimates, prior = [], self.prior_acceptance
        for accepted, tested in zip(self.accepted, self.tested):
            prior = (accepted + prior * self.prior_weight) / (tested + self.prior_weight)
            estimates.append(prior)
        return estimates

    def expected_rates(self) -> list[float]:
        """``[num_speculative_tokens + 1]`` expected committed tokens per second for
        k = 0..num_speculative_tokens drafts (per unit of the prior cost model while nothing
        is measured)."""
        rates, expected = [], 1.0
        for k, survive in enumerate([0.0, *survival(self.acceptance())]):
            expected += survive
            rates.append(expected / (self.forward_cost(k + 1) + self.draft_cost(k)))
        return rates

    def draft_cost(self, k: int) -> float:
        """D(k), seconds the proposer takes to draft ``k`` tokens (:class:`ForwardCost` over
        the drafting cycles that followed a drafting cycle: its lower median per k, a line
        a + b·k through the measured ks, proportional to k while one k is measured); 0 for
        k = 0, before any measurement and in an untimed generation. A draft after plain
        steps, or the first of a generation, is not measured: a proposer with state of its
        own (a draft head, a draft model) first catches up on every token committed since
        its last call (the whole prompt, a run of plain steps), work that grows with that
        run, not with k, and that would otherwise make drafting look dearer the longer auto
        has not drafted. The line's intercept is the part of a draft that does not grow with
        k (a draft head's pass over the last cycle's committed tokens)."""
        if not k or not self.timed or not self.draft_costs.fresh():
            return 0.0
        return self.draft_costs(k)

    @property
    def forward_seconds(self) -> list[float | None]:
        """``[num_speculative_tokens + 2]`` estimated seconds of a forward over n tokens
        (index n), None where never measured (:class:`ForwardCost`)."""
        return self.costs.seconds

    @forward_seconds.setter
    def forward_seconds(self, seconds: Sequence[float | None]) -> None:
        self.costs.seconds = list(seconds)

    def forward_cost(self, n: int) -> float:
        """Seconds of a target forward over n tokens (:class:`ForwardCost`), or in an untimed
        generation the prior in single-forward units."""
        return self.costs(n) if self.timed else prior_cost(n)

    def choose(self) -> Choice:
        if (self.timed and self.costs.measured(1) is None
                and any(self.costs.measured(n) is not None
                        for n in range(len(self.forward_seconds)))):
            k = 0  # measure the plain step, the baseline every k is compared with
        else:
            rates = self.expected_rates()
            k = max(range(self.num_speculative_tokens + 1), key=lambda k: (rates[k], -k))
        return self.choice(k)

    def probe_length(self) -> int:
        """The k of a probe: the best of 1..num_speculative_tokens by
        :meth:`expected_rates` (ties: the smaller), so that a probe costs least where drafting looks dear."""
        rates = self.expected_rates()
        return max(range(1, self.num_speculative_tokens + 1), key=lambda k: (rates[k], -k))

    def break_even_confidence(self, k: int) -> float:
        """The probability at which one more drafted token pays, at ``k`` drafts: its
        marginal cost in seconds (``forward_cost(k + 1) − forward_cost(k)`` and
        ``draft_cost(k) − draft_cost(k − 1)``) times the expected committed tokens per second
        at k; 0 for k = 0, at most 0.99."""
        if not k:
            return 0.0
        marginal = (max(self.forward_cost(k + 1) - self.forward_cost(k), 0.0)
                    + max(self.draft_cost(k) - self.draft_cost(k - 1), 0.0))
        return min(0.99, marginal * self.expected_rates()[k])

    def observe(self, num_drafted: int, num_accepted: int, draft_seconds: float | None,
                verify_seconds: float | None) -> None:
        # a probe whose every draft was accepted is followed by another (at most
        # MAX_FOLLOW_UPS in a row): one cycle's evidence may not outweigh the prior
        if self.probing and num_drafted and num_accepted == num_drafted \
                and self.probing <= MAX_FOLLOW_UPS:
            self.follow_ups = self.probing
        if verify_seconds is not None:
            self._observe_costs(num_drafted, draft_seconds or 0.0, verify_seconds)
        self.tested = [t * self.decay for t in self.tested]
        self.accepted = [a * self.decay for a in self.accepted]
        for i in range(min(num_accepted + 1, num_drafted)):  # positions that were verified
            self.tested[i] += 1
            self.accepted[i] += i < num_accepted
        if self.break_even and self.drafting and not num_drafted and self.num_speculative_tokens:
            # the draft stopped itself below the break-even probability before its first
            # token: that cycle paid for the draft and committed no draft, so it counts as a
            # first draft not accepted (α_1 is then per cycle that drafts, not per drafted
            # token, which the draft's own gate would bias upwards)
            self.tested[0] += 1

    def observe_peek(self, committed_the_draft: bool) -> None:
        """Evidence for α_1 from a plain step: whether it committed the token a free
        proposer would have drafted first (see the module docstring)."""
        self.tested[0] += 1
        self.accepted[0] += committed_the_draft

    def _observe_costs(self, num_drafted: int, draft_seconds: float,
                       verify_seconds: float) -> None:
        self.costs.observe(num_drafted + 1, verify_seconds)
        if num_drafted and self.drafted_before:  # a steady draft (draft_cost)
            self.draft_costs.observe(num_drafted, draft_seconds)

    def choice(self, k: int) -> Choice:
        """The :class:`Choice` for ``k`` (from :meth:`choose`, or chosen elsewhere: batched
        decoding's :func:`batch_speculation_lengths`): a plain step counts, may peek, and
        after :attr:`probe_interval` of them in a row becomes a probe (see the module
        docstring); a cycle that drafts by choice starts the probe schedule again."""
        follow_up, self.follow_ups = self.follow_ups, 0
        probing = False
        if k:
            self.plain_run, self.probe_interval = 0, PROBE_INTERVALS[0]
        elif (self.probe and self.num_speculative_tokens
              and (follow_up or self.plain_run >= self.probe_interval)):
            if not follow_up:
                self.probe_interval = min(2 * self.probe_interval, PROBE_INTERVALS[1])
            self.plain_run, probing = 0, True
            k = self.probe_length()
        self.probing = follow_up + 1 if probing else 0
        self.drafted_before, self.drafting = self.drafting, k > 0
        if self.break_even:
            self.min_confidence = self.break_even_confidence(k)
        if k:
            return Choice(k)
        self.plain_run += 1
        self.plain_steps += 1
        return Choice(0, peek=self.peek and (self.plain_steps - 1) % PEEK_INTERVAL == 0)


def prior_cost(n: int) -> float:
    """The prior cost of a forward over n tokens, in single-token forwards
    (:data:`PRIOR_COST_PER_TOKEN`)."""
    return 1.0 + PRIOR_COST_PER_TOKEN * (n - 1)


class ForwardCost:
    """Seconds of a target forward over n tokens (or of any work over n tokens: auto's
    drafts), learnt online and robust to noise: per n,
    the lower median of its last :data:`COST_WINDOW` measurements (one forward that took 3×
    its neighbours moves nothing once two others are measured), forgotten once
    :data:`COST_MAX_AGE` forwards have passed without measuring that n (so that no
    measurement, however disturbed, fixes a belief for the rest of the process). For an n
    without a fresh measurement: the least-squares line through the fresh ones (slope ≥ 0)
    when two or more are, the one fresh cost scaled by ``prior`` when one is, else the
    prior itself.

    Args:
        max_tokens: the largest n expected (a larger one is still measured).
        window: measurements kept per n.
        max_age: forwards after which an n's measurements are forgotten.
        prior: the cost of n tokens relative to other ns (default :func:`prior_cost`).
    """

    def __init__(self, max_tokens: int, window: int | None = None,
                 max_age: int | None = None,
                 prior: Callable[[int], float] | None = None) -> None:
        self.prior = prior_cost if prior is None else prior
        self.window = COST_WINDOW if window is None else window
        self.max_age = COST_MAX_AGE if max_age is None else max_age
        self.seconds: list[float | None] = [None] * (max_tokens + 1)  # index n = tokens scored
        """The current estimate per n (None: never measured); :meth:`measured` says
        whether it is still fresh."""
        self.observations = 0  # forwards measured so far
        self._recent: dict[int, deque[float]] = {}  # n → its last measurements
        self._stamp: dict[int, int] = {}  # n → the observation that last measured it

    def observe(self, n: int, seconds: float) -> None:
        """A forward over ``n`` tokens took ``seconds``."""
        self.observations += 1
        if n >= len(self.seconds):
            self.seconds += [None] * (n + 1 - len(self.seconds))
        if n not in self._recent or self._stale(n):
            self._recent[n] = deque(maxlen=self.window)
        self._recent[n].append(seconds)
        self._stamp[n] = self.observations
        self.seconds[n] = statistics.median_low(self._recent[n])

    def measured(self, n: int) -> float | None:
        """The fresh estimate for ``n`` tokens, None where none is (never measured, or
        forgotten)."""
        if n >= len(self.seconds) or self.seconds[n] is None or self._stale(n):
            return None
        return self.seconds[n]

    def fresh(self) -> list[tuple[int, float]]:
        """``(n, seconds)`` for every n with a fresh estimate (:meth:`measured`)."""
        return [(n, s) for n in range(len(self.seconds)) if (s := self.measured(n)) is not None]

    def _stale(self, n: int) -> bool:
        stamp = self._stamp.get(n)
        return stamp is not None and self.observations - stamp > self.max_age

    def __call__(self, n: int) -> float:
        if (seconds := self.measured(n)) is not None:
            return seconds
        known = self.fresh()
        if not known:
            return self.prior(n)
        if len(known) == 1:
            (m, seconds), = known
            return seconds * self.prior(n) / self.prior(m)
        mean_n = sum(m for m, _ in known) / len(known)
        mean_s = sum(s for _, s in known) / len(known)
        slope = max(0.0, sum((m - mean_n) * (s - mean_s) for m, s in known)
                    / sum((m - mean_n) ** 2 for m, _ in known))
        return max(mean_s + slope * (n - mean_n), 1e-9)


def batch_speculation_lengths(acceptances: Sequence[Sequence[float]], caps: Sequence[int],
                              cost: Callable[[int], float], fixed_tokens: int = 0,
                              fixed_expected: float = 0.0,
                              draft_costs: Sequence[Callable[[int], float]] | None = None,
                              shared_draft_cost: Callable[[int], float] | None = None,
                              fixed_longest: int = 0) -> list[int]:
    """The ``auto`` policy for a batch: each row's k maximising the batch's expected
    committed tokens per second when one forward scores every row.

    Row r drafting k_r tokens commits E_r(k_r) = 1 + Σ_{j≤k_r} Π_{i≤j} α_{r,i} tokens in
    expectation (:func:`survival`), and the forward scores
    N = Σ_r (k_r + 1) + ``fixed_tokens`` tokens, so the batch's rate is
    (Σ_r E_r(k_r) + ``fixed_expected``) / (cost(N) + Σ_r D_r(k_r) + S(max_r k_r)), D_r the
    seconds row r's proposer takes to draft k_r tokens on its own (one after another: the
    rows draft in turn), S the seconds of the drafting the rows share, a function of the
    longest draft (a draft model's forwards packed across rows: one per drafted position,
    :func:`~exactspec.batching.run_packed`). Each
    extra draft of row r adds the survival probability of its next position, which falls
    along the row (α ≤ 1), so the best allocation of m extra tokens takes the m largest of
    these gains over all rows; the m with the best rate wins (ties: the smaller). As the
    batch fills, cost(N) grows and m shrinks: speculation gives way to batching by itself.

    Args:
        acceptances: per row, ``[≥ caps[r]]`` estimated α_i (:meth:`AutoPolicy.acceptance`).
        caps: per row, the most tokens it may draft (≥ 0).
        cost: seconds (or any unit) of a forward over N tokens (:class:`ForwardCost`).
        fixed_tokens, fixed_expected: tokens scored and committed (expected) by rows whose
            k is chosen elsewhere.
        draft_costs: per row, D_r (:meth:`AutoPolicy.draft_cost`, in ``cost``'s unit);
            None: drafting is free.
        shared_draft_cost: S (in ``cost``'s unit; None: none).
        fixed_longest: the longest draft of the rows whose k is chosen elsewhere (S's
            argument is at least this).
    Returns:
        ``[len(caps)]`` k per row.
    """
    gains = []  # (gain, row, its draft's seconds) per possible extra draft, in falling order
    for row, (alphas, cap) in enumerate(zip(acceptances, caps)):
        draft = draft_costs[row] if draft_costs is not None else (lambda k: 0.0)
        gains += [(survive, row, draft(j + 1) - draft(j))
                  for j, survive in enumerate(survival(alphas[:cap]))]
    gains.sort(key=lambda item: -item[0])  # stable: a row's gains stay in order
    shared = shared_draft_cost or (lambda k: 0.0)
    base_tokens = len(caps) + fixed_tokens
    expected, drafting, longest = len(caps) + fixed_expected, 0.0, fixed_longest
    best_rate, best_m = expected / (cost(base_tokens) + shared(longest)), 0
    ks = [0] * len(caps)
    for m, (gain, row, seconds) in enumerate(gains, start=1):
        expected += gain
        drafting += seconds
        ks[row] += 1
        longest = max(longest, ks[row])
        rate = expected / (cost(base_tokens + m) + drafting + shared(longest))
        if rate > best_rate:
            best_rate, best_m = rate, m
    ks = [0] * len(caps)
    for _, row, _ in gains[:best_m]:
        ks[row] += 1
    return ks


def make_policy(name: str, num_speculative_tokens: int, drafts_for_free: bool = False,
                estimates_acceptance: bool = False) -> SpeculationLengthPolicy:
    """The policy called ``name`` (one of :data:`POLICIES`) for drafts of at most
    ``num_speculative_tokens``; ``drafts_for_free``: the proposer costs no model call, so ``auto`` peeks at it;
    ``estimates_acceptance``: its confidence estimates acceptance, so ``auto`` stops it at
    the break-even probability (:class:`AutoPolicy`).

    Raises:
        ValueError: for an unknown name.
    """
    if name == "auto":
        return AutoPolicy(num_speculative_tokens, peek=drafts_for_free,
                          break_even=estimates_acceptance)
    policies = {"constant": ConstantPolicy, "heuristic": HeuristicPolicy,
                "confidence": ConfidencePolicy}
    if name not in policies:
        raise ValueError(f"speculation-length policy {name!r} is invalid: choose one of "
                         f"{', '.join(POLICIES)}")
    return policies[name](num_speculative_tokens)
