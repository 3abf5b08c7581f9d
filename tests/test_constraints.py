"""Structured output (exactspec.constraints): constraints compile or are refused naming the
construct; greedy output is identical with and without speculation; every sampled output
satisfies its constraint; constrained sampling is exact under speculation (the audit's
test against the target's masked probabilities), and the broken control that masks only
the verified position is caught."""

import copy
import dataclasses
import re

import pytest
import torch

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.audit import ExactspecEngine, audit_distribution
from exactspec.audit.broken import ConstraintControl
from exactspec.constraints import Constraint
from exactspec.proposers import PromptLookupProposer, SuffixProposer
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.request import prepare_request
from exactspec.speculation_length import Choice, ConstantPolicy
from exactspec.verification import verify

from conftest import ALPHABET, perturbed_backend, tiny_backend

EOS = ALPHABET.index("?")
REGEX = r"(ab|cd)+e"
CONSTRAINTS = {  # name → (constraint, what a complete output matches)
    "regex": (Constraint.regex(REGEX), REGEX),
    "choice": (Constraint.choice(["abcd", "abd", "cab"]), "abcd|abd|cab"),
    "grammar": (Constraint.grammar('start: item ("," item)*\nitem: "ab" | "cd" | "b"+'),
                r"(ab|cd|b+)(,(ab|cd|b+))*"),
}


@pytest.fixture(scope="module")
def target():
    return tiny_backend(5, eos=[EOS])


def text_of(target, token_ids):
    """The output's text without its EOS token."""
    return target.tokenizer.decode([t for t in token_ids if t != EOS])


def test_constraints_compile_or_are_refused_naming_the_construct():
    assert Constraint.json_schema('{"type": "object"}').kind == "json_schema"
    assert Constraint.json_object().to_grammar()
    assert Constraint.grammar('root ::= "a" | "b"').kind == "grammar"  # GBNF, converted
    with pytest.raises(ValueError, match="the regex is not supported"):
        Constraint.regex("(ab")
    with pytest.raises(ValueError, match="the JSON schema is not valid JSON"):
        Constraint.json_schema("{nope")
    with pytest.raises(ValueError, match="the json schema is not supported"):
        Constraint.json_schema({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ValueError, match="the grammar is not supported"):
        Constraint.grammar("start: missing_rule")
    with pytest.raises(ValueError, match=r"choices \[\] are invalid"):
        Constraint.choice([])
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(constraint=Constraint.regex("a"), ignore_eos=True)
    with pytest.raises(ValueError, match="constraint"):
        SamplingParams(constraint="a+")


@pytest.mark.parametrize("name", CONSTRAINTS)
@pytest.mark.parametrize("proposer", ["prompt-lookup", "suffix", "draft-model"])
def test_greedy_output_is_identical_with_and_without_speculation(target, name, proposer):
    constraint, pattern = CONSTRAINTS[name]
    make = {"prompt-lookup": lambda: PromptLookupProposer(1, 3),
            "suffix": lambda: SuffixProposer(1, 8, 0.0),
            "draft-model": lambda: DraftModelProposer(perturbed_backend(target, 0.02), target)}
    params = SamplingParams(max_new_tokens=24, constraint=constraint)
    for prompt in ("abcd abcd ab", "cab, cd, bb, ab", "hello"):
        plain = SpeculativeGenerator(target, None).generate(prompt, params)
        fast = SpeculativeGenerator(target, make[proposer](), 3, "constant").generate(
            prompt, params)
        assert fast.token_ids == plain.token_ids, (prompt, plain.text, fast.text)
        if plain.finish_reason == "stop":
            assert plain.token_ids[-1] == EOS
            assert re.fullmatch(pattern, text_of(target, plain.token_ids)), plain.text


def test_every_sampled_output_satisfies_its_constraint(target):
    constraint, pattern = CONSTRAINTS["regex"]
    params = SamplingParams(temperature=1.5, seed=3, max_new_tokens=12, constraint=constraint)
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3, "constant")
    results = generator.generate_samples("abcd abcd abe", params, n=200)
    finished = [r for r in results if r.finish_reason == "stop"]
    assert len(finished) > 50
    for result in results:
        text = text_of(target, result.token_ids)
        if result.finish_reason == "stop":
            assert re.fullmatch(pattern, text), text
        else:  # cut by max_new_tokens: a prefix of a match, never claimed complete
            assert re.fullmatch(r"((ab|cd)+e?|(ab|cd)*(a|c)?)", text), text
    drafted = sum(r.stats.drafted_tokens for r in results)
    assert drafted > 500 and 0 < sum(r.stats.accepted_tokens for r in results) < drafted


K = 3
PROPOSERS = {  # (target) → proposer; the least accepted per block position (of 300 samples)
    "prompt-lookup": (lambda target: PromptLookupProposer(1, 3), [100, 10, 0]),
    "draft-model": (lambda target: DraftModelProposer(perturbed_backend(target, 0.02), target),
                    [300, 200, 50]),
}
SAMPLES = 300


@pytest.mark.parametrize("proposer", PROPOSERS)
def test_constrained_sampling_is_exact_and_masking_only_the_verified_position_is_caught(
        target, proposer):
    """The audit's per-position test against the target's masked probabilities, every
    block position drafted (prompt lookup copies the prompt's c's, which the constraint
    forbids; the draft model drafts from the masked q, deep into the block) and the
    control that judges drafts by the unconstrained p committing forbidden tokens."""
    make, least_accepted = PROPOSERS[proposer]
    params = SamplingParams(temperature=1.0, seed=0, max_new_tokens=K + 1,
                            constraint=Constraint.regex("[ab]+e?"))
    prompts = [target.tokenizer.encode(p) for p in ("abababababab", "abcabcabcab")]

    def engine():
        return ExactspecEngine(SpeculativeGenerator(target, make(target), K, "constant"),
                               "under test")
    good = audit_distribution(target, engine(), prompts, params, SAMPLES, 0.01)
    assert not good.rejected, [(p.impossible, p.positions) for p in good.prompts]
    assert all(a >= least for a, least in zip(good.accepted_per_position, least_accepted)), \
        (good.drafted_per_position, good.accepted_per_position)
    bad = audit_distribution(target, ConstraintControl(engine(), "control"), prompts, params,
                             SAMPLES, 0.01)
    assert bad.rejected and all(p.impossible for p in bad.prompts)


def test_a_draft_the_constraint_forbids_is_rejected_with_certainty(target):
    """Verification masks each drafted row with its own prefix's state: a forbidden draft
    has p = 0, so it is never accepted, and the recovered token is an allowed one."""
    params = SamplingParams(temperature=1.0, seed=0, constraint=Constraint.regex("[ab]+"))
    prompt = target.tokenizer.encode("abab")
    pipeline = prepare_request(target, prompt, params).pipeline
    logits = torch.zeros(3, target.vocab_size)  # flat: every allowed token equally likely
    rng = torch.Generator().manual_seed(0)
    allowed = {ALPHABET.index("a"), ALPHABET.index("b"), EOS}  # EOS once "a" is output
    for draft in (["a", "c"], ["c", "a"]):
        ids = [ALPHABET.index(c) for c in draft]
        results = [verify(prompt, ids, None, logits, pipeline, rng).committed
                   for _ in range(200)]
        forbidden = draft.index("c")
        assert all(len(committed) <= forbidden + 1 for committed in results)  # never past c
        assert {t for committed in results for t in committed} <= allowed
        # 'a' first: accepted about half the time, then c is rejected at row 1 (masked there)
        assert (sum(len(committed) == 2 for committed in results) > 50) == (forbidden == 1)


def test_forced_tokens_are_drafted_first_and_accepted(target):
    """Under a choice whose texts share a long prefix, the prefix is forced: drafted with
    q = 1 and accepted in the first cycle, whatever the proposer drafts after it; the
    output is the same as plain decoding's, sampled or greedy."""
    from exactspec.proposers.forced import ForcedTokenProposer

    constraint = Constraint.choice(["abcdabcd1", "abcdabcd2"])
    for temperature in (0.0, 1.0):
        params = SamplingParams(temperature=temperature, seed=1, max_new_tokens=12,
                                constraint=constraint)
        plain = SpeculativeGenerator(target, None).generate("x", params)
        fast = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 8, "constant") \
            .generate("x", params, trace=True)
        assert fast.token_ids == plain.token_ids
        first = fast.trace[0]
        assert [d.token_id for d in first.drafts[:8]] == target.tokenizer.encode("abcdabcd")
        assert all(d.verdict == "accepted" for d in first.drafts[:8])
    mask = constraint.mask(target.tokenizer.constraint_tokenizer(target.vocab_size, (EOS,)),
                           target.vocab_size)
    assert mask.forced_tokens([]) == target.tokenizer.encode("abcdabcd")
    assert mask.forced_tokens(target.tokenizer.encode("abcdabcd")) == []  # 1 or 2: a choice
    inner = PromptLookupProposer(1, 3)
    wrapped = copy.copy(ForcedTokenProposer(inner))
    assert wrapped.inner is not inner and wrapped.drafts_for_free


class PlainStepsPolicy(ConstantPolicy):
    """Chooses k = 0 every cycle and records what it observes."""

    def __init__(self, num_speculative_tokens):
        super().__init__(num_speculative_tokens)
        self.observed = []

    def choose(self):
        return Choice(0)

    def observe(self, num_drafted, num_accepted, draft_seconds, verify_seconds):
        self.observed.append((num_drafted, num_accepted))


def test_forced_tokens_are_drafted_whatever_k_the_policy_chose(target):
    """A policy that chooses plain steps still gets the forced tokens drafted (free and
    certain), at most num_speculative_tokens of them a cycle; the policy learns only from
    its own drafts (none here), and the output is plain decoding's."""
    constraint = Constraint.choice(["abcdabcd1", "abcdabcd2"])
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=12, constraint=constraint)
    plain = SpeculativeGenerator(target, None).generate("x", params)
    policy = PlainStepsPolicy(3)
    fast = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3, policy).generate(
        "x", params, trace=True)
    assert fast.token_ids == plain.token_ids
    drafted = [[d.token_id for d in cycle.drafts] for cycle in fast.trace]
    forced = target.tokenizer.encode("abcdabcd")
    # 3 forced drafts, accepted, and the bonus token (the 4th, forced too) each cycle
    assert drafted[:3] == [forced[:3], forced[4:7], []]  # then a choice: nothing forced
    assert fast.stats.drafted_tokens == fast.stats.accepted_tokens == 6
    assert policy.observed == [(0, 0)] * len(fast.trace)
    assert fast.stats.chosen_k_histogram[0] == len(fast.trace)  # the policy's k, always 0


def test_the_forced_proposer_drafts_a_constraints_forced_tokens_alone(target):
    """``forced`` drafts the forced tokens and nothing else (nothing at all without a
    constraint); the output is plain decoding's, greedy and sampled."""
    from exactspec.proposers.build import build_proposer
    from exactspec.proposers.forced import ForcedTokenProposer
    from exactspec.proposers.spec import parse_proposer

    proposer = build_proposer(parse_proposer("forced"), target, None)
    assert isinstance(proposer, ForcedTokenProposer) and proposer.inner is None
    assert proposer.drafts_for_free and proposer.batchable and not proposer.drafts_trees
    for constraint in (Constraint.choice(["abcdabcd1", "abcdabcd2"]), None):
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, seed=5, max_new_tokens=12,
                                    constraint=constraint)
            plain = SpeculativeGenerator(target, None).generate("x", params)
            fast = SpeculativeGenerator(target, proposer, 4, "auto").generate(
                "x", params, trace=True)
            assert fast.token_ids == plain.token_ids
            drafted = [d.token_id for cycle in fast.trace for d in cycle.drafts]
            # k = 4 forced drafts, the bonus token (a forced 'a'), the 3 forced left
            expected = target.tokenizer.encode("abcd" "bcd") if constraint else []
            assert drafted == expected


@pytest.mark.parametrize("policy", ["auto", "constant"])
def test_batched_rows_each_follow_their_own_constraint(target, policy):
    """Rows of one batch under different constraints (and one under none), greedy and
    seeded, each equal to decoding it alone (greedy: plain decoding's output); the forced
    tokens are drafted in the batch too."""
    from exactspec import BatchedGenerator

    constraints = [Constraint.choice(["abcdabcd1", "abcdabcd2"]), Constraint.regex(REGEX),
                   None, CONSTRAINTS["grammar"][0]]
    params = [SamplingParams(temperature=temperature, seed=i, max_new_tokens=14,
                             constraint=constraint)
              for i, constraint in enumerate(constraints) for temperature in (0.0, 0.9)]
    prompts = ["x", "abab", "cdcd", "ab,cd"] * 2
    prompts = [prompts[i // 2] for i in range(len(params))]
    plain = SpeculativeGenerator(target, None)
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 4, policy)
    alone = [generator.generate(p, q).token_ids for p, q in zip(prompts, params)]
    results = BatchedGenerator(generator, max_batch_size=4).generate(prompts, params)
    assert [r.token_ids for r in results] == alone
    for p, q, result in zip(prompts, params, results):
        if q.temperature == 0:
            assert result.token_ids == plain.generate(p, q).token_ids
    assert results[0].stats.accepted_tokens >= 6  # 'abcdabcd' forced: drafted, accepted


def test_min_new_tokens_under_a_constraint(target):
    """min_new_tokens bans EOS until that many tokens: a constraint that can go on is
    followed past it (and the output is plain decoding's with speculation); one complete
    before it allows only EOS, so nothing is left, and speculation raises the same error,
    naming the constraint, as plain decoding."""
    from exactspec.logits_pipeline import NoTokenAllowedError

    for constraint, expected in ((Constraint.regex("(ab)+"), None),
                                 (Constraint.choice(["ab"]), NoTokenAllowedError)):
        for temperature in (0.0, 1.0):
            params = SamplingParams(temperature=temperature, seed=2, max_new_tokens=12,
                                    min_new_tokens=5, constraint=constraint)
            outcomes = []
            for proposer in (None, PromptLookupProposer(1, 3)):
                generator = SpeculativeGenerator(target, proposer, 4, "constant")
                try:
                    result = generator.generate("ababab", params)
                    outcomes.append(result.token_ids)
                    assert re.fullmatch("(ab)+", text_of(target, result.token_ids))
                    assert len(result.token_ids) >= 5
                except NoTokenAllowedError as error:
                    assert "the choice ab," in str(error) and error.position == 2
                    outcomes.append(type(error))
            assert outcomes[0] == outcomes[1]
            assert (outcomes[0] is NoTokenAllowedError) == (expected is NoTokenAllowedError)


def test_the_trace_names_a_draft_the_constraint_forbids(target):
    """A drafted token the constraint masks out is traced as ``forbidden`` (rejected with
    certainty), not as an ordinary rejection; without the constraint nothing is."""
    for temperature in (0.0, 1.0):
        generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3, "constant")
        constrained = generator.generate("abcabcabcab", SamplingParams(
            temperature=temperature, seed=0, max_new_tokens=16,
            constraint=Constraint.regex("[ab]+")), trace=True)
        verdicts = [d.verdict for cycle in constrained.trace for d in cycle.drafts]
        assert "forbidden" in verdicts
        forbidden = [d.token_id for c in constrained.trace for d in c.drafts
                     if d.verdict == "forbidden"]
        assert set(forbidden) <= set(target.tokenizer.encode("c")) | {EOS}
        free = generator.generate("abcabcabcab", SamplingParams(
            temperature=temperature, seed=0, max_new_tokens=16), trace=True)
        assert all(d.verdict != "forbidden" for c in free.trace for d in c.drafts)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "pattern": "^[a-e]{1,4}$"},
                         "age": {"type": "integer", "minimum": 0, "maximum": 99}}}
"""A schema whose properties are out of alphabetical order (name before age): the output
must keep the order written."""
PROPOSER_SPECS = ["forced", "prompt-lookup:ngram=1-3", "suffix", "draft:tiny", "early-exit:1",
                  "head:{head}", "head:{head}:tree=6", "suffix+head:{head}",
                  "suffix+head:{head}:tree=6", "prompt-lookup+draft:tiny"]
"""Every proposer kind, chains and trees, combinations included ({head}: the head file)."""


@pytest.fixture(scope="module")
def json_target():
    """The tiny target over a vocabulary that writes JSON."""
    from conftest import JSON_VOCAB

    return tiny_backend(0, eos=[EOS], vocab=JSON_VOCAB, tokenizer_vocab=JSON_VOCAB)


@pytest.fixture(scope="module")
def head_file(json_target, tmp_path_factory):
    """A draft head trained for :func:`json_target`."""
    from conftest import trained_head

    return trained_head(json_target, tmp_path_factory.mktemp("json-head"))


class TestEveryProposerUnderEveryConstraint:
    """Every proposer kind × every kind of constraint × k: greedy output equal to plain
    decoding token for token, every finished sample valid, and drafting exercised. The
    constraints force tokens (the schema's keys and punctuation, a choice's rest), so the
    feature-reading proposers (the head, ``suffix+head``) must draft after forced tokens
    they have no target features for."""

    @staticmethod
    def valid(kind: str, text: str) -> bool:
        if kind == "json":
            import json

            import jsonschema

            value = json.loads(text)
            jsonschema.validate(value, PERSON)
            return list(value) == ["name", "age"]  # the order written
        return re.fullmatch(CONSTRAINTS[kind][1], text) is not None

    @pytest.mark.parametrize("k", [1, 4, 16])
    @pytest.mark.parametrize("kind", ["json", "regex", "choice", "grammar"])
    @pytest.mark.parametrize("spec", PROPOSER_SPECS)
    def test_greedy_equals_plain_and_samples_are_valid(self, json_target, head_file, spec, kind,
                                                       k):
        from exactspec.proposers.build import build_proposer
        from exactspec.proposers.spec import parse_proposer

        target = json_target
        constraint = Constraint.json_schema(PERSON) if kind == "json" else CONSTRAINTS[kind][0]
        draft = perturbed_backend(target, 0.02)
        proposer = build_proposer(parse_proposer(spec.format(head=head_file)), target,
                                  lambda name: draft)
        generator = SpeculativeGenerator(target, proposer, k, "constant")
        plain = SpeculativeGenerator(target, None)
        drafted = 0
        for prompt in ('abcd abcd ab {"name": "ab", "age": 12}', "cab, cd, bb"):
            params = SamplingParams(max_new_tokens=40, constraint=constraint)
            expected = plain.generate(prompt, params)
            result = generator.generate(prompt, params)
            assert result.token_ids == expected.token_ids, (prompt, expected.text, result.text)
            drafted += result.stats.drafted_tokens
            samples = generator.generate_samples(prompt, dataclasses.replace(
                params, temperature=1.0, seed=7), n=3)
            for sample in [expected, *samples]:
                if sample.finish_reason == "stop":
                    assert self.valid(kind, text_of(target, sample.token_ids)), sample.text
            drafted += sum(sample.stats.drafted_tokens for sample in samples)
        assert drafted > 0

    @pytest.mark.parametrize("spec", ["head:{head}", "suffix+head:{head}"])
    def test_a_head_under_a_schema_decodes_in_a_batch(self, json_target, head_file, spec):
        """Rows of one batch, each its own head cache, under the schema: equal to plain
        decoding each alone (batched decoding packs chains: trees are refused there)."""
        from exactspec import BatchedGenerator
        from exactspec.proposers.build import build_proposer
        from exactspec.proposers.spec import parse_proposer

        proposer = build_proposer(parse_proposer(spec.format(head=head_file)), json_target,
                                  None)
        generator = SpeculativeGenerator(json_target, proposer, 4, "constant")
        params = SamplingParams(max_new_tokens=30, constraint=Constraint.json_schema(PERSON))
        prompts = ['{"name": "abc", "age": 5}', "abcd", "cab", "x"]
        plain = SpeculativeGenerator(json_target, None)
        results = BatchedGenerator(generator, max_batch_size=4).generate(prompts,
                                                                          [params] * 4)
        assert [r.token_ids for r in results] == [plain.generate(p, params).token_ids
                                                  for p in prompts]
        assert sum(r.stats.drafted_tokens for r in results) > 0
