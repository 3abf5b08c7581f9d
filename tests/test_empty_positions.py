"""A position where every token is banned (issue 45, item 1): speculation raises exactly where
plain decoding raises, never because of a drafted token that is then rejected.

Each case is a way a position can become empty *after one token only* (the trap token
``b``): banned ids with bad words, bad words alone, and ``min_new_tokens`` suppressing the
only token left (EOS). Logit bias alone cannot empty a position: biases are bounded to
[-100, 100] (OpenAI's range), so a biased logit stays finite.
"""

from __future__ import annotations

import dataclasses

import pytest
from scipy.stats import binomtest

from exactspec import PromptLookupProposer, SamplingParams, SpeculativeGenerator
from exactspec.batching import BatchedGenerator
from exactspec.logits_pipeline import LogitsPipeline, NoTokenAllowedError
from exactspec.proposers.base import Proposal, Proposer

from conftest import ALPHABET, VOCAB, one, tiny_backend

A, B, EOS = 0, 1, VOCAB - 1  # 'a', 'b' (the trap) and the end-of-sequence token
PROMPT = [A, A, B, A, A, B, A, A, B, A, A]  # "aabaabaabaa": prompt lookup drafts the trap b
EVERYTHING_BUT = lambda *keep: tuple(t for t in range(VOCAB) if t not in keep)  # noqa: E731

CASES = {
    # after b, a and b are bad words; nothing else is allowed
    "banned ids and bad words": dict(banned_token_ids=EVERYTHING_BUT(A, B),
                                     bad_words=("ba", "bb")),
    # after b, every character is a bad word
    "bad words alone": dict(bad_words=tuple("b" + c for c in ALPHABET[:VOCAB])),
    # after b, only EOS is left, and min_new_tokens suppresses it
    "min_new_tokens suppressing EOS": dict(banned_token_ids=EVERYTHING_BUT(A, B, EOS),
                                           bad_words=("ba", "bb"), min_new_tokens=12),
}


class TrapProposer(Proposer):
    """Drafts ``b`` then ``a``s: the row after the first draft has no allowed token."""

    batchable = True

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0) -> Proposal:
        return Proposal([B] + [A] * (k - 1))


def generator(target, proposer, k):
    return SpeculativeGenerator(target, proposer, k, policy="constant")


def greedy_params(case: str, **extra) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=12, logit_bias={A: 50.0},
                          **CASES[case], **extra)


class TestAPositionWithNoAllowedToken:
    @pytest.mark.parametrize("case", CASES)
    def test_greedy_speculation_equals_plain_decoding(self, make_backend, case):
        target = make_backend(5, eos=(EOS,))
        params = greedy_params(case)
        expected = generator(target, None, 0).generate(PROMPT, params).token_ids
        assert expected == [A] * 12
        for proposer in (PromptLookupProposer(1, 3), TrapProposer()):
            for k in (1, 4):
                result = generator(target, proposer, k).generate(PROMPT, params)
                assert result.token_ids == expected, (type(proposer).__name__, k)
                # the trap was drafted at the first position and rejected there
                drafted, accepted = result.stats.drafted_per_position, result.stats.accepted_per_position
                assert drafted[0] > 0 and accepted[0] < drafted[0], (drafted, accepted)

    @pytest.mark.parametrize("case", CASES)
    def test_batched_rows_equal_plain_decoding(self, make_backend, case):
        target = make_backend(5, eos=(EOS,))
        params = greedy_params(case)
        expected = generator(target, None, 0).generate(PROMPT, params).token_ids
        batched = BatchedGenerator(generator(target, TrapProposer(), 4), max_batch_size=2)
        outputs = batched.generate([PROMPT, PROMPT[:-1]], params)  # raised before the fix
        assert outputs[0].token_ids == expected
        assert outputs[1].token_ids == generator(target, None, 0).generate(
            PROMPT[:-1], params).token_ids
        assert sum(o.stats.drafted_tokens for o in outputs) > 0

    @pytest.mark.parametrize("case", CASES)
    def test_raises_where_plain_decoding_raises(self, make_backend, case):
        """With the trap favoured, plain decoding reaches the empty position after one
        token; speculation raises the same error at the same position, for every k."""
        target = make_backend(5, eos=(EOS,))
        params = SamplingParams(temperature=0, max_new_tokens=12, logit_bias={B: 50.0},
                                **CASES[case])
        with pytest.raises(NoTokenAllowedError) as plain_error:
            generator(target, None, 0).generate(PROMPT, params)
        assert plain_error.value.position == 1
        for k in (1, 4):
            with pytest.raises(NoTokenAllowedError) as error:
                generator(target, TrapProposer(), k).generate(PROMPT, params)
            assert error.value.position == 1


def trap_probability(target, params) -> float:
    """p(b) at the first position under ``params`` (the chance plain decoding raises)."""
    pipeline = LogitsPipeline(params, PROMPT, target.vocab_size, target.eos_token_ids,
                              [[B, A], [B, B]])
    sequence = one(target)
    sequence.prefill(PROMPT[:-1])
    logits = sequence.forward(PROMPT[-1:])
    return float(pipeline.probs(pipeline.process(logits, PROMPT))[0, B])


def raise_every_time(verify):
    """A broken engine: raises whenever any verified row is empty (today's bug)."""
    def broken(tokens, drafts, probs, logits, pipeline, *args, **kwargs):
        processed = pipeline.process(logits, tokens, drafts)
        if pipeline.first_empty_row(processed) is not None:
            raise NoTokenAllowedError(-1, pipeline.params)
        return verify(tokens, drafts, probs, logits, pipeline, *args, **kwargs)
    return broken


def never_raise(verify):
    """A broken engine: the draft leading to an empty row is rejected with certainty (its
    target probability set to ~0), so the recovered token is never that draft."""
    def broken(tokens, drafts, probs, logits, pipeline, *args, **kwargs):
        processed = pipeline.process(logits, tokens, drafts)
        empty = pipeline.first_empty_row(processed)
        if empty:
            logits = logits.clone()
            logits[empty - 1, drafts[empty - 1]] = -1e4
        return verify(tokens, drafts, probs, logits, pipeline, *args, **kwargs)
    return broken


@pytest.mark.parametrize("broken", [None, raise_every_time, never_raise])
def test_sampling_raises_as_often_as_plain_decoding(broken, monkeypatch):
    """Sampling with the trap drafted at the first position: plain decoding raises exactly
    when it samples b first (probability p(b)); speculation must raise with the same
    probability — not always (the old check of every row), not never (a draft silently
    rejected). Two-sided binomial test at α = 1e-4; the broken engines must fail it."""
    import exactspec.generator as engine

    target = tiny_backend(5)
    base = SamplingParams(temperature=1.0, max_new_tokens=2, banned_token_ids=EVERYTHING_BUT(A, B))
    sequence = one(target)
    sequence.prefill(PROMPT[:-1])
    logits = sequence.forward(PROMPT[-1:])[0]
    bias = float(logits[A] - logits[B])  # p(b) = p(a) = 1/2 before the bad words
    params = SamplingParams(temperature=1.0, max_new_tokens=2,
                            banned_token_ids=base.banned_token_ids, bad_words=("ba", "bb"),
                            logit_bias={B: max(-100.0, min(100.0, bias))})
    p_trap = trap_probability(target, params)
    assert 0.3 < p_trap < 0.7
    if broken is not None:
        monkeypatch.setattr(engine, "verify", broken(engine.verify))
    spec = generator(target, TrapProposer(), 1)
    trials, raised, drafted = 600, 0, 0
    for seed in range(trials):
        try:
            result = spec.generate(PROMPT, dataclasses.replace(params, seed=seed))
            drafted += result.stats.drafted_per_position[0]
        except NoTokenAllowedError:
            raised += 1
    assert drafted > 0 or broken is raise_every_time
    p_value = binomtest(raised, trials, p_trap).pvalue
    if broken is None:
        assert p_value > 1e-4, (raised, trials, p_trap)
    else:
        assert p_value < 1e-4, (broken.__name__, raised, trials, p_trap)
