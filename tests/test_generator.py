"""The engine on tiny random models, on every backend (``make_backend``): greedy identity with plain decoding, every stop
condition, context limits, seeded determinism, metrics invariants, and an engine-level
distribution test of every block position with broken controls."""


import pytest
import torch

from exactspec import (DraftModelProposer, PromptLookupProposer, SamplingParams, SuffixProposer,
                       SpeculativeGenerator)
from exactspec.audit import BROKEN_VERIFIERS, BrokenGenerator
from exactspec.proposers.base import Proposal, Proposer

from conftest import RandomProposer, ScriptedProposer, tiny_backend
from gof import audit_positions

REPEATED = "abc abc abd abc abcd, abc abc abd abc"
COUNTING = ", ".join(str(i) for i in range(1, 41))


def plain(target, prompt, params):
    return SpeculativeGenerator(target, None).generate(prompt, params)


def check_stats(result, k):
    stats = result.stats
    assert stats.num_generated_tokens == len(result.token_ids) == sum(stats.committed_per_cycle)
    assert sum(stats.committed_histogram) == stats.cycles
    assert stats.accepted_tokens <= stats.drafted_tokens <= k * stats.cycles
    if stats.acceptance_rate is not None:
        assert 0 <= stats.acceptance_rate <= 1
    assert 1 <= stats.mean_acceptance_length <= k + 1
    assert sum(stats.accepted_per_position) == stats.accepted_tokens
    assert sum(stats.drafted_per_position) == stats.drafted_tokens
    assert all(a <= d for a, d in zip(stats.accepted_per_position, stats.drafted_per_position))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("proposer_name", ["random", "prompt_lookup", "suffix", "identical_model",
                                     "other_model"])
@pytest.mark.parametrize("prompt", [REPEATED, "a"])
def test_greedy_identity(seed, k, proposer_name, prompt, make_backend):
    target = make_backend(seed)
    params = SamplingParams(max_new_tokens=40)
    proposer = {
        "random": lambda: RandomProposer(seed=seed),
        "prompt_lookup": lambda: PromptLookupProposer(1, 3),
        "suffix": lambda: SuffixProposer(1, 8, 0.0),
        "identical_model": lambda: DraftModelProposer(make_backend(same_as=target), target),
        "other_model": lambda: DraftModelProposer(make_backend(seed + 100), target),
    }[proposer_name]()
    expected = plain(target, prompt, params)
    result = SpeculativeGenerator(target, proposer, k).generate(prompt, params)
    assert result.token_ids == expected.token_ids
    assert result.text == expected.text and result.finish_reason == expected.finish_reason
    check_stats(result, k)
    if proposer_name == "identical_model":
        assert result.stats.acceptance_rate == 1.0
    if proposer_name == "random":
        assert result.stats.acceptance_rate < 0.5  # a proposer that is mostly wrong


def test_rollback_counting_prompt_with_an_often_wrong_proposer(make_backend):
    target = make_backend(7)
    params = SamplingParams(max_new_tokens=60)
    expected = plain(target, COUNTING, params)
    for proposer in (PromptLookupProposer(1, 2), RandomProposer(seed=3)):
        result = SpeculativeGenerator(target, proposer, 4).generate(COUNTING, params)
        assert result.token_ids == expected.token_ids
        assert result.stats.acceptance_rate < 0.9  # rejections (and rollbacks) happened


def test_eos_at_draft_position_2_of_4_all_accepted(make_backend):
    target = make_backend(1)
    reference = plain(target, "abc", SamplingParams(max_new_tokens=12)).token_ids
    eos = next(t for t in reference[1:4] if t != reference[0])
    eos_index = reference.index(eos)
    target_with_eos = make_backend(eos=[eos], same_as=target)
    oracle = ScriptedProposer(target.tokenizer.encode("abc") + reference)
    result = SpeculativeGenerator(target_with_eos, oracle, 4).generate(
        "abc", SamplingParams(max_new_tokens=12))
    assert result.token_ids == reference[: eos_index + 1]
    assert result.finish_reason == "stop" and result.stop_reason == eos
    assert result.stats.num_generated_tokens == eos_index + 1
    assert result.stats.cycles == 1 and result.stats.accepted_tokens == eos_index + 1
    assert result.text == target.tokenizer.decode(reference[: eos_index + 1])
    check_stats(result, 4)
    # Plain decoding stops at the same place.
    assert plain(target_with_eos, "abc", SamplingParams(max_new_tokens=12)).token_ids == \
        result.token_ids


def test_stop_string_completing_mid_block(make_backend):
    target = make_backend(2)
    reference = plain(target, "abc", SamplingParams(max_new_tokens=12)).token_ids
    text = target.tokenizer.decode(reference)
    stop = text[2:4]  # completed by the 4th token, inside the first block of 6
    first = text.find(stop)
    oracle = ScriptedProposer(target.tokenizer.encode("abc") + reference)
    params = SamplingParams(max_new_tokens=12, stop=(stop, "never-there"))
    result = SpeculativeGenerator(target, oracle, 6, "constant").generate("abc", params)
    assert result.finish_reason == "stop" and result.stop_reason == stop
    assert result.text == text[: first + len(stop)]  # one token per character here
    assert result.token_ids == reference[: first + len(stop)]
    assert result.stats.num_generated_tokens == first + len(stop) and result.stats.cycles == 1
    check_stats(result, 6)
    baseline = plain(target, "abc", params)
    assert (baseline.token_ids, baseline.text) == (result.token_ids, result.text)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3])
def test_max_new_tokens_smaller_than_k(max_new_tokens, make_backend):
    target = make_backend(3)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    expected = plain(target, REPEATED, params)
    oracle = ScriptedProposer(target.tokenizer.encode(REPEATED) + expected.token_ids + [0] * 9)
    result = SpeculativeGenerator(target, oracle, 8).generate(REPEATED, params)
    assert len(result.token_ids) == max_new_tokens and result.finish_reason == "length"
    assert result.token_ids == expected.token_ids
    check_stats(result, 8)


def test_context_limit_clamps_k_and_ends_with_length(make_backend):
    target = make_backend(4, max_context=32)
    prompt = REPEATED[:28]  # 4 positions left, fewer than k + 1 = 9
    params = SamplingParams(max_new_tokens=50)
    expected = plain(target, prompt, params)
    assert len(expected.token_ids) == 4 and expected.finish_reason == "length"
    for proposer in (PromptLookupProposer(), DraftModelProposer(make_backend(same_as=target), target)):
        result = SpeculativeGenerator(target, proposer, 8).generate(prompt, params)
        assert result.token_ids == expected.token_ids and result.finish_reason == "length"
    last = SpeculativeGenerator(target, PromptLookupProposer(), 8).generate(REPEATED[:31], params)
    assert len(last.token_ids) == 1 and last.finish_reason == "length"
    for length in (32, 33):  # no room left for a generated token
        with pytest.raises(ValueError, match=f"{length} tokens; the context holds 32 .* at "
                                             "most 31 to leave room"):
            SpeculativeGenerator(target, PromptLookupProposer(), 8).generate(REPEATED[:length],
                                                                             params)


def test_no_eos_configured_runs_to_length(make_backend):
    target = make_backend(5, eos=())
    result = SpeculativeGenerator(target, PromptLookupProposer(), 4).generate(
        REPEATED, SamplingParams(max_new_tokens=30))
    assert len(result.token_ids) == 30 and result.finish_reason == "length"


def test_bad_inputs(make_backend):
    target = make_backend(0)
    generator = SpeculativeGenerator(target, PromptLookupProposer(), 4)
    with pytest.raises(ValueError, match="empty"):
        generator.generate([])
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 64\)"):
        generator.generate([1, 64])
    with pytest.raises(ValueError, match="needs a text prompt"):
        generator.generate([1, 2], chat=True)
    for bad_k in (-1, 1.5, True):
        with pytest.raises(ValueError, match="num_speculative_tokens"):
            SpeculativeGenerator(target, PromptLookupProposer(), bad_k)


def test_chat_template_is_applied():
    target = tiny_backend(0)
    result = SpeculativeGenerator(target, None).generate("hi", SamplingParams(max_new_tokens=2),
                                                         chat=True)
    assert result.prompt_token_ids == target.tokenizer.encode("user hi\nbot ")


# --- sampling ----------------------------------------------------------------------------

@pytest.mark.parametrize("k", [1, 4])
def test_seeded_determinism(k, make_backend):
    target = make_backend(6)
    params = SamplingParams(temperature=1.0, top_k=20, seed=11, max_new_tokens=30)
    def run(p):
        proposer = DraftModelProposer(make_backend(60), target)
        return SpeculativeGenerator(target, proposer, k).generate(REPEATED, p)
    first, second = run(params), run(params)
    assert first.token_ids == second.token_ids
    assert first.stats.committed_per_cycle == second.stats.committed_per_cycle
    assert first.stats.accepted_per_position == second.stats.accepted_per_position
    other = run(SamplingParams(temperature=1.0, top_k=20, seed=12, max_new_tokens=30))
    assert other.token_ids != first.token_ids


class LyingProposer(Proposer):
    """Samples drafts from a draft model but reports q as uniform: the broken control."""

    def __init__(self, inner):
        self.inner = inner

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        proposal = self.inner.propose(token_ids, k, pipeline, rng, min_confidence)
        if proposal.probs is None:
            return proposal
        return Proposal(proposal.token_ids, torch.full_like(proposal.probs,
                                                            1 / proposal.probs.shape[-1]))

    def reset(self, reproducible=False, scope=None):
        self.inner.reset(reproducible, scope)


SAMPLES = 2000


@pytest.mark.parametrize("broken", [None, "lying-q", *BROKEN_VERIFIERS])
def test_engine_sampling_follows_the_target_at_every_block_position(broken, make_backend):
    """k = 3 and 4 tokens per sample, with a real draft model that disagrees often (a high
    temperature lets it agree often enough): every position of a block is verified and
    accepted many times, and every position of the
    continuation follows the target's conditional distribution (the audit's per-position
    test). The broken controls must be caught: q reported as uniform, every draft
    accepted, resampling from p instead of the residual."""
    vocab = 16
    target = make_backend(8, vocab=vocab)
    proposer = DraftModelProposer(make_backend(9, vocab=vocab), target)
    if broken == "lying-q":
        proposer = LyingProposer(proposer)
    generator = (BrokenGenerator(target, proposer, 3, "constant", broken=broken)
                 if broken in BROKEN_VERIFIERS else
                 SpeculativeGenerator(target, proposer, 3, "constant"))
    params = SamplingParams(temperature=1.5, top_k=12, seed=0, max_new_tokens=4)
    test = audit_positions(target, generator, [1, 2, 3, 1, 2], params, SAMPLES)
    assert min(test.accepted_per_position) >= 50, test.accepted_per_position
    if broken:
        assert test.rejected
    else:
        assert not test.rejected, test.prompts[0]


def test_api_misuse_is_refused():
    target = tiny_backend(0)
    with pytest.raises(ValueError, match="separate backend"):
        DraftModelProposer(target, target)
    generator = SpeculativeGenerator(target, PromptLookupProposer(), 4)
    with pytest.raises(ValueError, match="must be integers"):
        generator.generate([1.7, 2.2])
    with pytest.raises(TypeError, match="must be a SamplingParams"):
        generator.generate("abc", {"max_new_tokens": 3})
    with pytest.raises(ValueError, match="min_ngram"):
        PromptLookupProposer(True, 3)


def test_suffix_corpus_learns_across_requests_keeps_greedy_identity_and_seeds():
    """A second request on the same prompt drafts the first one's output from the corpus
    (fewer cycles, same tokens); a seeded sampling run ignores the corpus, so it samples
    the same as on a fresh generator."""
    from exactspec import SuffixCorpus, SuffixProposer

    target = tiny_backend(0)
    plain = SpeculativeGenerator(tiny_backend(0), None).generate(
        "hello world", SamplingParams(max_new_tokens=60))
    corpus = SuffixCorpus(5000)
    generator = SpeculativeGenerator(target, SuffixProposer(corpus=corpus), 6, "constant")
    first = generator.generate("hello world", SamplingParams(max_new_tokens=60))
    assert corpus.num_tokens == 60
    second = generator.generate("hello world", SamplingParams(max_new_tokens=60))
    assert first.token_ids == second.token_ids == plain.token_ids
    assert second.stats.cycles < first.stats.cycles / 2
    assert second.stats.accepted_tokens > first.stats.accepted_tokens
    seeded = SamplingParams(temperature=0.8, seed=3, max_new_tokens=40)
    fresh = SpeculativeGenerator(tiny_backend(0), SuffixProposer(), 6, "constant")
    assert generator.generate("hello world", seeded).token_ids == fresh.generate(
        "hello world", seeded).token_ids


def test_token_ids_may_come_as_an_array():
    import numpy as np

    target = tiny_backend(0)
    params = SamplingParams(max_new_tokens=5)
    expected = SpeculativeGenerator(target, None).generate([1, 2, 3], params).token_ids
    for prompt in (np.array([1, 2, 3]), torch.tensor([1, 2, 3])):
        assert SpeculativeGenerator(target, None).generate(prompt, params).token_ids == expected


def test_generation_stats_merged_sums_counts_position_by_position():
    """GenerationStats.merged, the one place counts are summed: per-position counts and
    histograms of different lengths add position by position, the derived figures follow
    the sums (not an average of ratios), and to_dict/from_dict round-trips."""
    from exactspec.generation_stats import GenerationStats

    short = GenerationStats(num_speculative_tokens=2, policy="auto", num_prompt_tokens=5)
    short.record_cycle(2, 1, 2, draft_seconds=0.5)
    long = GenerationStats(num_speculative_tokens=4, policy="constant", num_prompt_tokens=7)
    long.record_cycle(4, 4, 5)
    long.record_cycle(3, 0, 1, chosen_k=4)
    total = GenerationStats.merged([short, GenerationStats.from_dict(long.to_dict())])
    assert total.num_speculative_tokens == 4 and total.policy == "auto"
    assert (total.cycles, total.drafted_tokens, total.accepted_tokens) == (3, 9, 5)
    assert total.drafted_per_position == [3, 3, 2, 1]
    assert total.accepted_per_position == [2, 1, 1, 1]
    assert total.chosen_k_histogram == [0, 0, 1, 0, 2]
    assert total.committed_per_cycle == [2, 5, 1]
    assert total.num_prompt_tokens == 12 and total.draft_seconds == 0.5
    assert total.acceptance_rate == 5 / 9 and total.mean_acceptance_length == 8 / 3
    assert GenerationStats.merged([]).cycles == 0


def test_generation_stats_since_is_what_was_added_after_a_copy():
    from exactspec.generation_stats import GenerationStats

    running = GenerationStats(num_speculative_tokens=2)
    running.record_cycle(2, 2, 3)
    before = running.copy()
    added = GenerationStats(num_speculative_tokens=3)
    added.record_cycle(3, 1, 2)
    running.add(added)
    since = running.since(before)
    assert (since.cycles, since.drafted_tokens, since.accepted_tokens) == (1, 3, 1)
    assert since.drafted_per_position == [1, 1, 1] and since.accepted_per_position == [1, 0, 0]
    assert since.committed_per_cycle == [2] and since.chosen_k_histogram == [0, 0, 0, 1]
    assert running.since(GenerationStats()).drafted_tokens == 5
