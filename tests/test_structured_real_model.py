"""Structured output on the embedded SmolLM2-135M-Instruct (marked real_model): for JSON
schemas with nested objects, arrays, enums, bounded numbers, optional fields and
``additionalProperties: false``, greedy output is identical with and without speculation,
and every finished output, greedy or sampled, parses and validates."""

import importlib.util
import json
import re

import jsonschema
import pytest

from exactspec import SamplingParams, SpeculativeGenerator, load_model
from exactspec.constraints import Constraint
from exactspec.model_files import DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotFoundError
from exactspec.proposers import PromptLookupProposer, SuffixProposer

pytestmark = pytest.mark.real_model

try:
    EMBEDDED_MODELS[DEFAULT_MODEL].path()
except ModelNotFoundError as error:
    pytest.skip(str(error), allow_module_level=True)

SCHEMAS = {
    "person": ("Extract the person as JSON: Maria Lopez is 34 and lives in Seville, Spain.",
               {"type": "object", "additionalProperties": False, "required": ["name", "age"],
                "properties": {"name": {"type": "string"},
                               "age": {"type": "integer", "minimum": 0, "maximum": 150},
                               "city": {"type": "string"}}}),
    "order": ("Return the order as JSON: 2 apples at 0.5 each and 1 bread at 2.25, paid.",
              {"type": "object", "additionalProperties": False,
               "required": ["items", "status"],
               "properties": {
                   "items": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                       "type": "object", "additionalProperties": False,
                       "required": ["product", "quantity"],
                       "properties": {"product": {"type": "string"},
                                      "quantity": {"type": "integer", "minimum": 1},
                                      "unit_price": {"type": "number", "minimum": 0}}}},
                   "status": {"enum": ["paid", "pending", "cancelled"]}}}),
    "review": ("Classify this review as JSON: 'The battery died after two days. Awful.'",
               {"type": "object", "additionalProperties": False,
                "required": ["sentiment", "score", "topics"],
                "properties": {"sentiment": {"enum": ["positive", "negative", "neutral"]},
                               "score": {"type": "number", "minimum": -1, "maximum": 1},
                               "topics": {"type": "array", "items": {"type": "string"},
                                          "maxItems": 3},
                               "meta": {"type": "object", "properties": {
                                   "language": {"type": "string"}}}}}),
}
TOKENS = 96


@pytest.fixture(scope="module", params=["native", "transformers", pytest.param(
    "llama_cpp", marks=pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                          reason="llama-cpp-python is not installed"))])
def target(request):
    return load_model(backend=request.param, device="cpu")


@pytest.mark.parametrize("name", SCHEMAS)
def test_greedy_json_is_identical_with_speculation_and_validates(target, name):
    prompt, schema = SCHEMAS[name]
    params = SamplingParams(max_new_tokens=TOKENS, constraint=Constraint.json_schema(schema))
    plain = SpeculativeGenerator(target, None).generate(prompt, params, chat=True)
    for proposer in (PromptLookupProposer(), SuffixProposer()):
        fast = SpeculativeGenerator(target, proposer, 4, "constant").generate(
            prompt, params, chat=True)
        assert fast.token_ids == plain.token_ids, (name, type(proposer).__name__)
        assert fast.stats.accepted_tokens > 0  # at least the forced tokens
    assert plain.finish_reason == "stop", plain.text
    jsonschema.validate(json.loads(plain.text), schema)
    assert in_written_order(json.loads(plain.text), schema), plain.text


def in_written_order(value: dict, schema: dict) -> bool:
    """Whether an object's keys come in the order its schema writes its properties (the
    schemas here write them out of alphabetical order)."""
    written = list(schema["properties"])
    return list(value) == sorted(value, key=written.index)


def test_sampled_json_validates_and_a_cut_one_says_length(target):
    prompt, schema = SCHEMAS["order"]
    params = SamplingParams(temperature=0.7, seed=5, max_new_tokens=TOKENS,
                            constraint=Constraint.json_schema(schema))
    generator = SpeculativeGenerator(target, PromptLookupProposer(), 4, "constant")
    results = generator.generate_samples(prompt, params, n=4, chat=True)
    for result in results:
        if result.finish_reason == "stop":
            jsonschema.validate(json.loads(result.text), schema)
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == TOKENS
    assert any(r.finish_reason == "stop" for r in results)
    short = generator.generate(prompt, SamplingParams(
        max_new_tokens=5, constraint=Constraint.json_schema(schema)), chat=True)
    assert short.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(short.text)


def test_the_command_line_flags_constrain_the_output(tmp_path, capsys):
    """generate --json-schema / --regex / --choice / --grammar on the embedded model: each
    output matches, identical with and without speculation."""
    from exactspec import cli

    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(SCHEMAS["person"][1]))
    grammar = tmp_path / "answer.lark"
    grammar.write_text('start: ("yes" | "no") "."')
    prompt = "Extract the person as JSON: Maria Lopez is 34 and lives in Seville, Spain."
    checks = {"--json-schema": ([str(schema)], lambda text: jsonschema.validate(
                  json.loads(text), SCHEMAS["person"][1]) or in_written_order(
                  json.loads(text), SCHEMAS["person"][1])),
              "--regex": (["[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}"],
                          lambda text: re.fullmatch("[A-Z][a-z]{1,12} [A-Z][a-z]{1,12}", text)),
              "--choice": (["Seville", "Madrid"], lambda text: text in ("Seville", "Madrid")),
              "--grammar": ([str(grammar)], lambda text: text in ("yes.", "no."))}
    for flag, (values, check) in checks.items():
        args = [a for value in values for a in (flag, value)]
        outputs = []
        for speculation in ([], ["--no-speculation"]):
            assert cli.main(["generate", prompt, "--json", "--max-new-tokens", "64",
                             "--backend", "native", *args, *speculation]) == 0
            outputs.append(json.loads(capsys.readouterr().out))
        assert outputs[0]["token_ids"] == outputs[1]["token_ids"], flag
        assert outputs[0]["finish_reason"] == "stop" and check(outputs[0]["text"]), \
            (flag, outputs[0]["text"])
