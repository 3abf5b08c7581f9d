"""Proposers: prompt lookup matching rules; draft model vocabulary handling."""

import pytest
import torch

from exactspec import (DraftModelProposer, PromptLookupProposer, SamplingParams,
                       SpeculativeGenerator, UnsupportedModelError)
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.sampling import make_rng

from conftest import CharTokenizer, tiny_backend, tiny_model

GREEDY = SamplingParams()
G = make_rng(0)


def pipe(params, vocab=64):
    return LogitsPipeline(params, [0], vocab)


def lookup(context, k, low=1, high=3):
    return PromptLookupProposer(low, high).propose(context, k, pipe(GREEDY), G).token_ids


def test_prompt_lookup_prefers_the_longest_ngram_then_the_most_recent_match():
    # suffix [1, 2, 3]: the 3-gram matched at index 0 (followed by 9, 9), although the
    # 1-gram [3] also occurs later (followed by 7).
    assert lookup([1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3], 2) == [9, 9]
    # two earlier matches of [1, 2]: the most recent one wins
    assert lookup([1, 2, 5, 1, 2, 6, 8, 1, 2], 3) == [6, 8, 1]
    # min_ngram 2: a lone 1-gram match is not used
    assert lookup([4, 8, 6, 4], 3, low=2, high=3) == []
    assert lookup([4, 8, 6, 4], 3, low=1, high=3) == [8, 6, 4]


def test_prompt_lookup_edges():
    assert lookup([5], 4) == []  # one-token context
    assert lookup([1, 2, 3, 4], 4) == []  # no repetition
    assert lookup([7, 7], 4) == [7]  # continuation shorter than k
    assert lookup([1, 2, 3, 4, 5, 6, 1, 2], 2) == [3, 4]  # capped at k
    for bad in [(0, 3), (3, 2), (1.5, 3)]:
        with pytest.raises(ValueError, match="ngram"):
            PromptLookupProposer(*bad)


def test_draft_with_a_different_tokenizer_is_refused():
    target = tiny_backend(0)
    other = tiny_backend(1)
    other.tokenizer = CharTokenizer(60)
    with pytest.raises(UnsupportedModelError, match="tokenizer differs"):
        DraftModelProposer(other, target)


@pytest.mark.parametrize("draft_vocab", [72, 60])
def test_draft_with_padded_vocabulary(draft_vocab):
    """The tokenizer has 60 real tokens; the target's LM head has 64 rows, the draft's 72
    (or exactly 60): drafts map onto the target's vocabulary and never use padding ids."""
    target = tiny_backend(0, tokenizer_vocab=60)
    draft = tiny_backend(model=tiny_model(5, vocab=draft_vocab), tokenizer_vocab=60)
    proposer = DraftModelProposer(draft, target)
    for params in (GREEDY, SamplingParams(temperature=1.0, seed=0)):
        proposal = proposer.propose([1, 2, 3], 6, pipe(params), make_rng(0))
        assert len(proposal.token_ids) == 6 and max(proposal.token_ids) < 60
        if proposal.probs is not None:
            assert proposal.probs.shape == (6, 64)
            assert proposal.probs[:, 60:].sum() == 0
    params = SamplingParams(max_new_tokens=30)
    expected = SpeculativeGenerator(target, None).generate([1, 2, 3], params)
    result = SpeculativeGenerator(target, DraftModelProposer(draft, target), 4).generate(
        [1, 2, 3], params)
    assert result.token_ids == expected.token_ids


def test_draft_cache_follows_the_context():
    target = tiny_backend(0)
    draft = tiny_backend(1)
    proposer = DraftModelProposer(draft, target)
    proposer.propose([1, 2, 3], 4, pipe(GREEDY), G)
    assert draft.num_cached_tokens == 3 + 3  # context + all drafts but the last
    proposer.propose([1, 2, 3, 9, 9], 2, pipe(GREEDY), G)  # a diverging context
    assert draft.num_cached_tokens == 5 + 1
    fresh = DraftModelProposer(tiny_backend(model=draft.model), target)
    assert proposer.propose([1, 2, 3, 9, 9, 4], 3, pipe(GREEDY), G).token_ids == \
        fresh.propose([1, 2, 3, 9, 9, 4], 3, pipe(GREEDY), G).token_ids
