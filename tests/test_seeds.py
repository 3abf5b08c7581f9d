"""A seed reproduces the output on a reused generator, whatever ran on it before (greedy and
unseeded calls that measure timings and move the policies' state), on both backends, with
every policy and proposer, and with n > 1."""

import pytest

from exactspec import DraftModelProposer, PromptLookupProposer, SamplingParams, SpeculativeGenerator
from exactspec.proposers.early_exit import EarlyExitProposer


PROMPT = "abc abc abd abc abcd, abc abc abd abc"
PROPOSERS = {"prompt-lookup": ("auto", "constant", "heuristic"),
            "draft": ("auto", "constant", "heuristic", "confidence"),
            "early-exit": ("auto", "constant", "heuristic", "confidence")}
CASES = [(make_proposer, policy) for make_proposer, policies in PROPOSERS.items() for policy in policies]


def make_proposer(name, target, make_backend):
    if name == "prompt-lookup":
        return PromptLookupProposer(1, 3)
    if name == "draft":
        return DraftModelProposer(make_backend(60), target)
    if make_backend.kind != "transformers":
        pytest.skip("early exit needs the transformers backend")
    return EarlyExitProposer(target, 1)


@pytest.mark.parametrize("name, policy", CASES)
def test_a_seed_reproduces_on_a_reused_generator(name, policy, make_backend):
    target = make_backend(6)
    generator = SpeculativeGenerator(target, make_proposer(name, target, make_backend), 4, policy)
    seeded = SamplingParams(temperature=1.0, top_k=20, seed=11, max_new_tokens=40)

    first = generator.generate(PROMPT, seeded)
    assert first.stats.drafted_tokens > 0
    generator.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=40))  # timed
    generator.generate(PROMPT + " abd", SamplingParams(temperature=1.0, max_new_tokens=40))
    again = generator.generate(PROMPT, seeded)
    assert again.token_ids == first.token_ids
    assert again.stats.committed_per_cycle == first.stats.committed_per_cycle
    assert again.stats.chosen_k_histogram == first.stats.chosen_k_histogram

    samples = [r.token_ids for r in generator.generate_samples(PROMPT, seeded, n=3)]
    generator.generate(PROMPT, SamplingParams(temperature=0, max_new_tokens=40))
    assert [r.token_ids for r in generator.generate_samples(PROMPT, seeded, n=3)] == samples
    assert samples[0] == first.token_ids  # the first of n samples is the n = 1 output

    fresh_target = make_backend(6)
    fresh = SpeculativeGenerator(fresh_target, make_proposer(name, fresh_target, make_backend), 4,
                                 policy).generate(PROMPT, seeded)
    assert fresh.token_ids == first.token_ids
    other = generator.generate(PROMPT, SamplingParams(temperature=1.0, top_k=20, seed=12,
                                                      max_new_tokens=40))
    assert other.token_ids != first.token_ids
