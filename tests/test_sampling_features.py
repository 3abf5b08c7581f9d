"""Every sampling parameter under speculation (issue: penalties, bias, bans, min_new_tokens,
stop ids, ignore_eos, logprobs, n samples): greedy output identical to plain decoding, each
parameter changing the output where it should (a silently ignored parameter fails), a
distribution test with penalties on (with broken controls), logprobs equal to plain's."""

import numpy as np
import pytest

from exactspec import DraftModelProposer, PromptLookupProposer, SamplingParams, SpeculativeGenerator
from exactspec.audit import BROKEN_VERIFIERS, BrokenGenerator
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import Proposal, Proposer

from conftest import RandomProposer, perturbed_backend, tiny_backend, one
from gof import audit_positions

PROMPT = "abc abc abd abc abcd, abc abc"


def plain(target, params, prompt=PROMPT):
    return SpeculativeGenerator(target, None).generate(prompt, params)


def proposers(target, seed=0):
    return {
        "prompt_lookup": PromptLookupProposer(1, 3),
        "random": RandomProposer(seed=seed),
        "draft_model": DraftModelProposer(tiny_backend(seed + 50), target),
        "same_model": DraftModelProposer(tiny_backend(model=target.model), target),
    }


def check_consistency(target, result, params):
    assert len(result.token_ids) == result.usage["completion_tokens"] \
        == result.stats.num_generated_tokens
    if params.logprobs is not None:
        assert len(result.logprobs) == len(result.token_ids)
        assert [lp.token_id for lp in result.logprobs] == result.token_ids
    assert target.tokenizer.decode(result.token_ids) == result.text


def settings(target):
    """(params with the parameter on, what it must change) for each parameter."""
    baseline = plain(target, SamplingParams(max_new_tokens=30))
    common = baseline.token_ids[0]
    return {
        "repetition_penalty": SamplingParams(max_new_tokens=30, repetition_penalty=3.0),
        "presence_penalty": SamplingParams(max_new_tokens=30, presence_penalty=2.0),
        "frequency_penalty": SamplingParams(max_new_tokens=30, frequency_penalty=1.5),
        "logit_bias": SamplingParams(max_new_tokens=30, logit_bias={17: 8.0}),
        "banned_token_ids": SamplingParams(max_new_tokens=30, banned_token_ids=(common,)),
        "bad_words": SamplingParams(max_new_tokens=30,
                                    bad_words=(target.tokenizer.decode(baseline.token_ids[2:4]),)),
    }, baseline


@pytest.mark.parametrize("name", ["repetition_penalty", "presence_penalty", "frequency_penalty",
                                  "logit_bias", "banned_token_ids", "bad_words"])
@pytest.mark.parametrize("k", [2, 5])
def test_parameter_is_applied_and_exact_under_speculation(name, k):
    target = tiny_backend(11)
    all_settings, baseline = settings(target)
    params = all_settings[name]
    expected = plain(target, params)
    assert expected.token_ids != baseline.token_ids, f"{name} changed nothing"
    for proposer_name, proposer in proposers(target).items():
        result = SpeculativeGenerator(target, proposer, k).generate(PROMPT, params)
        assert result.token_ids == expected.token_ids, proposer_name
        check_consistency(target, result, params)
    if name == "banned_token_ids":
        assert params.banned_token_ids[0] not in expected.token_ids
    if name == "bad_words":
        assert params.bad_words[0] not in expected.text
    if name == "logit_bias":
        assert 17 in expected.token_ids


def test_min_new_tokens_with_a_proposer_that_proposes_eos_early():
    target = tiny_backend(12)
    free = plain(target, SamplingParams(max_new_tokens=30))
    eos = free.token_ids[1]  # the model wants to stop after 2 tokens
    target = tiny_backend(model=target.model, eos=[eos])

    class EosProposer(Proposer):
        def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
            return Proposal([eos] * k)

    assert plain(target, SamplingParams(max_new_tokens=30)).token_ids == free.token_ids[:2]
    params = SamplingParams(max_new_tokens=30, min_new_tokens=12)
    expected = plain(target, params)
    assert len(expected.token_ids) >= 12 and eos not in expected.token_ids[:11]
    for k in (1, 4):
        result = SpeculativeGenerator(target, EosProposer(), k).generate(PROMPT, params)
        assert result.token_ids == expected.token_ids
        check_consistency(target, result, params)


def test_stop_token_ids_ignore_eos_and_finish_reasons():
    target = tiny_backend(13)
    free = plain(target, SamplingParams(max_new_tokens=20))
    stop_id = free.token_ids[5]
    first = free.token_ids.index(stop_id)
    with_eos = tiny_backend(model=target.model, eos=[stop_id])
    cases = {
        "stop_token_ids": (target, SamplingParams(max_new_tokens=20, stop_token_ids=(stop_id,)),
                           "stop", first + 1),
        "eos": (with_eos, SamplingParams(max_new_tokens=20), "stop", first + 1),
        "ignore_eos": (with_eos, SamplingParams(max_new_tokens=20, ignore_eos=True), "length", 20),
        "stop_string": (target, SamplingParams(max_new_tokens=20,
                                               stop=(free.text[first:first + 2],)), "stop", None),
        "min_new_tokens_then_stop": (
            target, SamplingParams(max_new_tokens=20, min_new_tokens=first + 2,
                                   stop_token_ids=(stop_id,)), None, None),
    }
    for name, (backend, params, reason, length) in cases.items():
        expected = plain(backend, params)
        result = SpeculativeGenerator(backend, PromptLookupProposer(1, 3), 4).generate(PROMPT, params)
        assert result.token_ids == expected.token_ids, name
        if reason:
            assert result.finish_reason == reason, name
        if length:
            assert len(result.token_ids) == length, name
        check_consistency(backend, result, params)
    ignored = plain(with_eos, cases["ignore_eos"][1])
    assert stop_id in ignored.token_ids[:-1]  # EOS generated and generation went on
    late = plain(target, cases["min_new_tokens_then_stop"][1])
    assert stop_id not in late.token_ids[: first + 1]


# --- logprobs ----------------------------------------------------------------------------

def teacher_forced_logprobs(target, prompt_ids, token_ids, params):
    """What plain decoding reports for these tokens: one position at a time."""
    pipeline = LogitsPipeline(params, prompt_ids, target.vocab_size, target.eos_token_ids)
    one(target).prefill(prompt_ids[:-1])
    context, values = list(prompt_ids), []
    for token in token_ids:
        logprobs = pipeline.logprobs(pipeline.process(one(target).forward([context[-1]]), context))
        values.append(float(logprobs[0, token]))
        context.append(token)
    return values


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=25, logprobs=3, frequency_penalty=0.5),
    SamplingParams(max_new_tokens=25, logprobs=2, temperature=0.9, top_k=20, seed=4,
                   repetition_penalty=1.2),
])
@pytest.mark.parametrize("proposer_name", ["same_model", "draft_model"])
def test_logprobs_equal_plain_decoding(params, proposer_name):
    """Accepted and bonus tokens (same_model drafts are accepted), recovered tokens
    (an unrelated draft model is mostly rejected)."""
    target = tiny_backend(14)
    proposer = proposers(target, seed=3)[proposer_name]
    result = SpeculativeGenerator(target, proposer, 4).generate(PROMPT, params)
    check_consistency(target, result, params)
    if proposer_name == "same_model":
        assert result.stats.accepted_tokens > 0
    else:
        assert result.stats.accepted_tokens < result.stats.drafted_tokens
    expected = teacher_forced_logprobs(target, result.prompt_token_ids, result.token_ids, params)
    np.testing.assert_allclose([lp.logprob for lp in result.logprobs], expected, atol=1e-5)
    for lp in result.logprobs:
        assert len(lp.top) == params.logprobs
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
        assert lp.logprob <= lp.top[0][1] + 1e-6
    if params.greedy:
        plain_result = plain(target, params)
        assert plain_result.token_ids == result.token_ids
        np.testing.assert_allclose([lp.logprob for lp in plain_result.logprobs],
                                   [lp.logprob for lp in result.logprobs], atol=1e-5)


# --- n samples ---------------------------------------------------------------------------

def test_n_samples_share_the_prefill_and_are_each_exact():
    target = tiny_backend(15)
    prefills = []
    original = target.prefill
    target.prefill = lambda sequence_id, ids: (prefills.append(len(ids)),
                                               original(sequence_id, ids))[1]
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4)
    greedy = generator.generate_samples(PROMPT, SamplingParams(max_new_tokens=15), n=3)
    assert len(prefills) == 1
    expected = plain(target, SamplingParams(max_new_tokens=15)).token_ids
    assert [r.token_ids for r in greedy] == [expected] * 3
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=15)
    samples = generator.generate_samples(PROMPT, params, n=4)
    again = generator.generate_samples(PROMPT, params, n=4)
    assert [r.token_ids for r in samples] == [r.token_ids for r in again]
    assert len({tuple(r.token_ids) for r in samples}) > 1
    with pytest.raises(ValueError, match="n = 0 is invalid"):
        generator.generate_samples(PROMPT, params, n=0)


# --- distribution with penalties ---------------------------------------------------------

SAMPLES = 2000
PENALISED = dict(temperature=1.0, repetition_penalty=2.0, frequency_penalty=1.0,
                 presence_penalty=1.0, seed=0, max_new_tokens=4)


@pytest.mark.parametrize("broken", [None, "history", *BROKEN_VERIFIERS])
def test_sampling_with_penalties_follows_the_target(broken, monkeypatch):
    """Every position of 4-token continuations with strong penalties, k = 3 (every block
    position verified and accepted many times), against the target's exact conditionals
    (the audit's per-position test). The broken controls must be caught: every verified
    row processed with the committed history only (the classic bug), every draft
    accepted, resampling from p instead of the residual."""
    vocab = 12
    target = tiny_backend(16, vocab=vocab)
    draft = perturbed_backend(target, noise=0.1)  # agrees often, so drafts reach row 3
    if broken == "history":  # only blocks of rows are affected: the reference scores one row
        original = LogitsPipeline.process
        monkeypatch.setattr(LogitsPipeline, "process", lambda self, logits, context,
                            drafted=(): original(self, logits, context))
    proposer = DraftModelProposer(draft, target)
    generator = (BrokenGenerator(target, proposer, 3, "constant", broken=broken)
                 if broken in BROKEN_VERIFIERS else
                 SpeculativeGenerator(target, proposer, 3, "constant"))
    test = audit_positions(target, generator, [1, 2, 3, 1, 2], SamplingParams(**PENALISED),
                           SAMPLES)
    assert min(test.accepted_per_position) >= 100, test.accepted_per_position
    if broken != "accept-all":  # both accepted drafts and rejections occur
        assert 0.3 < test.accepted / test.drafted < 0.95
    assert test.rejected == (broken is not None), test.prompts[0]
