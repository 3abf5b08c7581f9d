"""The history-aware logits pipeline against a slow reference and transformers' own
repetition penalty; bans, bias and min_new_tokens per verified row."""

import math

import pytest
import torch

from exactspec.logits_pipeline import LogitsPipeline, NoTokenAllowedError
from exactspec.sampling import SamplingParams
from exactspec.verification import verify

VOCAB = 20


def reference_process(logits_row, params, prompt, history, eos, bad_words_ids):
    """One row, in Python floats: ``history`` = prompt + output + drafts before this row."""
    scores = [float(x) for x in logits_row]
    output = history[len(prompt):]
    if params.repetition_penalty != 1:
        for t in set(history):
            scores[t] = (scores[t] / params.repetition_penalty if scores[t] > 0
                         else scores[t] * params.repetition_penalty)
    for t in set(output):
        scores[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    for t, b in params.logit_bias.items():
        scores[t] += b
    for t in params.banned_token_ids:
        scores[t] = -math.inf
    for seq in bad_words_ids:
        if len(seq) == 1 or history[len(history) - len(seq) + 1:] == seq[:-1]:
            scores[seq[-1]] = -math.inf
    if len(output) < params.min_new_tokens:
        for t in set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos)):
            scores[t] = -math.inf
    return torch.tensor(scores)


PARAMS = [
    SamplingParams(repetition_penalty=1.7),
    SamplingParams(repetition_penalty=0.8, presence_penalty=0.6, frequency_penalty=0.4),
    SamplingParams(frequency_penalty=-1.0, logit_bias={3: 4.0, 7: -2.5}),
    SamplingParams(banned_token_ids=(1, 2), bad_words=("x",), max_new_tokens=20),
    SamplingParams(min_new_tokens=5, stop_token_ids=(9,), max_new_tokens=20),
    SamplingParams(min_new_tokens=5, ignore_eos=True, max_new_tokens=20),
]


@pytest.mark.parametrize("params", PARAMS)
@pytest.mark.parametrize("seed", range(3))
def test_rows_match_the_reference_with_true_history(params, seed):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(VOCAB, (6,), generator=g).tolist()
    output = torch.randint(VOCAB, (3,), generator=g).tolist()
    drafted = torch.randint(VOCAB, (4,), generator=g).tolist()
    bad_words_ids = [[4, 5], [6]]
    logits = torch.randn(5, VOCAB, generator=g) * 3
    original = logits.clone()
    pipeline = LogitsPipeline(params, prompt, VOCAB, eos_token_ids=[0],
                              bad_words_ids=bad_words_ids)
    processed = pipeline.process(logits, prompt + output, drafted)
    assert torch.equal(logits, original), "raw logits were modified in place"
    for i in range(5):
        history = prompt + output + drafted[:i]
        expected = reference_process(logits[i], params, prompt, history, [0], bad_words_ids)
        torch.testing.assert_close(processed[i], expected, rtol=1e-6, atol=1e-5)


def test_repetition_penalty_equals_transformers():
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    prompt, output, drafted = [1, 2, 3, 3], [5, 1], [8, 9, 8]
    logits = torch.randn(4, VOCAB, generator=g) * 2
    processed = LogitsPipeline(SamplingParams(repetition_penalty=1.3), prompt, VOCAB).process(
        logits, prompt + output, drafted)
    hf = RepetitionPenaltyLogitsProcessor(1.3)
    for i in range(4):
        history = torch.tensor([prompt + output + drafted[:i]])
        torch.testing.assert_close(processed[i], hf(history, logits[i:i + 1].clone())[0])


def test_identity_when_nothing_applies():
    logits = torch.randn(3, VOCAB)
    pipeline = LogitsPipeline(SamplingParams(temperature=0.7, top_k=5), [1], VOCAB)
    assert pipeline.is_identity and pipeline.process(logits, [1, 2], [3, 4]) is logits


def test_errors():
    with pytest.raises(ValueError, match=r"logit_bias has token ids \[25\] outside"):
        LogitsPipeline(SamplingParams(logit_bias={25: 1.0}), [1], VOCAB)
    with pytest.raises(ValueError, match="banned_token_ids has token ids"):
        LogitsPipeline(SamplingParams(banned_token_ids=(20,)), [1], VOCAB)
    everything = LogitsPipeline(SamplingParams(banned_token_ids=tuple(range(VOCAB))), [1], VOCAB)
    processed = everything.process(torch.randn(2, VOCAB), [1], [3])
    assert everything.first_empty_row(processed) == 0 and bool(torch.isneginf(processed).all())
    with pytest.raises(NoTokenAllowedError, match="every token is banned at output position 0"):
        verify([1], [3], None, torch.randn(2, VOCAB), everything, None)


def test_only_a_row_after_its_draft_can_be_empty():
    """bad_words "3 4": the row after drafting 3 has 4 banned, and with every other token
    banned too it is empty; the row before it is not."""
    pipeline = LogitsPipeline(SamplingParams(banned_token_ids=tuple(range(5, VOCAB))), [1],
                              VOCAB, bad_words_ids=[[3, 4], [3, 3], [3, 2], [3, 1], [3, 0]])
    processed = pipeline.process(torch.randn(3, VOCAB), [1], [3, 4])
    assert pipeline.first_empty_row(processed) == 1
    assert pipeline.first_empty_row(processed[:1]) is None


def test_logprobs_are_of_the_processed_distribution():
    logits = torch.randn(2, VOCAB)
    greedy = LogitsPipeline(SamplingParams(logit_bias={2: 1.0}), [1], VOCAB)
    processed = greedy.process(logits, [1])
    torch.testing.assert_close(greedy.logprobs(processed), torch.log_softmax(processed, -1))
    sampled = LogitsPipeline(SamplingParams(temperature=0.5, top_k=3), [1], VOCAB)
    logprobs = sampled.logprobs(logits)
    assert (torch.isfinite(logprobs).sum(-1) == 3).all()
    torch.testing.assert_close(logprobs.exp(), sampled.probs(logits))
