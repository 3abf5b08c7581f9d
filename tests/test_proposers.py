"""Proposers: prompt lookup and suffix matching rules; draft model vocabulary handling; a
matcher with a model behind it (FallbackProposer)."""

import pytest
import torch

from exactspec import (DraftModelProposer, PromptLookupProposer, SamplingParams, SuffixCorpus,
                       SuffixProposer,
                       SpeculativeGenerator, UnsupportedModelError)
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import Proposal
from exactspec.proposers.fallback import FallbackProposer
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
    proposer = DraftModelProposer(draft, target)
    result = SpeculativeGenerator(target, proposer, 4).generate([1, 2, 3], params)
    assert result.token_ids == expected.token_ids
    with pytest.raises(ValueError, match="not held"):  # the draft's sequence was freed
        draft.num_cached_tokens(proposer.sequence_id)


def test_draft_cache_follows_the_context():
    target = tiny_backend(0)
    draft = tiny_backend(1)
    proposer = DraftModelProposer(draft, target)
    proposer.propose([1, 2, 3], 4, pipe(GREEDY), G)
    assert draft.num_cached_tokens(proposer.sequence_id) == 3 + 3  # context + all drafts but the last
    proposer.propose([1, 2, 3, 9, 9], 2, pipe(GREEDY), G)  # a diverging context
    assert draft.num_cached_tokens(proposer.sequence_id) == 5 + 1
    fresh = DraftModelProposer(tiny_backend(model=draft.model), target)
    assert proposer.propose([1, 2, 3, 9, 9, 4], 3, pipe(GREEDY), G).token_ids == \
        fresh.propose([1, 2, 3, 9, 9, 4], 3, pipe(GREEDY), G).token_ids


def suffix(context, k, min_confidence=0.1, policy_min_confidence=0.0, proposer=None):
    proposer = proposer or SuffixProposer(1, 8, min_confidence)
    return proposer.propose(context, k, pipe(GREEDY), G, policy_min_confidence).token_ids


def test_suffix_drafts_the_continuation_of_the_longest_earlier_match_while_likely():
    # [1, 2, 3] occurred at the start followed by 9, 9, 3: the match grows as it is drafted
    assert suffix([1, 2, 3, 9, 9, 3, 7, 5, 1, 2, 3], 2) == [9, 9]
    # a copied passage: the match lengthens every step, so the whole of k is drafted
    passage = list(range(10, 30))
    assert suffix(passage + passage[:3], 8) == passage[3:11]
    assert suffix([1, 2, 3, 4], 4) == []  # nothing occurred before
    assert suffix([5], 4) == []


def test_suffix_takes_the_most_frequent_continuation_and_stops_when_unlikely():
    context = [1, 5, 1, 5, 1, 6, 1]
    # after 1: 5 twice, 6 once (score 2/3 · 1/2); after 1, 5: 1 twice (score 1 · 2/3);
    # after 1, 5, 1: 5 and 6 once each (score 1/2 · 3/4): the product 0.083 < 0.1 stops it
    assert suffix(context, 4) == [5, 1]
    assert suffix(context, 4, min_confidence=0.0)[:3] == [5, 1, 6]  # a tie: the most recent
    assert suffix(context, 4, policy_min_confidence=0.3) == [5]  # the confidence policy's threshold
    with pytest.raises(ValueError, match="min_confidence"):
        SuffixProposer(1, 8, 1.0)
    with pytest.raises(ValueError, match="max_ngram"):
        SuffixProposer(3, 2)


def test_suffix_index_grows_incrementally_and_resets():
    rng = torch.Generator().manual_seed(0)
    sequence = torch.randint(0, 6, (300,), generator=rng).tolist()
    growing = SuffixProposer(1, 5, 0.0)
    for end in range(2, 300, 7):  # one proposer fed the growing sequence = a fresh one each time
        assert suffix(sequence[:end], 6, proposer=growing) == suffix(
            sequence[:end], 6, proposer=SuffixProposer(1, 5, 0.0)), end
    growing.reset()
    assert suffix([7, 8, 7], 2, proposer=growing) == [8, 7]  # nothing of the old sequence left
    assert suffix([7, 3, 3, 7], 2, proposer=growing) == [3, 3]  # another sequence: re-indexed


# --- the process-wide corpus of earlier outputs -----------------------------------------

def test_corpus_is_bounded_evicts_the_oldest_and_clears():
    corpus = SuffixCorpus(max_tokens=10, min_ngram=1, max_ngram=3)
    corpus.add([1, 2, 3, 4, 5, 6])
    assert corpus.best([2, 3])[0] == 4
    corpus.add([7, 8, 9, 10, 11])  # 11 tokens > 10: the first output goes
    assert corpus.num_tokens == 5 and corpus.num_outputs == 1
    assert corpus.best([2, 3]) is None and corpus.best([8, 9])[0] == 10
    assert all(count > 0 for held in corpus._scopes.values()
               for followers in held.index.next.values() for count, _ in followers.values())
    corpus.add(list(range(100, 130)))  # longer than the bound: its last 10 tokens are kept
    assert corpus.num_tokens == 10 and corpus.best([125])[0] == 126 and corpus.best([105]) is None
    corpus.clear()
    assert corpus.num_tokens == corpus.num_ngrams == 0 and corpus.best([126]) is None
    with pytest.raises(ValueError, match="max_tokens"):
        SuffixCorpus(0)
    with pytest.raises(ValueError, match="max_scopes = 0"):
        SuffixCorpus(10, max_scopes=0)


def test_corpus_drafts_earlier_outputs_except_in_reproducible_runs():
    corpus = SuffixCorpus(1000)
    proposer = SuffixProposer(1, 8, 0.0, corpus=corpus)
    earlier = [9, 9, 1, 2, 3, 4, 5, 6]
    proposer.reset()
    proposer.end_sequence(earlier, num_prompt_tokens=2)  # output: 1 2 3 4 5 6
    assert corpus.num_tokens == 6
    proposer.reset()
    assert suffix([7, 7, 2, 3], 3, proposer=proposer) == [4, 5, 6]
    proposer.reset(reproducible=True)
    assert suffix([7, 7, 2, 3], 3, proposer=proposer) == []
    assert suffix([7, 7, 2, 3], 3, proposer=SuffixProposer(1, 8, 0.0)) == []


def test_corpus_scopes_draft_only_their_own_outputs_each_within_its_own_bound():
    """Issue 45: one scope's volume never evicts another's outputs (a shared bound let a
    client sense others' traffic through its own acceptance); beyond ``max_scopes`` the
    least recently used scope goes whole."""
    corpus = SuffixCorpus(max_tokens=10, min_ngram=1, max_ngram=3, max_scopes=2)
    proposer = SuffixProposer(1, 8, 0.0, corpus=corpus)
    proposer.reset(scope="alice")
    proposer.end_sequence([9, 1, 2, 3, 4], num_prompt_tokens=1)  # alice's output: 1 2 3 4
    for scope, drafted in (("alice", [3, 4]), ("bob", []), (None, [])):
        proposer.reset(scope=scope)
        assert suffix([7, 1, 2], 2, proposer=proposer) == drafted
    assert corpus.best([1, 2], "alice")[0] == 3 and corpus.best([1, 2]) is None
    assert corpus.num_scopes == 1
    for _ in range(5):  # bob writes 35 tokens, far beyond the bound: only his own go
        corpus.add([5, 6, 7, 8, 9, 10, 11], scope="bob")
    assert corpus.num_scopes == 2 and corpus.scope_tokens("bob") == 7
    assert corpus.scope_tokens("alice") == 4 and corpus.best([1, 2], "alice")[0] == 3
    assert corpus.best([6, 7], "bob")[0] == 8 and corpus.num_tokens == 11
    corpus.best([1, 2], "alice")  # alice drafts: bob is now the least recently used
    corpus.add([20, 21], scope="carol")  # a third scope evicts bob whole
    assert corpus.num_scopes == 2 and corpus.scope_tokens("bob") == 0
    assert corpus.best([6, 7], "bob") is None and corpus.best([1, 2], "alice")[0] == 3


class Recorder:
    """A stand-in proposer: drafts ``drafts`` after any context, records every call."""

    supports_min_confidence = estimates_acceptance = drafts_trees = batchable = False
    drafts_in_steps = False
    corpus = None

    def __init__(self, drafts, **capabilities):
        self.drafts, self.calls = drafts, []
        self.__dict__.update(capabilities)

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        self.calls.append(("propose", k, min_confidence))
        return Proposal(self.drafts[:k])

    def __getattr__(self, name):  # follow, observe, reset, end_sequence: recorded
        if name.startswith("__"):
            raise AttributeError(name)
        return lambda *args: self.calls.append((name, *args))


def test_the_model_drafts_only_where_the_matcher_has_nothing():
    matcher, model = Recorder([5, 6], batchable=True, corpus="c"), Recorder(
        [7], supports_min_confidence=True, estimates_acceptance=True, drafts_trees=True,
        batchable=True)
    both = FallbackProposer(matcher, model)
    assert (both.supports_min_confidence, both.estimates_acceptance, both.drafts_trees,
            both.batchable, both.drafts_for_free, both.corpus) == (True, True, True, True,
                                                                   False, "c")
    assert both.propose([1, 2], 4, pipe(GREEDY), G, 0.3).token_ids == [5, 6]
    assert model.calls == [] and matcher.calls == [("propose", 4, 0.0)]  # its own threshold
    both.observe(1)
    assert matcher.calls[-1] == ("observe", 1)
    matcher.drafts = []
    assert both.propose([1, 2], 4, pipe(GREEDY), G, 0.3).token_ids == [7]
    assert model.calls == [("propose", 4, 0.3)]  # the policy's threshold is the model's
    both.observe(0)
    assert model.calls[-1] == ("observe", 0) and matcher.calls[-1][0] == "propose"
    both.follow(3)
    both.reset(True, "scope")
    both.end_sequence([1, 2, 7], 2)
    for part in (matcher, model):
        assert part.calls[-3:] == [("follow", 3), ("reset", True, "scope"),
                                   ("end_sequence", [1, 2, 7], 2)]
    assert not FallbackProposer(Recorder([]), Recorder([], batchable=True)).batchable


def test_suffix_then_a_draft_model_keeps_the_greedy_output():
    target = tiny_backend(0)
    proposer = FallbackProposer(SuffixProposer(2, 8, 0.0),
                                DraftModelProposer(tiny_backend(model=target.model), target))
    speculative = SpeculativeGenerator(target, proposer, 3, "constant")
    plain = SpeculativeGenerator(target, None, 0)
    params = SamplingParams(max_new_tokens=30)
    for prompt in ([1, 2, 3, 4, 5], [30, 31, 2, 2, 40, 41, 7, 1]):
        result = speculative.generate(prompt, params)
        assert result.token_ids == plain.generate(prompt, params).token_ids
        assert result.stats.accepted_tokens > 0


def test_a_draft_vocabulary_drafts_only_its_tokens_with_q_normalised_over_them():
    """The draft scores its vocabulary's columns only: every drafted token is in it, q is
    zero outside it and sums to 1 over it; greedy drafting (the argmax from the draft's
    own logits) keeps the greedy output."""
    from conftest import RestrictedLogits

    target = tiny_backend(0)
    vocabulary = [*range(0, target.vocab_size, 2), *target.eos_token_ids]
    proposer = DraftModelProposer(RestrictedLogits(tiny_backend(3)), target,
                                  draft_vocabulary=vocabulary)
    assert proposer.draft_token_ids.tolist() == sorted(set(vocabulary))
    assert proposer.description.endswith(f"; draft vocabulary {len(set(vocabulary))}")
    params = SamplingParams(temperature=1.0, seed=0)
    pipeline = LogitsPipeline(params, [1, 2, 3], target.vocab_size)
    drafted = []
    for seed in range(20):
        proposal = proposer.propose([1, 2, 3, seed % 7], 4, pipeline, make_rng(seed))
        outside = [i for i in range(target.vocab_size) if i not in set(vocabulary)]
        assert proposal.probs.shape == (4, target.vocab_size)
        assert torch.all(proposal.probs[:, outside] == 0)
        assert torch.allclose(proposal.probs.sum(-1), torch.ones(4))
        drafted += proposal.token_ids
    assert set(drafted) <= set(vocabulary) and len(set(drafted)) > 5
    speculative = SpeculativeGenerator(target, DraftModelProposer(
        RestrictedLogits(tiny_backend(model=target.model)), target, draft_vocabulary=vocabulary),
        3, "constant")
    plain = SpeculativeGenerator(target, None, 0)
    greedy = SamplingParams(max_new_tokens=30)
    result = speculative.generate([1, 2, 3, 4, 5], greedy)
    assert result.token_ids == plain.generate([1, 2, 3, 4, 5], greedy).token_ids
    assert 0 < result.stats.accepted_tokens < result.stats.drafted_tokens  # odd ids: recovered


def test_a_draft_vocabulary_that_cannot_be_had_is_refused():
    """A draft vocabulary needs a backend that restricts its logits, and a size N a table
    for the tokenizer; the default is then the whole vocabulary, silently."""
    from conftest import RestrictedLogits

    from exactspec.backends.base import UnsupportedModelError

    target = tiny_backend(0)
    assert DraftModelProposer(tiny_backend(1), target).draft_token_ids is None
    assert DraftModelProposer(tiny_backend(1), target).description.endswith("; whole vocabulary")
    assert DraftModelProposer(RestrictedLogits(tiny_backend(1)), target).draft_token_ids is None
    assert DraftModelProposer(tiny_backend(1), target, "all").draft_token_ids is None
    with pytest.raises(UnsupportedModelError, match="needs the native backend"):
        DraftModelProposer(tiny_backend(1), target, draft_vocabulary=[0, 1, 2])
    with pytest.raises(UnsupportedModelError, match="needs a token-frequency table"):
        DraftModelProposer(RestrictedLogits(tiny_backend(1)), target, draft_vocabulary=16)
    with pytest.raises(ValueError, match="a draft vocabulary holds token ids in \\[0, 64\\)"):
        DraftModelProposer(RestrictedLogits(tiny_backend(1)), target, draft_vocabulary=[64])
    with pytest.raises(ValueError, match="vocab = 'some' is invalid"):
        DraftModelProposer(RestrictedLogits(tiny_backend(1)), target, draft_vocabulary="some")


def test_greedy_drafting_stops_where_the_drafts_own_confidence_falls_below_the_threshold():
    """The confidence policy's stop (llama.cpp's p_min) on the greedy fast path: the draft
    stops before the first token whose softmax maximum is below min_confidence, and drafts
    its argmax until then."""
    target, draft = tiny_backend(0), tiny_backend(3)
    context = [1, 2, 3, 4]
    reference, tokens, confidences = tiny_backend(model=draft.model), [], []
    reference.prefill(0, context[:-1])
    pending = context[-1:]
    for _ in range(4):
        logits = reference.forward([(0, pending)], 1)[0][0]
        confidences.append(float(logits.softmax(-1).max()))
        tokens.append(int(logits.argmax()))
        pending = tokens[-1:]
    pipeline = pipe(GREEDY)
    assert pipeline.is_identity
    for stop in range(4):
        threshold = (confidences[stop] + min(confidences[:stop], default=1.0)) / 2
        if any(c < threshold for c in confidences[:stop]) or confidences[stop] >= threshold:
            continue  # the confidences do not order so that the draft stops exactly here
        proposer = DraftModelProposer(tiny_backend(model=draft.model), target)
        proposal = proposer.propose(context, 4, pipeline, G, min_confidence=threshold)
        assert proposal.token_ids == tokens[:stop]
    proposer = DraftModelProposer(tiny_backend(model=draft.model), target)
    assert proposer.propose(context, 4, pipeline, G, min_confidence=1e-9).token_ids == tokens


def test_a_draft_model_spec_with_weights_loads_the_draft_converted_to_them():
    """draft:MODEL:weights=W asks the loader for the draft in GGUF type W, weights=file as the
    loader gives it; without weights=, a draft of more than 6 bits per weight (a native
    backend's Q8_0 file) is loaded again converted to Q4_0, a narrower one kept."""
    from exactspec.proposers.build import build_proposer
    from exactspec.proposers.spec import parse_proposer

    target, asked = tiny_backend(0), []

    def load(name, **options):
        asked.append((name, options))
        draft = tiny_backend(1)
        draft.model.bits_per_weight = 8.5 if name == "wide" else 4.5
        return draft

    for spec in ("draft:d", "draft:d:weights=file", "draft:d:weights=q4_0",
                 "draft:wide:weights=file", "draft:wide"):
        assert isinstance(build_proposer(parse_proposer(spec), target, load), DraftModelProposer)
    assert asked == [("d", {}), ("d", {}), ("d", {"weight_type": "Q4_0"}), ("wide", {}),
                     ("wide", {}), ("wide", {"weight_type": "Q4_0"})]
