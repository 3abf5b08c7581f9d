"""Speculation-length policies: their logic on synthetic traces, and exactness under them."""

import random
from collections import Counter

import pytest

from exactspec import (DraftModelProposer, PromptLookupProposer, SamplingParams,
                       SpeculativeGenerator)
from exactspec.audit import (BROKEN_VERIFIERS, BrokenGenerator, ExactspecEngine,
                             audit_distribution)
from exactspec.proposers.base import Proposer
from exactspec.speculation_length import (AutoPolicy, ConfidencePolicy, HeuristicPolicy,
                                          make_policy)

from conftest import RandomProposer, ScriptedProposer, perturbed_backend, tiny_backend


def run_trace(policy, cycles, alpha, forward_seconds, draft_seconds_per_token=0.0):
    """Feed ``cycles`` cycles in which each drafted position is accepted with probability
    ``alpha`` (seeded), with the given forward and draft costs; return the chosen ks."""
    rng = random.Random(0)
    chosen = []
    for _ in range(cycles):
        k = policy.choose().k
        chosen.append(k)
        accepted = 0
        while accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe(k, accepted, k * draft_seconds_per_token, forward_seconds(k + 1))
    return chosen


def test_auto_settles_on_plain_decoding_when_nothing_is_accepted():
    chosen = run_trace(AutoPolicy(8), 30, alpha=0.0, forward_seconds=lambda n: 0.1 + 0.01 * n)
    assert chosen[0] > 0 and chosen[-10:].count(0) >= 8


def test_auto_grows_k_with_high_acceptance_and_cheap_verification():
    chosen = run_trace(AutoPolicy(8), 40, alpha=1.0, forward_seconds=lambda n: 0.1 + 0.002 * n)
    assert chosen[0] == 2 and min(chosen[-10:]) >= 6  # from the prior's choice up to ~num_speculative_tokens


def test_auto_keeps_k_small_when_verification_is_expensive():
    # each extra scored token costs as much as a whole forward: speculation cannot pay
    chosen = run_trace(AutoPolicy(8), 40, alpha=0.6, forward_seconds=lambda n: 0.1 * n)
    assert max(chosen[-10:]) == 0


def test_auto_counts_the_draft_cost():
    cheap = run_trace(AutoPolicy(6), 40, alpha=0.7, forward_seconds=lambda n: 0.1 + 0.005 * n)
    costly = run_trace(AutoPolicy(6), 40, alpha=0.7, forward_seconds=lambda n: 0.1 + 0.005 * n,
                       draft_seconds_per_token=0.08)
    assert sum(costly[-10:]) < sum(cheap[-10:])


def test_auto_does_not_charge_a_drafter_s_catch_up_to_its_drafted_tokens():
    # a stateful drafter (a draft head) first processes every token committed since its
    # last call: the whole prompt in a generation's first draft, a run of plain steps
    # after them; that work grows with the run, not with k, and must not be taken for the
    # cost of drafted tokens (else the longer auto waits, the dearer drafting looks)
    policy, rng = AutoPolicy(4), random.Random(0)
    per_caught_up, per_drafted, forward = 0.002, 0.001, (lambda n: 0.1 + 0.005 * n)
    pending, chosen = 100, []  # tokens the drafter has not seen: the prompt
    for _ in range(60):
        k = policy.choose().k
        chosen.append(k)
        accepted = 0
        while accepted < k and rng.random() < 0.7:
            accepted += 1
        draft_seconds = (pending * per_caught_up + k * per_drafted) if k else 0.0
        pending = (0 if k else pending) + accepted + 1
        policy.observe(k, accepted, draft_seconds, forward(k + 1))
    # steady drafting cycles catch up on accepted + 1 tokens: ≈ 0.006 s per drafted token
    assert policy.draft_cost(4) < 0.04
    assert chosen[-20:].count(0) <= 2


def test_auto_models_a_draft_as_a_fixed_part_and_a_part_per_drafted_token():
    policy = AutoPolicy(4)
    assert policy.draft_cost(3) == 0.0  # nothing measured: drafting assumed free
    policy.choice(1)
    policy.observe(1, 0, 0.5, 0.1)  # the first draft (a catch-up): not measured
    assert policy.draft_cost(1) == 0.0
    for k in (2, 3, 4, 1, 2, 3, 4):
        policy.choice(k)
        policy.observe(k, 0, 0.03 + 0.002 * k, 0.1)
    for k in range(1, 5):
        assert policy.draft_cost(k) == pytest.approx(0.03 + 0.002 * k)
    assert policy.draft_cost(0) == 0.0
    policy.draft_costs = type(policy.draft_costs)(4, prior=float)
    policy.choice(2)
    policy.observe(2, 0, 0.01, 0.1)  # one k measured: the others in proportion
    assert policy.draft_cost(4) == pytest.approx(0.02)
    policy.reset(timed=False)
    assert policy.draft_cost(4) == 0.0  # seeded sampling: no wall time


def test_auto_retries_drafting_after_a_run_of_plain_steps():
    policy = AutoPolicy(4)
    run_trace(policy, 20, alpha=0.0, forward_seconds=lambda n: 0.1 + 0.01 * n)
    assert policy.choose().k == 0
    for _ in range(120):  # plain steps: evidence decays back to the prior
        policy.observe(0, 0, 0.0, 0.11)
    assert policy.choose().k > 0


def test_auto_without_timings_uses_the_prior_and_acceptance_alone():
    policy = AutoPolicy(4)
    for _ in range(30):
        policy.observe(policy.choose().k, 0, None, None)
    assert policy.choose().k == 0 and policy.forward_seconds == [None] * 6


def test_heuristic_schedule():
    policy = HeuristicPolicy(num_speculative_tokens=6, k_min=1)
    ks = []
    for accepted_all in (False, False, True, True, True, False):
        k = policy.choose().k
        ks.append(k)
        policy.observe(k, k if accepted_all else 0, 0.0, 0.1)
    assert ks == [6, 5, 4, 6, 6, 6] and policy.choose().k == 5
    for _ in range(10):
        policy.observe(policy.choose().k, 0, 0.0, 0.1)
    assert policy.choose().k == 1


def test_bad_policy_names_and_confidence_misuse():
    with pytest.raises(ValueError, match="policy 'fast' is invalid"):
        make_policy("fast", 4)
    with pytest.raises(ValueError, match="needs a proposer with probabilities"):
        SpeculativeGenerator(tiny_backend(0), PromptLookupProposer(), 4, "confidence")
    with pytest.raises(ValueError, match="min_confidence"):
        ConfidencePolicy(4, 1.5)


def test_confidence_stops_the_draft_early():
    target = tiny_backend(0)
    params = SamplingParams(max_new_tokens=20)
    prompt = [1, 2, 3, 4, 5]
    drafted = {}
    for threshold in (0.0, 0.3):
        proposer = DraftModelProposer(tiny_backend(1), target)
        policy = ConfidencePolicy(4, threshold) if threshold else "constant"
        generator = SpeculativeGenerator(target, proposer, 4, policy)
        drafted[threshold] = generator.generate(prompt, params).stats.drafted_tokens
    assert drafted[0.3] < drafted[0.0]


@pytest.mark.parametrize("policy", ["auto", "heuristic", "confidence"])
def test_greedy_identity_under_every_policy(policy):
    target = tiny_backend(0)
    params = SamplingParams(max_new_tokens=40)
    plain = SpeculativeGenerator(target, None).generate([3, 1, 4, 1, 5], params).token_ids
    for proposer in (DraftModelProposer(tiny_backend(2), target), ScriptedProposer([3, 1, 4, 1, 5] + plain)):
        if policy == "confidence" and not proposer.supports_min_confidence:
            continue
        result = SpeculativeGenerator(target, proposer, 4, policy).generate([3, 1, 4, 1, 5], params)
        assert result.token_ids == plain
        assert sum(result.stats.chosen_k_histogram) == result.stats.cycles


def counted(proposer):
    """``proposer`` with its ``propose`` calls counted in ``proposer.calls``."""
    proposer.calls, propose = 0, proposer.propose

    def counting(*args):
        proposer.calls += 1
        return propose(*args)
    proposer.propose = counting
    return proposer


def plain_steps_only(peek: bool = False) -> AutoPolicy:
    """An auto policy (num_speculative_tokens 4) that always chooses k = 0: scoring 2 or more tokens costs
    10⁴ plain steps."""
    policy = AutoPolicy(4, peek=peek, probe=False)
    policy.forward_seconds[1:] = [0.01, 100.0, 100.0, 100.0, 100.0]
    return policy


def test_k_zero_calls_no_proposer():
    counted_proposer = counted(RandomProposer())
    result = SpeculativeGenerator(tiny_backend(0), counted_proposer, 4, plain_steps_only()).generate(
        [1, 2], SamplingParams(max_new_tokens=10))
    assert counted_proposer.calls == 0 and result.stats.chosen_k_histogram[0] == 10


@pytest.mark.parametrize("broken", [None, *BROKEN_VERIFIERS])
def test_distribution_test_passes_under_auto_with_varying_k(broken):
    """auto changes k from cycle to cycle (acceptance-driven) with a draft model that agrees
    often: drafts are accepted at every block position, and every position of the committed
    tokens follows the target exactly (the audit's per-position test with Holm, 4 tokens
    per sample). The broken verifiers under auto must be caught."""
    target = tiny_backend(0)
    policy = AutoPolicy(3)
    policy.forward_seconds = [None, 0.1, 0.104, 0.108, 0.112]  # cheap verification
    chosen, choose = Counter(), policy.choose

    def counting_choose():
        choice = choose()
        chosen[choice.k] += 1
        return choice

    policy.choose = counting_choose
    proposer = DraftModelProposer(perturbed_backend(target, noise=0.03), target)
    generator = (BrokenGenerator(target, proposer, 3, policy, broken=broken) if broken
                 else SpeculativeGenerator(target, proposer, 3, policy))
    params = SamplingParams(temperature=0.8, top_k=12, seed=0, max_new_tokens=4)
    test = audit_distribution(target, ExactspecEngine(generator, "auto"),
                              [[1, 2, 3, 1, 2, 3, 1, 2], [7, 8, 7, 8, 7]], params, 500, 0.01)
    assert test.rejected == (broken is not None), [p.positions for p in test.prompts]
    if not broken:
        assert sum(n >= 0.05 * chosen.total() for n in chosen.values()) >= 2, chosen  # k varies
        assert min(test.accepted_per_position) >= 30, (test.accepted_per_position, chosen)


def test_unmeasured_costs_come_from_a_line_through_the_measured_ones():
    """llama.cpp-like costs: each extra token scored costs ~0.47 of a plain step. Measured
    at n = 1 and 9 only, n = 2..8 are interpolated (the prior's 0.1 per token would make
    drafting look cheap), and at α = 0.4 auto keeps to plain steps."""
    policy = AutoPolicy(8)
    policy.forward_seconds[1], policy.forward_seconds[9] = 0.016, 0.076
    assert policy.forward_cost(2) == pytest.approx(0.0235)
    assert policy.forward_cost(5) == pytest.approx(0.046)
    policy.tested, policy.accepted = [100.0] * 8, [40.0] * 8
    assert policy.choose().k == 0
    policy.accepted = [90.0] * 8  # high acceptance pays even at these costs
    assert policy.choose().k > 0
    policy.forward_seconds[3] = 0.010  # a measured dip never gives a negative slope
    assert policy.forward_cost(2) > 0 and policy.forward_cost(4) >= policy.forward_cost(3)


def test_peeks_at_a_free_proposer_resume_drafting_when_acceptance_rises():
    """llama.cpp-like costs: the prior α = 0.5 does not pay, so auto stays at k = 0; plain
    steps that commit the token the free proposer would have drafted are evidence for α_1,
    and drafting resumes."""
    policy = AutoPolicy(4)
    policy.forward_seconds[1:6] = [0.016, 0.028, 0.036, 0.044, 0.053]
    assert policy.choose().k == 0
    for _ in range(16):
        policy.observe(0, 0, None, None)
        policy.observe_peek(True)
    assert policy.choose().k > 0
    for _ in range(200):
        policy.observe(0, 0, None, None)
        policy.observe_peek(False)
    assert policy.choose().k == 0


def test_a_free_proposer_is_peeked_at_every_eighth_plain_step_and_never_verified():
    from exactspec.speculation_length import PEEK_INTERVAL

    target = tiny_backend(0)
    params = SamplingParams(max_new_tokens=20)
    plain = SpeculativeGenerator(target, None).generate([1, 2, 3], params).token_ids

    oracle = counted(ScriptedProposer([1, 2, 3] + plain))
    oracle.drafts_for_free = True
    policy = plain_steps_only(peek=True)
    result = SpeculativeGenerator(target, oracle, 4, policy).generate([1, 2, 3], params)
    assert result.token_ids == plain and result.stats.drafted_tokens == 0
    assert oracle.calls == -(-20 // PEEK_INTERVAL)  # plain steps 0, 8, 16
    assert policy.tested[0] > 0 and policy.accepted[0] == policy.tested[0]  # oracle: all hits


def test_auto_sets_the_break_even_confidence_of_a_draft_that_estimates_its_acceptance():
    """With ``break_even`` (a draft head), each choice sets min_confidence to one more
    token's marginal seconds times the expected tokens per second at the chosen k."""
    forward = lambda n: 0.1 + 0.004 * n  # noqa: E731
    policy = AutoPolicy(5, break_even=True)
    chosen = run_trace(policy, 30, alpha=0.8, forward_seconds=forward,
                       draft_seconds_per_token=0.01)
    k = policy.choose().k
    assert k > 0 and min(chosen[-10:]) > 0
    expected = (policy.forward_cost(k + 1) - policy.forward_cost(k)
                + policy.draft_cost(k) - policy.draft_cost(k - 1)) * policy.expected_rates()[k]
    assert policy.min_confidence == pytest.approx(expected)
    assert 0.05 < policy.min_confidence < 0.5
    costly = AutoPolicy(5, break_even=True)
    run_trace(costly, 30, alpha=0.8, forward_seconds=forward, draft_seconds_per_token=0.03)
    costly.choose()
    assert costly.min_confidence > policy.min_confidence  # dearer drafts stop earlier
    untimed = AutoPolicy(5, break_even=True)
    untimed.reset(timed=False)  # seeded sampling: the prior costs, no wall time
    k = untimed.choose().k
    assert untimed.min_confidence == pytest.approx(0.1 * untimed.expected_rates()[k])
    plain = AutoPolicy(5)
    run_trace(plain, 30, alpha=0.8, forward_seconds=forward, draft_seconds_per_token=0.01)
    plain.choose()
    assert plain.min_confidence == 0.0


def test_auto_counts_a_draft_its_gate_stopped_before_the_first_token_as_rejected():
    """A draft head that drafts nothing in a cycle auto chose to draft (its confidence
    below the break-even probability) paid for drafting and gained nothing: α_1 counts it as
    a first draft tested and not accepted. Without the gate (prompt lookup finding no match:
    no cost) and on plain steps nothing is counted."""
    for break_even in (True, False):
        policy = AutoPolicy(4, break_even=break_even, probe=False)
        policy.choice(2)
        policy.observe(2, 2, None, None)  # a cycle that drafted 2, both accepted
        before = policy.acceptance()[0]
        policy.choice(2)
        policy.observe(0, 0, None, None)  # chose 2, drafted nothing
        policy.choice(0)
        policy.observe(0, 0, None, None)  # a plain step
        tested = 0.97 ** 2 + (0.97 if break_even else 0.0)
        assert policy.tested[0] == pytest.approx(tested)
        assert policy.accepted[0] == pytest.approx(0.97 ** 2)
        prior = policy.prior_acceptance * policy.prior_weight
        assert policy.acceptance()[0] == pytest.approx(
            (0.97 ** 2 + prior) / (tested + policy.prior_weight))
        assert (policy.acceptance()[0] < 0.9 * before) == break_even


# --- issue 40: auto never locks itself out of drafting -----------------------------------

def noisy_then_true(policy, noisy_cycles, true_cycles, alpha, cost, noise=10.0):
    """``noisy_cycles`` cycles where every forward over 2+ tokens is measured ``noise``×
    dearer (another process on the core) and nothing is accepted, then ``true_cycles`` at
    the true ``cost`` with acceptance ``alpha`` per position (seeded); the chosen ks."""
    rng, chosen = random.Random(0), []
    for cycle in range(noisy_cycles + true_cycles):
        noisy = cycle < noisy_cycles
        k = policy.choose().k
        chosen.append(k)
        accepted = 0
        while not noisy and accepted < k and rng.random() < alpha:
            accepted += 1
        policy.observe(k, accepted, 0.0, cost(k + 1) * (noise if noisy and k else 1.0))
    return chosen


def test_a_disturbed_stretch_never_locks_auto_out_of_drafting():
    """The runs of issue 40: a stretch where drafting did not pay (here: forwards of 2+
    tokens measured 10× dearer, nothing accepted), then text where it pays (α = 0.9,
    verification nearly free). Before the fix auto chose k = 0 for every later cycle (its
    beliefs about the dear forwards were never measured again)."""
    cost = lambda n: 0.010 + 0.0004 * (n - 1)  # noqa: E731  native kernels: 5 tokens 1.16×
    chosen = noisy_then_true(AutoPolicy(4), 40, 400, alpha=0.9, cost=cost)
    assert chosen[:40].count(0) >= 30  # it did lock onto plain steps while disturbed
    assert chosen[-100:].count(0) <= 10 and sum(chosen[-100:]) >= 250, chosen[-100:]


def test_probes_come_at_growing_intervals_and_stop_costing_where_nothing_pays():
    """Where drafting never pays (llama.cpp-like costs, nothing accepted) the probes come
    after 16, 32, 64, 128, 256, 256 ... plain steps: a bounded share of the cycles."""
    cost = lambda n: 0.010 * (1 + 0.75 * (n - 1))  # noqa: E731
    policy = AutoPolicy(4)
    chosen = run_trace(policy, 2000, alpha=0.0, forward_seconds=cost)
    drafting = [i for i, k in enumerate(chosen) if k]
    gaps = [b - a for a, b in zip(drafting, drafting[1:])]
    assert gaps[-3:] == [257, 257, 257]  # 256 plain steps, then the probe
    assert len(drafting) < 20 and all(chosen[i] == 1 for i in drafting[-5:])  # the cheapest
    assert all(g2 >= g1 for g1, g2 in zip(gaps[3:], gaps[4:]))


def test_a_probe_that_finds_acceptance_restarts_drafting_and_its_schedule():
    cost = lambda n: 0.010 * (1 + 0.75 * (n - 1))  # noqa: E731  pays only at high α
    policy = AutoPolicy(4)
    run_trace(policy, 300, alpha=0.0, forward_seconds=cost)
    assert policy.probe_interval > 16
    chosen = run_trace(policy, 300, alpha=1.0, forward_seconds=cost)  # a probe at ~500
    assert chosen[-20:] == [4] * 20 and policy.probe_interval == 16


def test_forward_costs_are_robust_to_one_outlier_and_forgotten_when_stale():
    from exactspec.speculation_length import ForwardCost

    costs = ForwardCost(8, window=3, max_age=50)
    for seconds in (0.011, 0.033, 0.012):  # one forward took 3× its neighbours
        costs.observe(5, seconds)
    assert costs(5) == 0.012  # the median: the outlier moves nothing
    costs.observe(1, 0.010)
    for _ in range(50):
        costs.observe(1, 0.010)
    assert costs.measured(5) is None  # 51 forwards without n = 5: forgotten
    assert costs(5) == pytest.approx(0.010 * (1 + 0.4))  # the prior's scaling of T(1)
    costs.observe(5, 0.020)  # measured anew: the old measurements do not come back
    assert costs(5) == 0.020


def test_one_slow_draft_does_not_make_drafting_look_dear():
    """The bench's case (results/auto-probes-2026-12-03): a suffix draft of 4 tokens slowed
    180 ms by a pause, among drafts of 0.05 ms a token, on costs where k = 4 pays. With a
    moving average of the draft cost, auto chose k = 0 for most of the request."""
    policy = AutoPolicy(4, probe=False)
    forward = lambda n: 0.033 + 0.0015 * (n - 1)  # noqa: E731 (the bench's forward costs)
    run_trace(policy, 10, alpha=0.5, forward_seconds=forward, draft_seconds_per_token=5e-5)
    assert policy.choose().k >= 1
    policy.observe(1, 0, 0.180, forward(2))  # the slow draft (one token, rejected)
    chosen = run_trace(policy, 20, alpha=0.5, forward_seconds=forward,
                       draft_seconds_per_token=5e-5)
    assert min(chosen) >= 1 and policy.draft_cost(1) < 1e-4


def test_a_reused_generator_drafts_again_after_a_disturbed_request(monkeypatch):
    """A real generator (tiny model, prompt lookup, auto) on a clock the test controls: a
    forward over n tokens costs 1 ms + 0.05 ms per extra token, except during the first
    request, when forwards of 2+ tokens cost 10 ms. The second request's prompt repeats
    itself, so prompt lookup's drafts are accepted; auto must draft there (it chose k = 0
    for the whole request before the fix)."""
    import types

    import exactspec.generator as engine
    import exactspec.request as request

    clock = types.SimpleNamespace(now=0.0, disturbed=True)
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock.now)
    monkeypatch.setattr(engine, "time", fake_time)
    monkeypatch.setattr(request, "time", fake_time)
    target = tiny_backend(0)
    forward = target.forward

    def timed_forward(rows, num_logits=None):
        n = sum(len(ids) for _, ids in rows)
        clock.now += 0.010 if clock.disturbed and n > 1 else 0.001 + 0.00005 * (n - 1)
        return forward(rows, num_logits)

    monkeypatch.setattr(target, "forward", timed_forward)
    params = SamplingParams(max_new_tokens=120)
    plain = SpeculativeGenerator(target, None).generate([3, 1, 4, 1, 5], params).token_ids
    oracle, wrong = ScriptedProposer([3, 1, 4, 1, 5] + plain), RandomProposer()

    class OracleOrWrong(Proposer):  # the oracle where it knows the text, else random drafts
        def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
            return (oracle.propose(token_ids, k, pipeline, rng)
                    or wrong.propose(token_ids, k, pipeline, rng))

    generator = SpeculativeGenerator(target, OracleOrWrong(), 4)
    first = generator.generate([9, 2, 6, 5, 3], params)  # drafts rejected, forwards dear
    assert 0 < first.stats.drafted_tokens and first.stats.chosen_k_histogram[0] > 80
    clock.disturbed = False
    second = generator.generate([3, 1, 4, 1, 5], params)
    assert second.token_ids == plain
    assert second.stats.accepted_tokens >= 60, second.stats.chosen_k_histogram
