"""One set-up from a spec (exactspec.speculation): its checks before loading, the generators
it makes, and a local audit run from the library through it."""

import pickle

import pytest

from exactspec import ModelSpec, SamplingParams, SpeculationSettings, SpeculationSpec
from exactspec.model_files import ModelNotFoundError
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.proposers.spec import parse_proposer
from exactspec.proposers.suffix import SuffixProposer
from exactspec.speculation import InvalidValueError


@pytest.fixture
def no_loading(monkeypatch):
    """Makes loading any model a test failure: check() must not load one."""
    def load_model(*args, **kwargs):
        raise AssertionError("check() loaded a model")
    monkeypatch.setattr("exactspec.models.load_model", load_model)


@pytest.mark.parametrize("proposer, options, error, message", [
    ("suffix", {"num_speculative_tokens": -1}, InvalidValueError,
     "num_speculative_tokens -1 is invalid: it must be ≥ 0"),
    ("suffix", {"policy": "fastest"}, InvalidValueError, "policy 'fastest' is invalid"),
    ("draft:/no/such/draft.gguf", {}, ModelNotFoundError, "proposer draft:/no/such/draft.gguf: "),
    ("early-exit:2", {}, InvalidValueError,
     "proposer early-exit:2: L = 2 is invalid: it must be in [1, 1] (the target has 2 layers)"),
    ("head:/no/such/head.pt", {}, ValueError,
     "proposer head:/no/such/head.pt: draft head '/no/such/head.pt' does not exist"),
    ("early-exit:1", {"backend": "llama_cpp"}, ValueError,
     "drafts with the target's own layers, which needs the transformers backend"),
])
def test_check_refuses_before_any_model_loads(model_folder, no_loading, proposer, options,
                                              error, message):
    backend = options.pop("backend", "auto")
    spec = SpeculationSpec(ModelSpec(str(model_folder), backend=backend), proposer, **options)
    with pytest.raises(error) as raised:
        spec.check()
    assert message in str(raised.value)


def test_check_names_the_target_by_the_callers_flag(no_loading):
    with pytest.raises(ModelNotFoundError, match="^--model: model 'no-such-model' is neither"):
        SpeculationSpec(ModelSpec("no-such-model"), "plain").check(model_flag="--model")


def test_a_good_spec_passes_its_check_and_is_picklable(model_folder, no_loading):
    spec = SpeculationSpec(ModelSpec(str(model_folder)), "suffix+early-exit:1")
    assert spec.check() == "transformers"  # the model folder's backend, nothing loaded
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.proposer == parse_proposer("suffix+early-exit:1")  # text is parsed


def test_the_loaded_set_up_makes_each_tools_generators(model_folder, greedy):
    spec = SpeculationSpec(ModelSpec(str(model_folder), backend="transformers"), "suffix",
                           num_speculative_tokens=3, policy="constant")
    speculation = spec.load()
    generator = speculation.generator()
    assert isinstance(generator.proposer, SuffixProposer)
    assert (generator.num_speculative_tokens, generator.policy.name) == (3, "constant")
    plain = speculation.generator(SpeculationSettings(0, "constant"))
    assert plain.proposer is None and plain.num_speculative_tokens == 0
    prompt = "abcabcabcab"
    expected = plain.generate(prompt, greedy).token_ids
    result = generator.generate(prompt, greedy)
    assert result.token_ids == expected  # greedy: token for token plain decoding
    assert result.stats.drafted_tokens > 0  # and it drafted, so verification ran
    batched = speculation.batched_generator(2)
    assert batched.max_batch_size == 2
    assert [r.token_ids for r in batched.generate([prompt, "bcabca"], greedy)] == [
        expected, plain.generate("bcabca", greedy).token_ids]
    other = speculation.with_proposer(parse_proposer("prompt-lookup"))
    assert other.target is speculation.target  # one target, another proposer
    assert isinstance(other.generator().proposer, PromptLookupProposer)
    assert speculation.prompt_ids(prompt, chat=False) == speculation.target.tokenizer.encode(
        prompt)


def test_k_zero_or_plain_is_plain_decoding(model_folder):
    for proposer, k in (("plain", 4), ("suffix", 0)):
        spec = SpeculationSpec(ModelSpec(str(model_folder), backend="transformers"), proposer,
                               num_speculative_tokens=k)
        generator = spec.load().generator()
        assert generator.num_speculative_tokens == 0


def test_a_local_audit_runs_from_the_library(model_folder):
    from exactspec.audit import AuditSpec, run

    setup = SpeculationSpec(ModelSpec(str(model_folder), backend="transformers"),
                            "prompt-lookup:ngram=1-2", num_speculative_tokens=3,
                            policy="constant")
    result = run(AuditSpec(["abcabcabc", "bcabcab"], SamplingParams(temperature=1.0, seed=3,
                                                                    max_new_tokens=3),
                           samples=60, greedy_tokens=8, setup=setup, broken="accept-all"))
    assert result.config["engine"] == "exactspec prompt-lookup:ngram=1-2 k=3 constant"
    assert [check.identical for check in result.greedy] == [True, True]
    drafted = result.distribution.drafted_per_position
    assert drafted is not None and len(drafted) >= 2 and min(drafted[:2]) > 0
    assert result.distribution.num_samples == 2 * 60
    assert result.control is not None and result.control.engine.startswith(
        "broken control: accept-all")
