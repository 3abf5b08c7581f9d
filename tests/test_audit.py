"""The exactness audit: its statistics are calibrated, it passes correct engines and
catches every broken control, on a tiny model at fixed seeds."""

import dataclasses

import numpy as np
import pytest

from exactspec import (DraftModelProposer, EarlyExitProposer, PromptLookupProposer,
                       SamplingParams, SpeculativeGenerator)
from exactspec.audit import (BROKEN_VERIFIERS, AuditResult, BrokenGenerator, ExactspecEngine,
                             TransformersGenerateEngine, audit_distribution, check_greedy,
                             exact_reference, verdict, write_audit_report)
from exactspec.audit.reference import OTHER
from exactspec.audit.stats import detectable_tv, goodness_of_fit, holm, pool_bins
from exactspec.logits_pipeline import LogitsPipeline

from conftest import tiny_backend

PARAMS = SamplingParams(temperature=0.8, top_k=12, top_p=0.95, seed=0, max_new_tokens=3)
SAMPLES = 500
ALPHA = 0.01


def lookup_friendly_prompt(target, head, middle):
    """``[head, x, *middle, head]`` with x the token the model most expects next: prompt
    lookup then drafts x first, a token the target often accepts (a random drafted token
    would almost never be accepted, and the broken controls would change nothing)."""
    def p_next(x):
        prompt = [head, x, *middle, head]
        target.prefill(prompt[:-1])
        return float(target.forward(prompt[-1:])[0].softmax(-1)[x])
    x = max(range(target.vocab_size), key=p_next)
    return [head, x, *middle, head]


@pytest.fixture(scope="module")
def target():
    return tiny_backend(0)


@pytest.fixture(scope="module")
def prompts(target):
    return [lookup_friendly_prompt(target, 1, [2, 3, 4]),
            lookup_friendly_prompt(target, 5, [6, 7, 8, 9])]


def binned(probs, counts_per_outcome, num_samples):
    bins = pool_bins(probs, num_samples)
    exact = np.bincount(bins, weights=probs)
    counts = np.bincount(bins, weights=counts_per_outcome, minlength=len(exact))
    return counts, exact


def test_false_alarm_rate_is_calibrated():
    """Many audits (3 prompts each, Holm) of a correct sampler on random distributions:
    the family-wise rejection rate stays near alpha."""
    rng = np.random.default_rng(0)
    alpha, audits, n = 0.05, 400, 500
    rejections = 0
    for _ in range(audits):
        p_values = []
        for _ in range(3):
            probs = rng.dirichlet(np.full(30, 0.4))
            counts, exact = binned(probs, rng.multinomial(n, probs), n)
            p_values.append(goodness_of_fit(counts, exact, bootstrap=0).p_value)
        rejections += any(holm(p_values, alpha))
    assert 0.02 <= rejections / audits <= 0.085  # ±3 σ around 0.05


def test_detectable_deviation_is_detected_with_the_stated_power():
    """A deviation of exactly the reported detectable TV, in the hardest direction, is
    caught about 80 % of the time; half of it much less often (so the figure means something)."""
    rng = np.random.default_rng(1)
    probs = np.array([0.3, 0.25, 0.15, 0.1, 0.1, 0.05, 0.05])
    n, alpha = 600, 0.01
    tv = detectable_tv(probs, n, alpha)
    assert 0 < tv < 0.2

    def power(shift):
        shifted = probs.copy()
        shifted[0] += shift
        shifted[1] -= shift
        hits = [goodness_of_fit(rng.multinomial(n, shifted), probs, bootstrap=0).p_value < alpha
                for _ in range(300)]
        return np.mean(hits)

    assert 0.68 <= power(tv) <= 0.92
    assert power(tv / 2) < 0.4


def test_pooling_and_zero_probability_outcomes():
    bins = pool_bins([0.5, 0.3, 0.19, 0.005, 0.005], 100)
    assert list(bins) == [0, 1, 2, 2, 2]  # the 1-sample remainder merges into the smallest bin
    assert goodness_of_fit([10, 0, 1], [0.9, 0.1, 0.0]).p_value == 0.0
    with pytest.raises(ValueError, match="no samples"):
        goodness_of_fit([0, 0], [0.5, 0.5])


def test_holm_step_down():
    assert holm([0.01, 0.04, 0.03, 0.005], 0.05) == [True, False, False, True]
    assert holm([0.04, 0.04], 0.05) == [False, False]
    assert holm([0.02, 0.04], 0.05) == [True, True]


def test_reference_matches_brute_force_enumeration(target, prompts):
    params = SamplingParams(temperature=0.9, top_k=6, max_new_tokens=2)
    prompt = prompts[0]
    pipeline = LogitsPipeline(params, prompt, target.vocab_size, (), [], target.device)
    reference = exact_reference(target, prompt, pipeline, 2, num_samples=2000)

    def probs_after(context):
        target.prefill(context[:-1])
        return pipeline.probs(pipeline.process(target.forward(context[-1:]), context))[0]

    first = probs_after(prompt)
    brute = {}
    for t1 in first.nonzero().flatten().tolist():
        second = probs_after(prompt + [t1])
        for t2 in second.nonzero().flatten().tolist():
            brute[(t1, t2)] = float(first[t1]) * float(second[t2])
    assert abs(sum(brute.values()) - 1) < 1e-6
    listed = {k: v for k, v in reference.outcomes.items() if k != OTHER}
    # rel 1e-5: float32 logits of a 2-token forward vs prefill + 1-token forward round apart
    assert listed == pytest.approx({k: brute[k] for k in listed}, rel=1e-5)
    assert set(listed) == {k for k, v in brute.items() if v * 2000 >= 5}
    assert reference.outcomes[OTHER] == pytest.approx(1 - sum(listed.values()), abs=1e-9)


PROPOSERS = {
    "prompt-lookup": lambda target: PromptLookupProposer(1, 3),
    "draft-model": lambda target: DraftModelProposer(tiny_backend(5), target),
    "early-exit": lambda target: EarlyExitProposer(target, 1),
}


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_audit_passes_exactspec_and_catches_each_broken_control(proposer, target, prompts):
    make = PROPOSERS[proposer]
    # constant k: this test is about the verifier; exactness under "auto" is tested in
    # test_speculation_length.py
    good = audit_distribution(
        target, ExactspecEngine(SpeculativeGenerator(target, make(target), 3, "constant"), "ok"),
        prompts, PARAMS, SAMPLES, ALPHA)
    assert good.drafted > 500 and good.accepted > 50, (good.drafted, good.accepted)
    assert not good.rejected, [p.fit for p in good.prompts]
    for broken in BROKEN_VERIFIERS:
        engine = ExactspecEngine(BrokenGenerator(target, make(target), 3, "constant",
                                                 broken=broken), broken)
        bad = audit_distribution(target, engine, prompts, PARAMS, SAMPLES, ALPHA)
        assert bad.rejected, (broken, [p.fit for p in bad.prompts])


def test_transformers_sampling_agrees_with_the_reference_and_a_wrong_one_is_caught(target,
                                                                                   prompts):
    """An independent implementation (transformers' own sampling) passes against the exact
    reference; the same with another temperature fails."""
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_new_tokens=2)
    engine = TransformersGenerateEngine(target, "hf", {})
    assert not audit_distribution(target, engine, prompts[:1], params, 800, ALPHA).rejected

    class WrongTemperature:  # transformers sampling at 1.1 where 0.8 was asked for
        name, drafted, accepted = "wrong", None, None
        drafted_per_position = accepted_per_position = None

        def sample(self, prompt_ids, asked, n):
            return engine.sample(prompt_ids, dataclasses.replace(asked, temperature=1.1), n)

    assert audit_distribution(target, WrongTemperature(), prompts[:1], params, 800,
                              ALPHA).rejected


def test_greedy_check_reports_the_first_divergence_with_logits(target, prompts):
    engine = ExactspecEngine(SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4), "ok")
    assert all(c.identical for c in check_greedy(target, engine, prompts, 20))

    class OffByOne:
        name, drafted, accepted = "off", None, None
        drafted_per_position = accepted_per_position = None

        def sample(self, prompt_ids, params, n):
            ids = list(engine.sample(prompt_ids, params, 1)[0])
            ids[5] = (ids[5] + 1) % target.vocab_size
            return [tuple(ids)] * n

    check = check_greedy(target, OffByOne(), prompts[:1], 20)[0]
    assert not check.identical and check.position == 5
    assert check.engine_token == (check.plain_token + 1) % target.vocab_size
    assert check.plain_logit > check.engine_logit


def test_drafts_are_counted_only_while_sampling(target, prompts):
    """The greedy check drafts too; the distribution test reports only its own drafts."""
    engine = ExactspecEngine(SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3,
                                                  "constant"), "ok")
    check_greedy(target, engine, prompts, 20)
    greedy_drafted, greedy_per_position = engine.drafted, list(engine.drafted_per_position)
    assert greedy_drafted > 0
    test = audit_distribution(target, engine, prompts, PARAMS, 100, ALPHA)
    assert test.drafted == engine.drafted - greedy_drafted > 0
    assert test.drafted_per_position == [a - b for a, b in zip(engine.drafted_per_position,
                                                               greedy_per_position)]
    assert sum(test.drafted_per_position) == test.drafted
    assert sum(test.accepted_per_position) == test.accepted


def test_verdict_and_report(tmp_path, target, prompts):
    proposer = PromptLookupProposer(1, 3)
    good = audit_distribution(
        target, ExactspecEngine(SpeculativeGenerator(target, proposer, 3, "constant"), "ok"),
        prompts, PARAMS, 300, ALPHA)
    control = audit_distribution(
        target, ExactspecEngine(BrokenGenerator(target, proposer, 3, "constant",
                                                broken="accept-all"), "c"),
        prompts, PARAMS, 300, ALPHA)
    result = verdict(AuditResult({"prompts": ["a", "b"]}, [], good, control))
    assert result.verdict == "exact"
    assert verdict(AuditResult({}, [], good, None)).verdict == "inconclusive"
    assert verdict(AuditResult({}, [], control, good)).verdict == "NOT exact"
    barely = dataclasses.replace(good, drafted=10)  # speculation hardly exercised
    doubt = verdict(AuditResult({}, [], barely, control))
    assert doubt.verdict == "inconclusive" and "drafted 10 tokens in 600" in doubt.reasons[0]
    files = write_audit_report(result, tmp_path, lambda ids: "".join(map(str, ids)))
    assert {f.name for f in files} == {"audit.json", "report.md", "prompt-0.png", "prompt-1.png"}
    assert all(f.stat().st_size > 0 for f in files)
    assert "**exact**" in (tmp_path / "report.md").read_text()
