import math

import pytest
import torch

from exactspec.logits_pipeline import check_finite, greedy_tokens, logits_to_probs
from exactspec.sampling import SamplingParams, make_rng, sample_from_probs

from gof import ALPHA, gof_pvalue


@pytest.mark.parametrize("field,value", [
    ("temperature", -0.1), ("temperature", math.inf), ("temperature", math.nan),
    ("top_k", -1), ("top_k", 1.5), ("top_p", 0.0), ("top_p", 1.01), ("top_p", -0.5),
    ("min_p", -0.1), ("min_p", 1.5), ("seed", -3), ("seed", 1.0), ("max_new_tokens", 0),
    ("max_new_tokens", -5), ("stop", ("",)),
])
def test_invalid_values_raise_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = .* is invalid"):
        SamplingParams(**{field: value})


def test_defaults_and_stop_string_normalised():
    params = SamplingParams(stop="END")
    assert params.stop == ("END",) and params.greedy and params.max_new_tokens == 128


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Obviously-correct pipeline on one row, with Python sorting."""
    scores = (logits.double() / params.temperature).tolist()
    keep = set(range(len(scores)))
    order = sorted(keep, key=lambda i: -scores[i])
    if params.top_k:
        keep &= set(order[: params.top_k])
    def softmax_over(ids):
        m = max(scores[i] for i in ids)
        w = {i: math.exp(scores[i] - m) for i in ids}
        z = sum(w.values())
        return {i: w[i] / z for i in ids}
    if params.top_p < 1:
        probs = softmax_over(keep)
        ranked = sorted(keep, key=lambda i: -probs[i])
        kept, mass = [], 0.0
        for i in ranked:  # smallest top set whose mass exceeds top_p... reaches > 1 - (1-top_p)
            kept.append(i)
            mass += probs[i]
            if mass >= params.top_p - 1e-12:
                break
        keep = set(kept)
    if params.min_p:
        probs = softmax_over(keep)
        top = max(probs.values())
        keep = {i for i in keep if probs[i] >= params.min_p * top}
    probs = softmax_over(keep)
    return torch.tensor([probs.get(i, 0.0) for i in range(len(scores))], dtype=torch.float64)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=5),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=1.0, min_p=0.1),
    SamplingParams(temperature=0.9, top_k=10, top_p=0.9, min_p=0.05),
])
def test_pipeline_matches_reference(params):
    torch.manual_seed(0)
    logits = torch.randn(6, 40) * 3
    original = logits.clone()
    probs = logits_to_probs(logits, params)
    assert torch.equal(logits, original), "logits were modified in place"
    assert torch.allclose(probs.sum(-1), torch.ones(6))
    for row in range(6):
        expected = reference_probs(logits[row], params)
        assert torch.equal(probs[row] > 0, expected > 0), f"kept set differs in row {row}"
        assert torch.allclose(probs[row].double(), expected, atol=1e-6)


def test_top_p_tiny_keeps_the_most_likely_token():
    probs = logits_to_probs(torch.tensor([[1.0, 3.0, 2.0]]), SamplingParams(temperature=1, top_p=1e-9))
    assert probs.tolist() == [[0.0, 1.0, 0.0]]


def test_greedy_and_non_finite():
    assert greedy_tokens(torch.tensor([[0.0, 2.0, 2.0, 1.0]])).tolist() == [1]  # first max wins
    with pytest.raises(ValueError, match="temperature > 0"):
        logits_to_probs(torch.zeros(3), SamplingParams(temperature=0))
    with pytest.raises(ValueError, match="non-finite"):
        check_finite(torch.tensor([0.0, math.nan]))
    check_finite(torch.tensor([0.0, 1.0]))


def test_sample_from_probs_follows_the_distribution_and_skips_zeros():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    rng = make_rng(1)
    draws = sample_from_probs(probs.expand(50_000, -1), rng)
    counts = torch.bincount(draws, minlength=6)
    assert counts[probs == 0].sum() == 0
    assert gof_pvalue(counts, probs) > ALPHA
    # Broken control: the same test rejects a wrong distribution.
    assert gof_pvalue(counts, torch.tensor([0.0, 0.45, 0.0, 0.35, 0.2, 0.0])) < ALPHA


def test_seeded_generators_repeat():
    a = torch.rand(4, generator=make_rng(7))
    b = torch.rand(4, generator=make_rng(7))
    c = torch.rand(4, generator=make_rng(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("kwargs,field", [
    ({"temperature": 1e-45}, "temperature"), ({"temperature": True}, "temperature"),
    ({"top_p": True}, "top_p"), ({"repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"seed": 2**64}, "seed"), ({"stop": 5}, "stop"), ({"stop": None}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"stop_token_ids": "12"}, "stop_token_ids"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"logit_bias": None}, "logit_bias"),
])
def test_wrong_types_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field} = "):
        SamplingParams(**kwargs)
