"""The embedded SmolLM2-135M-Instruct, end to end on each backend (marked real_model;
skipped when the model package, or llama-cpp-python for the llama_cpp backend, is not
installed). Greedy speculative output must equal plain decoding on the same backend."""

import importlib.util
import json

import pytest
import torch

from conftest import one
from exactspec import PromptLookupProposer, SamplingParams, SpeculativeGenerator, cli
from exactspec.model_files import DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotFoundError

pytestmark = pytest.mark.real_model

try:
    EMBEDDED_MODELS[DEFAULT_MODEL].path()
except ModelNotFoundError as error:
    pytest.skip(str(error), allow_module_level=True)

PROMPTS = [
    "Summarize in one sentence: The city council met on Tuesday to discuss the new bike lanes. "
    "The council voted to build bike lanes on Main Street and Oak Avenue next spring.",
    "Translate to French: The weather is nice today and I would like to go for a walk.",
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of Japan? Answer briefly.",
    "If a train travels 60 km in 1.5 hours, what is its average speed? Think step by step.",
]


BACKENDS = [pytest.param("transformers"), pytest.param("native"),
            pytest.param("llama_cpp", marks=pytest.mark.skipif(
                importlib.util.find_spec("llama_cpp") is None,
                reason="llama-cpp-python is not installed (pip install 'exactspec[llama-cpp]')"))]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def cli_json(capsys, backend, *args):
    assert cli.main(["generate", *args, "--json", "--max-new-tokens", "48", "--device", "cpu",
                     "--backend", backend]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_cli_speculative_equals_plain(prompt, backend, capsys):
    spec = cli_json(capsys, backend, prompt)
    plain = cli_json(capsys, backend, prompt, "--no-speculation")
    assert spec["token_ids"] == plain["token_ids"]
    assert spec["finish_reason"] == plain["finish_reason"]
    stats = spec["stats"]
    assert stats["cycles"] <= plain["stats"]["cycles"]
    assert 1 <= stats["mean_acceptance_length"] <= 9
    assert stats["acceptance_rate"] is None or 0 <= stats["acceptance_rate"] <= 1


@pytest.fixture(scope="module", params=BACKENDS)
def target(request):
    from exactspec import load_model

    return load_model(backend=request.param, device="cpu")


@pytest.mark.parametrize("num_tokens", [2, 5, 9])
def test_block_logits_are_bit_identical_to_one_token_forwards(target, num_tokens):
    """On the real model, after a real prompt, as verification scores them."""
    prompt = target.tokenizer.encode(PROMPTS[0])
    assert target.batch_invariant
    one(target).prefill(prompt[:-num_tokens])
    block = one(target).forward(prompt[-num_tokens:])
    one(target).prefill(prompt[:-num_tokens])
    singles = [one(target).forward([token])[0] for token in prompt[-num_tokens:]]
    one(target).release()  # the module's target is shared (a llama.cpp slot)
    assert all(torch.equal(row, single) for row, single in zip(block, singles))


def test_sampling_is_seeded_on_a_reused_generator_after_greedy_calls(target):
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=3, max_new_tokens=24)
    generator = SpeculativeGenerator(target, PromptLookupProposer(), 4)  # policy auto
    first = generator.generate(PROMPTS[0], params, chat=True)
    generator.generate(PROMPTS[1], SamplingParams(max_new_tokens=24), chat=True)
    second = generator.generate(PROMPTS[0], params, chat=True)
    assert first.token_ids == second.token_ids


def test_counting_prompt_rollback(target):
    prompt = "Continue the list: " + ", ".join(str(i) for i in range(1, 41)) + ","
    params = SamplingParams(max_new_tokens=40)
    expected = SpeculativeGenerator(target, None).generate(prompt, params)
    result = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 8).generate(prompt, params)
    assert result.token_ids == expected.token_ids
    assert result.stats.drafted_tokens > result.stats.accepted_tokens  # rejections happened


def test_cli_sampling_features_and_logprobs_equal_plain(backend, capsys):
    """The issue's acceptance command: same tokens and logprobs with and without speculation."""
    args = [PROMPTS[0], "--logprobs", "3", "--frequency-penalty", "0.5", "--min-new-tokens", "20"]
    spec = cli_json(capsys, backend, *args, "--policy", "constant")  # auto's k comes from timings
    plain = cli_json(capsys, backend, *args, "--no-speculation")
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) >= 20
    assert len(spec["logprobs"]) == len(spec["token_ids"]) == spec["usage"]["completion_tokens"]
    # Batch-invariant kernels: a token scored in a block has plain decoding's logits exactly.
    assert spec["logprobs"] == plain["logprobs"]
    assert spec["stats"]["accepted_tokens"] > 0


def test_serve_command_answers_like_the_library(backend, capsys):
    """``exactspec serve`` as a user starts it (a subprocess on a free loopback port, the
    embedded model): chat and completions, streamed and not, equal the library's greedy
    output through ``generate --json``."""
    import socket
    import subprocess
    import sys
    import time

    import httpx
    import openai

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys; from exactspec.cli import main; sys.exit(main())",
         "serve", "--port", str(port), "--backend", backend, "--device", "cpu",
         "--log-level", "warning"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, server.stdout.read()
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.5)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        prompt = PROMPTS[1]
        expected = cli_json(capsys, backend, prompt, "--chat")
        chat = client.chat.completions.create(
            model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=48,
            temperature=0)
        assert chat.choices[0].message.content == expected["text"]
        streamed = "".join(chunk.choices[0].delta.content or "" for chunk in
                           client.chat.completions.create(
                               model=DEFAULT_MODEL, messages=[{"role": "user", "content": prompt}],
                               max_tokens=48, temperature=0, stream=True) if chunk.choices)
        assert streamed == expected["text"]
        expected = cli_json(capsys, backend, prompt, "--no-chat")
        completion = client.completions.create(model=DEFAULT_MODEL, prompt=prompt, max_tokens=48,
                                               temperature=0)
        assert completion.choices[0].text == expected["text"]
        assert completion.usage.completion_tokens == len(expected["token_ids"])
    finally:
        server.terminate()
        server.wait(timeout=30)
