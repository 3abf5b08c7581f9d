"""The one proposer spec grammar (exactspec.proposers.spec) and the peers built from it
(exactspec.peers), without the command line."""

import pytest

from exactspec import PromptLookupProposer, SamplingParams, SuffixProposer
from exactspec.bench.methods import parse_method, parse_method_spec
from exactspec.peers import PEERS, TransformersPeer, make_peer
from exactspec.proposers import EarlyExitProposer, FallbackProposer
from exactspec.proposers.build import build_proposer
from exactspec.proposers.spec import ProposerSpec, parse_ngram, parse_proposer

from conftest import tiny_backend


@pytest.mark.parametrize("spec, expected", [
    ("plain", ProposerSpec("plain", "plain")),
    ("prompt-lookup", ProposerSpec("prompt-lookup", "prompt-lookup", (2, 3))),
    ("prompt-lookup:ngram=1-4", ProposerSpec("prompt-lookup:ngram=1-4", "prompt-lookup", (1, 4))),
    ("suffix", ProposerSpec("suffix", "suffix", (1, 8))),
    ("suffix:corpus=5000", ProposerSpec("suffix:corpus=5000", "suffix", (1, 8), corpus=5000)),
    ("suffix:ngram=2-6", ProposerSpec("suffix:ngram=2-6", "suffix", (2, 6))),
    ("early-exit:3", ProposerSpec("early-exit:3", "early-exit", layers=3)),
    ("draft:some/model", ProposerSpec("draft:some/model", "draft", model="some/model")),
    ("draft:C:/models/x.gguf", ProposerSpec("draft:C:/models/x.gguf", "draft",
                                           model="C:/models/x.gguf")),
    ("draft:m.gguf:vocab=4096", ProposerSpec("draft:m.gguf:vocab=4096", "draft",
                                             model="m.gguf", vocab=4096)),
    ("draft:m.gguf:vocab=all", ProposerSpec("draft:m.gguf:vocab=all", "draft", model="m.gguf",
                                            vocab="all")),
    ("draft:m.gguf:weights=q4_0", ProposerSpec("draft:m.gguf:weights=q4_0", "draft",
                                               model="m.gguf", weights="q4_0")),
    ("head:h.safetensors:tree=6:weights=q4_0", ProposerSpec(
        "head:h.safetensors:tree=6:weights=q4_0", "head", head="h.safetensors", tree=6,
        weights="q4_0")),
])
def test_proposer_specs_parse_without_a_model(spec, expected):
    assert parse_proposer(spec) == expected


@pytest.mark.parametrize("spec, name", [("none", "plain"), ("assistant:M", "draft"),
                                        ("hf-assistant:M", "draft")])
def test_former_kind_names_are_refused_naming_the_one_name(spec, name):
    """One name per kind (glossary): the former synonyms fail, saying what to write."""
    with pytest.raises(ValueError, match=f"is called '{name}' now"):
        parse_method_spec(spec)


@pytest.mark.parametrize("spec, reason", [
    ("magic", "use one of plain, forced, prompt-lookup[:ngram=MIN-MAX], "
              "suffix[:ngram=MIN-MAX][:corpus=TOKENS], early-exit:L, "
              "draft:MODEL[:vocab=N][:weights=W]"),
    ("prompt-lookup:corpus=100", "use one of"),  # the corpus is suffix drafting's
    ("suffix:corpus=0", "corpus = 0 must be ≥ 1"),
    ("suffix:corpus=many", "corpus = 'many' is not an integer"),
    ("draft", "use one of"),
    ("draft:", "use one of"),
    ("plain:x", "use one of"),
    ("early-exit:2:ngram=1-2", "use one of"),  # ngram belongs to prompt lookup and suffix
    ("prompt-lookup:k=4", "use one of"),  # k is -k's, not the spec's, here
    ("hf-plain", "use one of"),  # no peers here
    ("early-exit:x", "L = 'x' is not an integer"),
    ("forced:x", "use one of"),  # forced takes nothing
    ("early-exit:0", "L = 0 must be ≥ 1"),
    ("prompt-lookup:ngram=3-1", "ngram '3-1' is invalid: need 1 ≤ MIN ≤ MAX"),
    ("prompt-lookup:ngram=x", "ngram 'x' is invalid: give MIN-MAX n-gram sizes, e.g. 1-3"),
    ("head:weights=q2", "weights = 'q2' must be one of q8_0, q4_0, bf16"),
    ("suffix:weights=q4_0", "use one of"),  # weights belong to a head or a draft model
    ("draft:m:weights=q2_k", "weights = 'q2_k' must be one of file, q4_0, q8_0, f16, bf16, f32"),
    ("draft:m:vocab=1", "vocab = '1' must be a number of tokens ≥ 2 or 'all'"),
    ("draft:m:vocab=some", "vocab = 'some' must be a number of tokens ≥ 2 or 'all'"),
    ("head:vocab=100", "use one of"),  # a draft vocabulary is a draft model's
])
def test_bad_proposer_specs_are_named_with_the_allowed_forms(spec, reason):
    with pytest.raises(ValueError) as error:
        parse_proposer(spec)
    assert str(error.value).startswith(f"proposer {spec!r} is invalid: {reason}")


def test_a_matcher_and_a_model_combine_with_the_options_written_once_for_the_whole():
    spec = parse_method_spec("suffix:ngram=2-6+head:h.safetensors:tree=6:k=3:policy=auto")
    assert spec == ProposerSpec(
        "suffix:ngram=2-6+head:h.safetensors:tree=6:k=3:policy=auto", "suffix", (2, 6), k=3,
        policy="auto", fallback=ProposerSpec("head:h.safetensors:tree=6:k=3:policy=auto",
                                             "head", head="h.safetensors", tree=6))
    assert [part.kind for part in spec.parts] == ["suffix", "head"]
    assert spec.description == "suffix 2:6, else draft head h.safetensors, trees of 6 nodes"
    assert parse_proposer("prompt-lookup+draft:M").fallback.model == "M"
    assert parse_method_spec("suffix+head").k == parse_method_spec("head").k
    # a path may hold a "+": a combination only where a kind follows it
    assert parse_proposer("draft:/models/a+b").model == "/models/a+b"
    assert parse_proposer("head:/heads/h+1.safetensors").head == "/heads/h+1.safetensors"
    assert parse_proposer("suffix+draft:/models/a+b").fallback.model == "/models/a+b"


@pytest.mark.parametrize("spec, reason", [
    ("head+suffix", "in MATCHER+MODEL the matcher is one of prompt-lookup, suffix and the "
                    "model one of early-exit, draft, head, not head+suffix"),
    ("suffix+plain", "in MATCHER+MODEL"),
    ("suffix+prompt-lookup", "in MATCHER+MODEL"),
    ("suffix+head+draft:M", "combine two proposers, MATCHER+MODEL (e.g. suffix+head)"),
    ("suffix+", "combine two proposers"),
    ("suffix:k=3+head", "write k once, at the end, for the whole (e.g. suffix+head:k=4)"),
    ("suffix+head:tree=0", "its part 'head:tree=0' is invalid: tree = 0 must be ≥ 1"),
    ("hf-suffix+head", "a peer (hf-, llama-) runs one proposer; MATCHER+MODEL is exactspec's"),
    ("suffix++head", "use one of"),
    ("+head", "combine two proposers"),
])
def test_bad_combinations_are_refused_naming_the_form(spec, reason):
    with pytest.raises(ValueError) as error:
        parse_method_spec(spec)
    assert str(error.value).startswith(f"method {spec!r} is invalid: ") and reason in str(
        error.value), str(error.value)


def test_a_heads_weights_option_names_what_its_kernels_take():
    from exactspec.draft_head.kernels import WEIGHTS
    from exactspec.proposers.spec import HEAD_WEIGHTS

    assert HEAD_WEIGHTS == WEIGHTS


def test_ngram_range_has_one_spelling_and_accepts_the_old_one():
    assert parse_ngram("1-3") == parse_ngram("1:3") == (1, 3)
    for bad in ("3-1", "0-2", "x", "1-2-3"):
        with pytest.raises(ValueError, match=f"{bad!r} is invalid"):
            parse_ngram(bad)


def test_bench_methods_are_proposer_specs_with_options_and_peers():
    assert parse_method_spec("prompt-lookup:k=6:ngram=1-2:policy=auto") == ProposerSpec(
        "prompt-lookup:k=6:ngram=1-2:policy=auto", "prompt-lookup", (1, 2), k=6, policy="auto")
    assert parse_method_spec("plain") == ProposerSpec("plain", "plain", k=4, policy="constant")
    assert parse_method_spec("hf-prompt-lookup").k == parse_method_spec("llama-prompt-lookup").k == 10
    assert parse_method_spec("hf-draft:M:k=3") == ProposerSpec(
        "hf-draft:M:k=3", "draft", model="M", k=3, policy="constant", peer="hf")
    with pytest.raises(ValueError, match="the llama- peer runs only plain, prompt-lookup"):
        parse_method_spec("llama-early-exit:2")
    with pytest.raises(ValueError, match="each optionally with :k=N, :policy=P and a peer "
                                         "prefix hf- or llama-"):
        parse_method_spec("hf-magic")


def test_methods_keep_their_kinds():
    target = tiny_backend(0)
    load = lambda name: tiny_backend(model=target.model)
    kinds = {spec: parse_method(spec, target, load).kind for spec in
             ("plain", "prompt-lookup:k=2", "suffix:corpus=9", "draft:x", "early-exit:1", "hf-plain",
              "hf-prompt-lookup:k=4", "hf-draft:x", "hf-early-exit:1")}
    assert kinds == {"plain": "plain", "prompt-lookup:k=2": "prompt-lookup",
                     "suffix:corpus=9": "suffix", "draft:x": "draft",
                     "early-exit:1": "early-exit", "hf-plain": "hf-plain",
                     "hf-prompt-lookup:k=4": "hf-prompt-lookup", "hf-draft:x": "hf-draft",
                     "hf-early-exit:1": "hf-early-exit"}


def test_build_proposer():
    target = tiny_backend(0)
    assert build_proposer(parse_proposer("plain"), target, None) is None
    lookup = build_proposer(parse_proposer("prompt-lookup:ngram=1-4"), target, None)
    assert isinstance(lookup, PromptLookupProposer)
    suffix = build_proposer(parse_proposer("suffix:ngram=2-6"), target, None)
    assert isinstance(suffix, SuffixProposer) and (suffix.min_ngram, suffix.max_ngram) == (2, 6)
    assert isinstance(build_proposer(parse_proposer("early-exit:1"), target, None),
                      EarlyExitProposer)
    with pytest.raises(ValueError, match="is run by a peer"):
        build_proposer(parse_method_spec("hf-plain"), target, None)
    both = build_proposer(parse_proposer("prompt-lookup:ngram=1-4+early-exit:1"), target, None)
    assert isinstance(both, FallbackProposer) and isinstance(both.model, EarlyExitProposer)
    assert isinstance(both.matcher, PromptLookupProposer) and both.matcher.max_ngram == 4


def test_transformers_peer_modes_and_sampling_translation(monkeypatch):
    target = tiny_backend(0)
    draft = tiny_backend(model=target.model)
    kwargs = lambda spec, k=4: make_peer(parse_method_spec(spec), target, lambda n: draft,
                                         k).generate_kwargs
    assert kwargs("hf-plain") == {}
    assert kwargs("hf-prompt-lookup") == {"prompt_lookup_num_tokens": 4}
    assert kwargs("hf-early-exit:1", 3) == {"assistant_early_exit": 1, "num_assistant_tokens": 3}
    assert kwargs("hf-draft:x", 5) == {"assistant_model": draft.model,
                                           "num_assistant_tokens": 5}
    assert draft.model.generation_config.num_assistant_tokens == 5
    seen = {}
    monkeypatch.setattr(target.model, "generate",
                        lambda input_ids, **options: seen.update(options) or input_ids)
    peer = TransformersPeer(target)
    peer.sample([1, 2], SamplingParams(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1, seed=1), 1)
    assert {key: seen[key] for key in ("do_sample", "temperature", "top_k", "top_p", "min_p")} == \
        {"do_sample": True, "temperature": 0.7, "top_k": 5, "top_p": 0.9, "min_p": 0.1}
    with pytest.raises(ValueError, match="does not translate repetition_penalty"):
        peer.sample([1, 2], SamplingParams(temperature=0.7, repetition_penalty=1.2), 1)


def test_peers_need_their_backend_and_proposer():
    target = tiny_backend(0)
    assert set(PEERS) == {"hf", "llama"}
    with pytest.raises(ValueError, match="needs a GGUF target"):
        make_peer(parse_method_spec("llama-plain"), target, None, 0)
    with pytest.raises(ValueError, match=r"llama-cpp-python generate\(\) \(llama-server with a "
                                         "draft model\) runs only plain, prompt-lookup or "
                                         "draft, not 'early-exit:1'"):
        make_peer(ProposerSpec("early-exit:1", "early-exit", layers=1, peer="llama"), target,
                  None, 4)
