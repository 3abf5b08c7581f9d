"""Token trees (exactspec.trees): the target scores every node of a tree bit for bit as the
chain of its path, keeps the accepted path's cache rows; tree verification commits tokens
that follow p exactly (its broken controls fail); the head's trees keep greedy output equal
to plain decoding; refusals. The audit of tree drafting on a tiny target is in
test_audit.py (``head-tree``)."""

from __future__ import annotations

import pytest
import torch

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.audit.broken import accept_every_draft, resample_without_residual
from exactspec.backends import native
from exactspec.backends.base import UnsupportedModelError, forward_one, new_sequence_id
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import Proposal, Proposer
from exactspec.proposers.head import TREE_BRANCH, HeadProposer
from exactspec.proposers.spec import parse_proposer
from exactspec.sampling import make_rng
from exactspec.trees import TreePaths
from exactspec.verification import rejection_sample, verify_tree

from conftest import tiny_backend
from gof import ALPHA, gof_pvalue

PROMPT = [3, 5, 7, 9, 11]
# root (row 0) → 1, 2, 3; 1 → 4, 5; 2 → 6; 4 → 7
TOKENS = [13, 20, 21, 22, 30, 31, 32, 40]
PARENTS = [-1, 0, 0, 0, 1, 1, 2, 4]


@pytest.fixture(params=["native", "native-portable", "pytorch"])
def target(request, monkeypatch):
    """A tiny backend on exactspec's native kernels (the best path this CPU runs, or the
    portable C one), or on the PyTorch fallback."""
    if request.param == "pytorch":
        monkeypatch.setattr(native, "load", lambda: None)
    elif native.load() is None:
        pytest.skip("no C compiler: the native kernels are not built")
    elif request.param == "native-portable":
        monkeypatch.setattr(native.load(), "isa", "portable")
    backend = tiny_backend(0)
    assert ("native" in backend.description) == (request.param != "pytorch")
    backend.record_hidden_features([0, 1])
    return backend


def test_tree_paths():
    tree = TreePaths(PARENTS)
    assert tree.paths[7] == [0, 1, 4, 7] and tree.paths[6] == [0, 2, 6]
    assert tree.depths == [0, 1, 1, 1, 2, 2, 2, 3]
    assert tree.offsets.tolist()[-1] == len(tree.rows) == sum(d + 1 for d in tree.depths)
    with pytest.raises(ValueError, match="node 2's parent 2"):
        TreePaths([-1, 0, 2])


def test_each_node_is_scored_bit_for_bit_as_the_chain_of_its_path(target):
    tree_id = new_sequence_id()
    target.prefill(tree_id, PROMPT)
    logits = target.forward_tree(tree_id, TOKENS, PARENTS)  # [8, vocab]
    assert target.num_cached_tokens(tree_id) == len(PROMPT) + len(TOKENS)
    for node, path in enumerate(TreePaths(PARENTS).paths):
        chain_id = new_sequence_id()
        target.prefill(chain_id, PROMPT)
        chain = forward_one(target, chain_id, [TOKENS[i] for i in path])
        assert torch.equal(chain[-1], logits[node]), node
        target.release(chain_id)
    target.release(tree_id)


def test_retain_keeps_the_accepted_path_as_if_it_alone_had_been_scored(target):
    tree_id, chain_id = new_sequence_id(), new_sequence_id()
    target.prefill(tree_id, PROMPT)
    target.forward_tree(tree_id, TOKENS, PARENTS)
    target.retain(tree_id, len(TOKENS), [0, 1, 4, 7])
    target.prefill(chain_id, PROMPT)
    chain = forward_one(target, chain_id, [13, 20, 30, 40, 50])
    assert target.num_cached_tokens(tree_id) == len(PROMPT) + 4
    assert torch.equal(target.hidden_features(tree_id, 0),
                       target.hidden_features(chain_id, 0)[:-1])
    assert torch.equal(forward_one(target, tree_id, [50])[0], chain[-1])
    target.retain(tree_id, 3, [0, 1])  # a prefix: a rollback
    assert target.num_cached_tokens(tree_id) == len(PROMPT) + 4
    for bad in ([1, 0], [0, 3], [0, 0]):
        with pytest.raises(ValueError, match="retain"):
            target.retain(tree_id, 3, bad)
    for tokens, parents in (([1, 2], [-1, -1]), ([1, 2], [-1]), ([1, 2], [0, -1])):
        with pytest.raises(ValueError, match="parent|root|one parent per node"):
            target.forward_tree(tree_id, tokens, parents)


# --- tree verification on synthetic distributions ----------------------------------------

VOCAB = 16
N = 12_000


def synthetic_tree(temperature: float = 1.0):
    """Random target logits for the rows of TOKENS' tree over a vocabulary of 16 (tokens
    mapped into it), with the children of the root chosen among p's likely tokens so that
    every depth is reached often."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(len(TOKENS), VOCAB, generator=generator) * 1.5
    order = logits[0].argsort(descending=True).tolist()
    order1 = logits[1].argsort(descending=True).tolist()
    order4 = logits[4].argsort(descending=True).tolist()
    order2 = logits[2].argsort(descending=True).tolist()
    tokens = [order[1], order[0], order[5], order1[0], order1[2], order2[0], order4[0]]
    return tokens, [p - 1 for p in PARENTS[1:]], logits, SamplingParams(temperature=temperature)


def committed_counts(sampler, greedy: bool = False):
    """Counts of the first committed token, of the second after the root's child
    ``tokens[0]`` (row 1) was accepted, and of accepted drafts per depth."""
    tokens, parents, logits, params = synthetic_tree(0.0 if greedy else 1.0)
    pipeline = LogitsPipeline(params, [1, 2], VOCAB)
    rng = make_rng(7)
    first, second, accepted = torch.zeros(VOCAB), torch.zeros(VOCAB), [0, 0, 0]
    for _ in range(1 if greedy else N):
        verified = verify_tree([1, 2], tokens, parents, logits, pipeline, rng, sampler)
        first[verified.committed[0]] += 1
        if verified.path[:1] == [1]:
            second[verified.committed[1]] += 1
        for depth in range(verified.num_accepted):
            accepted[depth] += 1
        assert verified.committed[:-1] == [tokens[row - 1] for row in verified.path]
    p = logits.softmax(-1)
    return first, second, accepted, p, verified


def test_tree_verification_commits_tokens_that_follow_p():
    first, second, accepted, p, _ = committed_counts(rejection_sample)
    assert gof_pvalue(first, p[0]) > ALPHA
    assert second.sum() > 1000 and gof_pvalue(second, p[1]) > ALPHA
    tokens, *_ = synthetic_tree()
    # depth 1 is accepted with probability p(children of the root), as plain sampling would
    expected = N * float(p[0, tokens[:3]].sum())
    assert abs(accepted[0] - expected) < 5 * (expected * (1 - expected / N)) ** 0.5, accepted
    assert accepted[1] > 0.1 * N and accepted[2] > 0.01 * N, accepted


@pytest.mark.parametrize("broken", [accept_every_draft, resample_without_residual])
def test_broken_tree_verifiers_are_caught(broken):
    first, second, _, p, _ = committed_counts(broken)
    assert gof_pvalue(first, p[0]) < ALPHA or gof_pvalue(second, p[1]) < ALPHA


def test_greedy_tree_verification_follows_the_argmax_through_the_tree():
    tokens, _, logits, _ = synthetic_tree()
    *_, verified = committed_counts(rejection_sample, greedy=True)
    # the root's argmax is tokens[1] (row 2), whose argmax is its one child tokens[5] (row 6)
    assert verified.path == [2, 6]
    assert verified.committed == [tokens[1], tokens[5], int(logits[6].argmax())]


# --- the head's trees in the engine ------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_target():
    return tiny_backend(0)


PROMPTS = [[1, 2, 3, 4, 5], [9, 9, 8], [30, 31, 2, 2, 40, 41, 7, 1]]


@pytest.mark.parametrize("nodes", [1, 6])
def test_tree_drafting_keeps_greedy_output_equal_to_plain_decoding(tiny_target, tiny_head_file,
                                                                  nodes):
    proposer = HeadProposer(tiny_target, tiny_head_file, tree_nodes=nodes)
    speculative = SpeculativeGenerator(tiny_target, proposer, 3, "constant")
    plain = SpeculativeGenerator(tiny_target, None, 0)
    params = SamplingParams(max_new_tokens=40)
    accepted = [0, 0, 0]
    for prompt in PROMPTS:
        result = speculative.generate(prompt, params)
        assert result.token_ids == plain.generate(prompt, params).token_ids
        drafting_cycles = result.stats.cycles - result.stats.chosen_k_histogram[0]
        assert 0 < drafting_cycles * min(nodes, TREE_BRANCH) <= result.stats.tree_nodes \
            <= drafting_cycles * nodes  # fewer where only depth 1 fits before the end
        accepted = [a + b for a, b in zip(accepted, result.stats.accepted_per_position)]
    assert accepted[0] > 0 and (nodes == 1 or accepted[1] > 0), accepted


def test_a_trees_nodes_are_its_value_ordered_best_within_the_budget(tiny_target,
                                                                     tiny_head_file):
    proposer = HeadProposer(tiny_target, tiny_head_file, tree_nodes=5)
    generator = SpeculativeGenerator(tiny_target, proposer, 3, "constant")
    pipeline = LogitsPipeline(SamplingParams(), PROMPTS[0], tiny_target.vocab_size)
    sequence = generator._sequence
    tiny_target.prefill(sequence, PROMPTS[0][:-1])
    proposer.follow(sequence)
    proposal = proposer.propose(PROMPTS[0], 3, pipeline, make_rng(0))
    tiny_target.release(sequence)
    assert len(proposal) == 5 and proposal.probs is None
    assert proposal.parents[0] == -1 and all(p < i for i, p in enumerate(proposal.parents))
    chain = HeadProposer(tiny_target, tiny_head_file)
    chain.follow(sequence)
    tiny_target.prefill(sequence, PROMPTS[0][:-1])
    first = chain.propose(PROMPTS[0], 1, pipeline, make_rng(0)).token_ids[0]
    tiny_target.release(sequence)
    assert proposal.token_ids[0] == first  # the most likely child comes first
    siblings = [t for t, p in zip(proposal.token_ids, proposal.parents) if p == -1]
    assert len(set(siblings)) == len(siblings)


def test_refusals(tiny_target, tiny_head_file):
    class TreeDrafter(Proposer):
        drafts_trees = True

        def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
            return Proposal([1], parents=[-1])

    class NoTrees:  # what the engine reads of a backend that scores no trees
        batch_invariant, scores_trees, description = True, False, "llama.cpp"

    with pytest.raises(UnsupportedModelError, match="does not score; use the native \\(a GGUF "
                                                    "file\\) or transformers backend"):
        SpeculativeGenerator(NoTrees(), TreeDrafter(), 2, "constant")
    with pytest.raises(ValueError, match="tree = 0 is invalid"):
        HeadProposer(tiny_target, tiny_head_file, tree_nodes=0)
    assert parse_proposer("head:tree=6").tree == 6
    assert parse_proposer("head:x.safetensors:tree=2").head == "x.safetensors"
    for spec, message in (("head:tree=0", "must be ≥ 1"), ("suffix:tree=3", "use one of"),
                          ("head:tree=a", "tree = 'a' is not an integer")):
        with pytest.raises(ValueError, match=message):
            parse_proposer(spec)


@pytest.mark.parametrize("head_dim", [64, 40, 36])  # 32-dim blocks, then 8-dim, then single
def test_native_attention_is_each_querys_own_whatever_the_path_and_the_other_queries(head_dim):
    """The AVX2 kernel takes all queries of a head together; each query's output equals
    that query alone over exactly its keys, bit for bit, on every path the machine runs
    (AVX-512, AVX2, portable C: the same bits on all), for a chain and for a tree."""
    kernels = native.load()
    if kernels is None:
        pytest.skip("the native kernels cannot be built here")
    generator = torch.Generator().manual_seed(2)
    heads, kv_heads, before = 6, 2, 37
    try:
        # a chain of 21 queries (three blocks of 8: the later ones score the first new keys
        # together), and a tree
        for tree in (None, TreePaths(PARENTS)):
            nq = 21 if tree is None else len(PARENTS)
            query = torch.randn(heads, nq, head_dim, generator=generator)
            keys, values = (torch.randn(kv_heads, before + nq, head_dim, generator=generator)
                            for _ in range(2))
            outputs = {}
            for isa in kernels.paths:
                kernels.isa = isa
                out = torch.empty(nq, heads, head_dim)
                kernels.attention(query, keys, values, 0.125, out, tree=tree)
                outputs[isa] = out
                for i in range(nq):  # query i alone, over the cache and its path as a chain
                    rows = list(range(before)) + [before + r for r in (
                        range(i + 1) if tree is None else tree.paths[i])]
                    alone = torch.empty(1, heads, head_dim)
                    kernels.attention(query[:, i:i + 1], keys[:, rows].contiguous(),
                                      values[:, rows].contiguous(), 0.125, alone)
                    assert torch.equal(alone[0], out[i]), (isa, tree is not None, i)
            assert all(torch.equal(out, outputs["portable"]) for out in outputs.values())
    finally:
        kernels.isa = kernels.best_isa
