"""The rejection sampler: checked against a slow reference, on every edge case of the
exactness contract, and statistically against the target distribution with broken
controls that the same test must reject."""

import pytest
import torch

from exactspec.logits_pipeline import logits_to_probs
from exactspec.sampling import SamplingParams, make_rng
from exactspec.verification import (PADDING_TOKEN_ID, greedy_accept_length, greedy_verify,
                                    rejection_sample)

from gof import ALPHA, gof_pvalue


def reference_rejection_sample(draft_ids, draft_probs, target_probs, rng,
                               variant: str = "correct"):
    """Leviathan et al. Algorithm 1, one row and one position at a time, in Python floats.

    Consumes random numbers in the documented order (batch×k acceptance uniforms, then one
    uniform per row for the final token), so it must agree token for token with the fast
    implementation. ``variant`` builds the broken controls:
    ``accept_always`` keeps every draft; ``no_residual`` resamples from p instead of the
    residual after a rejection.
    """
    batch, k = draft_ids.shape
    vocab = target_probs.shape[-1]
    u_accept = torch.rand((batch, k), dtype=torch.float64, generator=rng).tolist()
    u_final = torch.rand((batch, 1), dtype=torch.float64, generator=rng)[:, 0].tolist()
    outputs, accepted_counts = [], []
    for b in range(batch):
        out = []
        final = None
        for i in range(k):
            x = int(draft_ids[b, i])
            p = float(target_probs[b, i, x])
            q = 1.0 if draft_probs is None else float(draft_probs[b, i, x])
            if variant == "accept_always" or (q > 0 and u_accept[b][i] < p / q):
                out.append(x)
                continue
            p_row = target_probs[b, i].double().tolist()
            q_row = ([1.0 if j == x else 0.0 for j in range(vocab)] if draft_probs is None
                     else draft_probs[b, i].double().tolist())
            residual = [max(0.0, pj - qj) for pj, qj in zip(p_row, q_row)]
            final = p_row if variant == "no_residual" or sum(residual) == 0 else residual
            break
        num_accepted = len(out)
        if final is None:
            final = target_probs[b, k].double().tolist()
        target, cumulative = u_final[b] * sum(final), 0.0
        token = max(j for j in range(vocab) if final[j] > 0)
        for j, w in enumerate(final):
            cumulative += w
            if cumulative > target and w > 0:
                token = j
                break
        out.append(token)
        outputs.append(out + [PADDING_TOKEN_ID] * (k + 1 - len(out)))
        accepted_counts.append(num_accepted)
    return torch.tensor(outputs), torch.tensor(accepted_counts)


def random_case(seed, batch, k, vocab, point_mass=False, sparse=False):
    g = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=g) * 2, -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=g) * 2, -1)
    if sparse:  # exact zeros in both, as top-k/top-p filters produce
        target = target * (torch.rand(target.shape, generator=g) > 0.4)
        target[..., 0] += 0.05
        target = target / target.sum(-1, keepdim=True)
        draft = draft * (torch.rand(draft.shape, generator=g) > 0.4)
        draft[..., 1] += 0.05
        draft = draft / draft.sum(-1, keepdim=True)
    draft_ids = torch.multinomial(draft.reshape(-1, vocab), 1, generator=g).reshape(batch, k)
    if point_mass:
        draft_ids = torch.randint(vocab, (batch, k), generator=g)
        return draft_ids, None, target
    return draft_ids, draft, target


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("k", [0, 1, 3, 6])
@pytest.mark.parametrize("point_mass,sparse", [(False, False), (True, False), (False, True)])
def test_fast_matches_reference(seed, k, point_mass, sparse):
    draft_ids, draft_probs, target_probs = random_case(seed, 16, k, 12, point_mass, sparse)
    fast = rejection_sample(draft_ids, draft_probs, target_probs, make_rng(seed))
    ref_out, ref_accepted = reference_rejection_sample(draft_ids, draft_probs, target_probs,
                                                       make_rng(seed))
    assert torch.equal(fast.num_accepted, ref_accepted)
    assert torch.equal(fast.output_token_ids, ref_out)


def test_output_layout():
    draft_ids, draft_probs, target_probs = random_case(3, 64, 4, 10)
    out, accepted, _ = rejection_sample(draft_ids, draft_probs, target_probs, make_rng(0))
    assert out.shape == (64, 5) and accepted.shape == (64,)
    assert 0 < accepted.float().mean() < 4  # both accepting and rejecting rows occur
    for b in range(64):
        n = int(accepted[b])
        assert torch.equal(out[b, :n], draft_ids[b, :n])  # accepted drafts come first
        assert out[b, n] >= 0 and (out[b, n + 1:] == PADDING_TOKEN_ID).all()


def test_zero_draft_probability_is_rejected_never_divided():
    target = torch.tensor([[[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]])
    draft = torch.tensor([[[0.0, 1.0, 0.0]]])  # token 0 drafted although q(0) = 0
    for seed in range(50):
        out, accepted, _ = rejection_sample(torch.tensor([[0]]), draft, target, make_rng(seed))
        assert accepted.item() == 0
        assert out[0, 0].item() == 0  # residual max(0, p - q) = [0.5, 0, 0]


def test_zero_target_probability_is_never_accepted():
    target = torch.tensor([[[0.0, 1.0], [0.5, 0.5]]])
    for seed in range(200):
        out, accepted, _ = rejection_sample(torch.tensor([[0]]), None, target, make_rng(seed))
        assert accepted.item() == 0 and out[0, 0].item() == 1


def test_identical_distributions_accept_everything_and_never_nan():
    _, _, target = random_case(0, 32, 4, 9)
    draft_probs = target[:, :4].clone()
    draft_ids = torch.multinomial(draft_probs.reshape(-1, 9), 1).reshape(32, 4)
    out, accepted, _ = rejection_sample(draft_ids, draft_probs, target, make_rng(0))
    assert (accepted == 4).all() and (out >= 0).all()


def test_zero_residual_mass_samples_from_p():
    # p == q exactly and the draft is at p's only token: acceptance is certain except for
    # the strict test with u = 0; force the rejection branch by q(x) = 0 with p == q
    # elsewhere: the residual is 0 everywhere, so the final token comes from p.
    target = torch.tensor([[[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]])
    draft = torch.tensor([[[0.0, 1.0, 0.0]]])
    out, accepted, _ = rejection_sample(torch.tensor([[2]]), draft, target, make_rng(0))
    assert accepted.item() == 0 and out[0].tolist() == [1, PADDING_TOKEN_ID]


def test_shape_errors():
    with pytest.raises(ValueError, match=r"target_probs has shape"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), None, torch.rand(1, 2, 5),
                         make_rng(0))
    with pytest.raises(ValueError, match=r"draft_probs has shape"):
        rejection_sample(torch.zeros(1, 2, dtype=torch.long), torch.rand(1, 3, 5),
                         torch.rand(1, 3, 5), make_rng(0))
    with pytest.raises(ValueError, match=r"greedy_verify needs"):
        greedy_verify(torch.zeros(1, 2, dtype=torch.long), torch.zeros(1, 2, dtype=torch.long))


def test_greedy_verify():
    target = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    draft = torch.tensor([[5, 6, 7], [5, 0, 7], [1, 6, 7]])
    out, accepted, _ = greedy_verify(draft, target)
    assert accepted.tolist() == [3, 1, 0]
    assert out.tolist() == [[5, 6, 7, 8], [5, 6, -1, -1], [5, -1, -1, -1]]
    out, accepted, _ = greedy_verify(torch.zeros(2, 0, dtype=torch.long), torch.tensor([[3], [4]]))
    assert accepted.tolist() == [0, 0] and out.tolist() == [[3], [4]]


# --- statistical exactness on synthetic distributions -------------------------------------

N = 40_000


def committed_distributions(sampler, draft_ids, draft_probs, target_probs):
    """Counts of the first committed token, and of the second given the first accepted."""
    out, accepted = sampler(draft_ids, draft_probs, target_probs, make_rng(1234))[:2]
    vocab = target_probs.shape[-1]
    first = torch.bincount(out[:, 0], minlength=vocab)
    second = torch.bincount(out[accepted >= 1, 1], minlength=vocab)
    return first, second


def synthetic(k, vocab, target_params, draft_params, draft_kind, seed=0):
    """N identical rows: target probs from ``target_params``; drafts sampled from the draft
    pipeline (``draft_kind='sampled'``) or one fixed point-mass draft."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    draft_logits = target_logits[:k] + torch.randn(k, vocab, generator=g)  # similar, not equal
    p = logits_to_probs(target_logits, target_params)
    if draft_kind == "point_mass":
        draft_ids = torch.randint(vocab, (1, k), generator=g).expand(N, k)
        return draft_ids, None, p.expand(N, -1, -1), draft_logits
    q = logits_to_probs(draft_logits, draft_params)
    draft_ids = torch.multinomial(q, N, replacement=True, generator=g).T  # [N, k]
    return draft_ids, q.expand(N, -1, -1), p.expand(N, -1, -1), draft_logits


CASES = {
    "plain": (SamplingParams(temperature=1.0), SamplingParams(temperature=1.0), "sampled"),
    "point_mass": (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8), "point_mass"),
    "target_top_k_draft_top_p": (SamplingParams(temperature=1.0, top_k=6),
                                 SamplingParams(temperature=0.7, top_p=0.6), "sampled"),
    "target_top_p_min_p_draft_plain": (SamplingParams(temperature=1.2, top_p=0.85, min_p=0.05),
                                       SamplingParams(temperature=1.2), "sampled"),
    "target_min_p_draft_top_k": (SamplingParams(temperature=0.9, min_p=0.2),
                                 SamplingParams(temperature=0.9, top_k=3), "sampled"),
}


@pytest.mark.parametrize("case", CASES)
def test_committed_tokens_follow_the_target_distribution(case):
    target_params, draft_params, kind = CASES[case]
    draft_ids, draft_probs, target_probs, _ = synthetic(3, 16, target_params, draft_params, kind)
    first, second = committed_distributions(rejection_sample, draft_ids, draft_probs, target_probs)
    assert gof_pvalue(first, target_probs[0, 0]) > ALPHA
    assert second.sum() > 1000 and gof_pvalue(second, target_probs[0, 1]) > ALPHA


@pytest.mark.parametrize("variant", ["accept_always", "no_residual"])
def test_broken_samplers_are_caught(variant):
    target_params, draft_params, kind = CASES["plain"]
    draft_ids, draft_probs, target_probs, _ = synthetic(3, 16, target_params, draft_params, kind)

    def broken(*args):
        return reference_rejection_sample(*args, variant=variant)

    first, _ = committed_distributions(broken, draft_ids[:8000], draft_probs[:8000],
                                       target_probs[:8000])
    assert gof_pvalue(first, target_probs[0, 0]) < ALPHA


def test_q_from_the_unfiltered_draft_is_caught():
    """Drafts sampled from the top-p-filtered draft, but verified with the unfiltered q:
    the classic mistake the exactness contract forbids; the test must reject it."""
    target_params, draft_params, _ = CASES["target_top_k_draft_top_p"]
    draft_ids, _, target_probs, draft_logits = synthetic(3, 16, target_params, draft_params,
                                                         "sampled")
    wrong_q = logits_to_probs(draft_logits, SamplingParams(temperature=0.7)).expand(N, -1, -1)
    first, _ = committed_distributions(rejection_sample, draft_ids, wrong_q, target_probs)
    assert gof_pvalue(first, target_probs[0, 0]) < ALPHA


def test_greedy_accept_length_agrees_with_greedy_verify():
    rng = torch.Generator().manual_seed(0)
    for k in range(6):
        for _ in range(50):
            target = torch.randint(0, 3, (1, k + 1), generator=rng)
            draft = torch.randint(0, 3, (1, k), generator=rng)
            expected = greedy_verify(draft, target)
            n = greedy_accept_length(draft[0].tolist(), target[0].tolist())
            assert n == int(expected.num_accepted[0])
            assert target[0, : n + 1].tolist() == \
                [t for t in expected.output_token_ids[0].tolist() if t >= 0]


def test_uniforms_are_the_acceptance_draws_and_decide_the_verdicts():
    draft_ids, draft_probs, target_probs = random_case(3, 32, 4, 10)
    result = rejection_sample(draft_ids, draft_probs, target_probs, make_rng(5))
    replay = torch.rand((32, 4), dtype=torch.float64, generator=make_rng(5))
    assert torch.equal(result.uniforms, replay)
    p = target_probs[:, :4].gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()
    q = draft_probs.gather(-1, draft_ids.unsqueeze(-1)).squeeze(-1).double()
    passes = (result.uniforms * q < p).long()
    assert torch.equal(passes.cumprod(dim=-1).sum(dim=-1), result.num_accepted)
    assert greedy_verify(draft_ids, target_probs.argmax(-1)).uniforms is None
