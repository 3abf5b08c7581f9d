"""``exactspec serve``: a real server (uvicorn on loopback, in a thread) over a tiny model,
driven by the official ``openai`` client, its output compared with the library's for the
same parameters; every error the issue lists; metrics against the responses' figures; and a
client that disconnects cancels its generation."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from conftest import tiny_backend
from exactspec.cli import main
from exactspec import (DraftModelProposer, GenerationResult, PromptLookupProposer, SamplingParams,
                       SpeculativeGenerator)
from exactspec.proposers.base import Proposer
from exactspec.server import SpeculationSettings, create_app
from exactspec.server.streaming import KEEPALIVE_SECONDS

MODEL = "tiny"
KEY = "secret-key"
PROMPT = "abcabcabcab"


@contextlib.contextmanager
def serving(app):
    """Run ``app`` on uvicorn on 127.0.0.1 (a free port) in a thread; yields the base URL."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def make_target():
    return tiny_backend(0, max_context=256)


@pytest.fixture(scope="module")
def server():
    """A server on the tiny model with prompt lookup, k = 4, the constant policy, an API key."""
    app = create_app(make_target(), PromptLookupProposer(1, 3), model_name=MODEL,
                     speculation=SpeculationSettings(4, "constant"), api_key=KEY,
                     max_request_bytes=50_000)
    with serving(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def library() -> SpeculativeGenerator:
    """The same model and settings in the library, on its own copy of the weights."""
    return SpeculativeGenerator(make_target(), PromptLookupProposer(1, 3), 4, "constant")


def metrics_text(url: str) -> str:
    """``/metrics`` of the keyed test server (it needs the key, as ``/v1``)."""
    return httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}).text


def metric(url: str, name: str, labels: str = "") -> float:
    text = metrics_text(url)
    match = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


# --- output equal to the library's ------------------------------------------------------

def test_completion_greedy_equals_library(client, library):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                         temperature=0)
    expected = library.generate(PROMPT, SamplingParams(max_new_tokens=40))
    choice = response.choices[0]
    assert choice.text == expected.text
    assert choice.finish_reason == "length"
    assert response.usage.prompt_tokens == len(PROMPT)
    assert response.usage.completion_tokens == 40 == len(expected.token_ids)
    assert response.usage.total_tokens == len(PROMPT) + 40
    figures = response.model_extra["speculation"]
    assert figures["drafted_tokens"] == expected.stats.drafted_tokens > 0
    assert figures["accepted_tokens"] == expected.stats.accepted_tokens
    assert figures["accepted_per_position"] == expected.stats.accepted_per_position
    assert figures["cycles"] == expected.stats.cycles < 40  # drafts were accepted


def test_chat_greedy_equals_library(client, library):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "abab"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                              temperature=0)
    prompt = library.target.tokenizer.apply_chat_template(messages)
    expected = library.generate(prompt, SamplingParams(max_new_tokens=30))
    assert response.choices[0].message.content == expected.text
    assert response.choices[0].message.role == "assistant"
    assert response.usage.prompt_tokens == len(prompt)


def test_token_id_prompts_and_prompt_lists(client, library):
    ids = library.target.tokenizer.encode("hello")
    expected = [library.generate(prompt, SamplingParams(max_new_tokens=8)).text
                for prompt in (PROMPT, ids)]
    for prompts in ([PROMPT, "hello"], [library.target.tokenizer.encode(PROMPT), ids]):
        response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, n=2,
                                             temperature=0)
        assert [c.index for c in response.choices] == [0, 1, 2, 3]
        assert [c.text for c in response.choices] == [expected[0]] * 2 + [expected[1]] * 2
        assert response.usage.prompt_tokens == len(PROMPT) + len(ids)
    single = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert single.choices[0].text == expected[1]


def test_seeded_samples_equal_library_and_reproduce(client, library):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0.9, n=3, seed=7)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    expected = library.generate_samples(PROMPT, SamplingParams(temperature=0.9, seed=7,
                                                               max_new_tokens=20), n=3)
    texts = [c.text for c in first.choices]
    assert texts == [c.text for c in second.choices] == [r.text for r in expected]
    assert len(set(texts)) > 1  # really sampled
    assert first.usage.completion_tokens == 60
    assert first.usage.prompt_tokens == len(PROMPT)  # the prompt is counted once


@pytest.mark.parametrize("start, length, extra", [(12, 2, []), (12, 2, ["never!"]),
                                                  (20, 1, []), (5, 3, []), (30, 4, ["q"])])
def test_stop_string_is_cut_like_openai_streamed_or_not(client, library, start, length, extra):
    full = library.generate(PROMPT, SamplingParams(max_new_tokens=40)).text
    stops = [full[start:start + length], *extra]
    cut = min(i for stop in stops if (i := full.find(stop)) >= 0)
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stops)
    response = client.completions.create(**kwargs)
    assert response.choices[0].finish_reason == "stop"
    assert response.choices[0].text == full[:cut]
    assert response.choices[0].model_extra["stop_reason"] in stops
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:cut]


def test_stop_token_id_finishes_with_stop(client, library):
    full = library.generate(PROMPT, SamplingParams(max_new_tokens=40))
    token = full.token_ids[9]
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                         temperature=0, extra_body={"stop_token_ids": [token]})
    cut = full.token_ids.index(token) + 1
    assert response.choices[0].finish_reason == "stop"
    assert response.usage.completion_tokens == cut
    assert response.choices[0].text == library.target.tokenizer.decode(full.token_ids[:cut])


def test_extra_sampling_parameters_reach_the_engine(client, library):
    extra = {"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.3, "min_tokens": 3,
             "ignore_eos": True, "bad_words": ["bc"], "banned_token_ids": [3]}
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                         temperature=0.7, seed=3, top_p=0.9,
                                         presence_penalty=0.5, frequency_penalty=0.2,
                                         logit_bias={"0": -100}, extra_body=extra)
    expected = library.generate(PROMPT, SamplingParams(
        temperature=0.7, seed=3, top_p=0.9, top_k=5, min_p=0.05, repetition_penalty=1.3,
        min_new_tokens=3, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.2,
        logit_bias={0: -100}, bad_words=("bc",), banned_token_ids=(3,), max_new_tokens=12))
    assert response.choices[0].text == expected.text
    assert "a" not in response.choices[0].text  # token 0 is "a", biased away
    assert "d" not in response.choices[0].text and "bc" not in response.choices[0].text


# --- streaming --------------------------------------------------------------------------

def test_streamed_completion_equals_non_streamed(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    whole = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(**kwargs, stream=True,
                                            stream_options={"include_usage": True}))
    assert len(chunks) > 3  # really streamed, a chunk per cycle
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == whole
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 40 and not chunks[-1].choices
    assert all(c.usage is None for c in chunks[:-1])


def test_stream_without_usage_has_choices_in_every_chunk(client):
    """OpenAI sends a chunk without choices only for include_usage: clients index
    choices[0] (the README's example does)."""
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12,
                                            temperature=0, stream=True))
    assert all(chunk.choices for chunk in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["speculation"]["cycles"] >= 1
    assert all("speculation" not in chunk.model_extra for chunk in chunks[:-1])


def test_streamed_chat_with_n_equals_non_streamed(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "abc"}], max_tokens=15,
                  temperature=1.0, n=2, seed=11)
    whole = client.chat.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    roles = set()
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        assert chunk.object == "chat.completion.chunk"
        assert chunk.usage is None  # not asked for
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            roles.add((choice.index, choice.delta.role))
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert {(0, "assistant"), (1, "assistant")} <= roles


def test_raw_stream_ends_with_done(server):
    with httpx.stream("POST", server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True,
                            "temperature": 0}) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert all(line.startswith(("data: ", ":")) for line in lines)


# --- logprobs ---------------------------------------------------------------------------

def test_completion_logprobs_shapes(client, library):
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                         temperature=0, logprobs=3)
    logprobs = response.choices[0].logprobs
    expected = library.generate(PROMPT, SamplingParams(max_new_tokens=10, logprobs=3))
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 10
    assert len(logprobs.top_logprobs) == len(logprobs.text_offset) == 10
    assert all(len(top) == 3 for top in logprobs.top_logprobs)
    assert logprobs.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs])
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset[1] == logprobs.text_offset[0] + len(logprobs.tokens[0])


def test_logprobs_of_tokens_that_split_a_character():
    """A character split over two tokens goes whole to the token completing it, so the
    tokens join to the text and text_offset counts characters of the text."""
    from exactspec.generator import TokenLogprob
    from exactspec.server.responses import chat_logprobs, completion_logprobs

    table = {0: b"\xc3", 1: b"\xa9", 2: b"x"}  # "é" in two tokens, then "x"
    decode = lambda ids: b"".join(table[t] for t in ids).decode("utf-8", "replace")
    logprobs = [TokenLogprob(t, -0.1 * (t + 1), [(t, -0.1), (2, -3.0)]) for t in (0, 1, 2)]
    completion = completion_logprobs(logprobs, decode)
    assert completion["tokens"] == ["", "é", "x"]
    assert completion["text_offset"] == [0, 0, 1]
    assert completion["token_logprobs"] == [-0.1, -0.2, pytest.approx(-0.3)]
    chat = chat_logprobs(logprobs, decode)["content"]
    assert [c["token"] for c in chat] == ["", "é", "x"]
    assert chat[1]["bytes"] == list("é".encode()) and len(chat[0]["top_logprobs"]) == 2


def test_chat_logprobs_shapes(client):
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "ab"}], max_tokens=6, temperature=0,
        logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    assert all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)
    assert "".join(entry.token for entry in content) == response.choices[0].message.content


# --- per-request speculation and its figures ---------------------------------------------

def test_speculation_can_be_turned_off_and_resized_per_request(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
    default = client.completions.create(**kwargs)
    plain = client.completions.create(**kwargs, extra_body={"speculation": {"enabled": False}})
    short = client.completions.create(
        **kwargs, extra_body={"speculation": {"num_speculative_tokens": 2, "policy": "auto"}})
    assert default.choices[0].text == plain.choices[0].text == short.choices[0].text
    assert plain.model_extra["speculation"]["drafted_tokens"] == 0
    assert plain.model_extra["speculation"]["cycles"] == 30
    assert short.model_extra["speculation"]["num_speculative_tokens"] == 2
    assert short.model_extra["speculation"]["policy"] == "auto"
    assert len(short.model_extra["speculation"]["drafted_per_position"]) == 2


def test_metrics_count_what_responses_report(server, client):
    names = ["exactspec:spec_decode_num_draft_tokens_total",
             "exactspec:spec_decode_num_accepted_tokens_total",
             "exactspec:spec_decode_num_drafts_total", "exactspec:generation_tokens_total",
             "exactspec:prompt_tokens_total"]
    per_position = [("exactspec:spec_decode_num_accepted_tokens_per_pos_total",
                     f'{{position="{i}"}}') for i in range(4)]
    before = [metric(server, name) for name in names] + [metric(server, *p) for p in per_position]
    success = metric(server, "exactspec:request_success_total", '{finished_reason="length"}')
    response = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                         temperature=0)
    after = [metric(server, name) for name in names] + [metric(server, *p) for p in per_position]
    figures = response.model_extra["speculation"]
    delta = [b - a for a, b in zip(before, after)]
    assert delta[:5] == [figures["drafted_tokens"], figures["accepted_tokens"],
                         figures["drafted_per_position"][0], 40, len(PROMPT)]
    assert delta[5:] == figures["accepted_per_position"]
    assert metric(server, "exactspec:request_success_total",
                  '{finished_reason="length"}') == success + 1
    text = metrics_text(server)
    for histogram in ("time_to_first_token_seconds", "time_per_output_token_seconds"):
        assert f"exactspec:{histogram}_count" in text


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server + "/health").status_code == 200


# --- errors -----------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, param", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logprobs": 21}, "logprobs"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"extra_body": {"min_tokens": 99}}, "min_tokens"),
    ({"extra_body": {"speculation": {"policy": "fastest"}}}, "speculation.policy"),
    ({"extra_body": {"speculation": {"policy": "confidence"}}}, "speculation.policy"),
    ({"extra_body": {"speculation": {"num_speculative_tokens": 99}}},
     "speculation.num_speculative_tokens"),
    ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
    ({"echo": True}, "echo"),
    ({"stream": True, "logprobs": 2}, "logprobs"),
])
def test_bad_parameters_are_400_naming_the_field(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as raised:
        client.completions.create(**({"model": MODEL, "prompt": PROMPT, "max_tokens": 4}
                                     | kwargs))
    assert raised.value.status_code == 400
    assert raised.value.body["param"] == param
    assert raised.value.body["type"] == "invalid_request_error"


def test_token_ids_outside_the_vocabulary_are_400(client):
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 2, 999], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="vocabulary") as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4,
                                  extra_body={"stop_token_ids": [999]})
    assert raised.value.body["param"] == "stop_token_ids"


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPT)


def test_prompt_longer_than_the_context_is_400(client):
    with pytest.raises(openai.BadRequestError, match="context holds 256") as raised:
        client.completions.create(model=MODEL, prompt="ab" * 200, max_tokens=4)
    assert raised.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError, match="context holds 256") as raised:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user",
                                                               "content": "ab" * 200}])
    assert raised.value.body["param"] == "messages"  # the engine's "prompt", as chat names it
    with pytest.raises(openai.BadRequestError, match="empty") as raised:
        client.completions.create(model=MODEL, prompt="", max_tokens=4)
    assert raised.value.body["param"] == "prompt"


def test_max_tokens_beyond_the_context_is_400_naming_what_fits(client):
    prompt_tokens = len(PROMPT)  # one token per character
    with pytest.raises(openai.BadRequestError, match=f"max_tokens = 300 is too large: the "
                       f"context holds 256 tokens .* at most {256 - prompt_tokens}") as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=300)
    assert raised.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens = 300 is too large"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "ab"}],
                                       max_completion_tokens=300)
    fits = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                     max_tokens=256 - prompt_tokens)
    assert fits.usage.total_tokens == 256 and fits.choices[0].finish_reason == "length"


def test_stop_reason_is_vllms_the_stop_string_or_stop_token_id_never_eos():
    from exactspec.generation_stats import GenerationStats
    from exactspec.server.responses import stop_reason

    def result(reason):
        return GenerationResult("", [1, 2], "stop", reason, [0], GenerationStats())

    assert stop_reason(result(2), SamplingParams()) is None  # EOS
    assert stop_reason(result(2), SamplingParams(stop_token_ids=(2,))) == 2
    assert stop_reason(result("bc"), SamplingParams(stop=("bc",))) == "bc"
    assert stop_reason(result(None), SamplingParams()) is None


def test_api_key_is_required(server):
    wrong = openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.completions.create(model=MODEL, prompt=PROMPT)
    refused = httpx.get(server + "/v1/models")
    assert refused.status_code == 401 and refused.headers["www-authenticate"] == "Bearer"
    assert httpx.get(server + "/health").status_code == 200  # probes need no key
    assert httpx.get(server + "/metrics").status_code == 401  # others' traffic: keyed
    assert httpx.get(server + "/docs").status_code == 404  # no open docs behind a key


def test_authentication_comes_before_the_body_on_every_endpoint(server):
    """Without a valid key every protected endpoint answers 401, whatever the body: an
    invalid JSON one, an oversized one, a valid one."""
    for path in ("/v1/completions", "/v1/chat/completions"):
        for body in (b'{"model":', b"x" * 60_000, b'{"model": "tiny", "prompt": "a"}'):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
                response = httpx.post(server + path, content=body, headers=headers | {
                    "content-type": "application/json"})
                assert response.status_code == 401, (path, body[:10], headers, response.text)
    for path in ("/v1/models", "/v1/models/tiny", "/metrics"):
        assert httpx.get(server + path, headers={"Authorization": "Basic " + KEY}
                         ).status_code == 401


def test_a_json_schema_keeps_the_order_its_properties_are_written_in():
    from exactspec.server.protocol import StructuredOutputs, constraint_of

    schema = {"type": "object", "properties": {"reasoning": {"type": "string"},
                                               "answer": {"type": "string"}}}
    for constraint in (
            constraint_of({"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
                          None),
            constraint_of(None, StructuredOutputs.model_validate({"json": schema}))):
        assert list(json.loads(constraint.value)["properties"]) == ["reasoning", "answer"]


def test_body_over_the_limit_is_413(server):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "a" * 60_000}
    assert httpx.post(server + "/v1/completions", json=body, headers=headers).status_code == 413

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(60):
            yield b"a" * 1000
        yield b'"}'

    response = httpx.post(server + "/v1/completions", content=chunked(), headers=headers)
    assert response.status_code == 413
    assert response.json()["error"]["code"] == 413


def test_malformed_json_is_400(server):
    response = httpx.post(server + "/v1/completions", content=b'{"model":',
                          headers={"Authorization": f"Bearer {KEY}",
                                   "content-type": "application/json"})
    assert response.status_code == 400
    assert "not valid JSON" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] is None


def test_what_openai_clients_send_by_default_is_accepted(server, client, library):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "max_tokens": 6, "temperature": 0, "tools": [], "store": False,
            "parallel_tool_calls": True, "response_format": {"type": "text"},
            "tool_choice": "none", "metadata": {"app": "test"}, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "ab"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "c"}]}
    response = httpx.post(server + "/v1/chat/completions", json=body, headers=headers)
    assert response.status_code == 200, response.text
    # a completions request without max_tokens (or with null) gets OpenAI's default, 16
    for extra in ({}, {"max_tokens": None}):
        response = httpx.post(server + "/v1/completions", headers=headers,
                              json={"model": MODEL, "prompt": PROMPT, "temperature": 0} | extra)
        assert response.json()["usage"]["completion_tokens"] == 16
    # any int64 seed, as OpenAI: a negative one maps to seed + 2**63
    negative = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=-5,
                                         temperature=1.0)
    expected = library.generate(PROMPT, SamplingParams(temperature=1.0, seed=2**63 - 5,
                                                       max_new_tokens=8))
    assert negative.choices[0].text == expected.text
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("other")


@pytest.mark.parametrize("change, param, words", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "not supported"),
    ({"response_format": {"type": "xml"}}, "response_format", "text, json_object or json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "bogus"}}}},
     "response_format", "not supported"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs",
     "exactly one of"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "regex is not supported"),
    ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
     "response_format", "give one of them"),
    ({"response_format": {"type": "json_object", "extra_key": 1}}, "response_format",
     "unknown keys 'extra_key': it takes type"),
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "p", "schema": {"type": "object"}, "bogus": 2}}}, "response_format",
     "response_format.json_schema has unknown keys 'bogus': it takes name, description, "
     "schema, strict"),
    ({"response_format": {"type": "text", "json_schema": {}}}, "response_format",
     "unknown keys 'json_schema'"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.role", "not supported"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages.0.content", "only text parts"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "stream: true"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage", "xtra"),
    ({"logit_bias": {"999": 1}}, "logit_bias", "outside the vocabulary"),
    ({"stop_token_ids": [999]}, "stop_token_ids", "outside the vocabulary"),
    ({"banned_token_ids": [999]}, "banned_token_ids", "outside the vocabulary"),
    ({"bad_words": [""]}, "bad_words", "non-empty"),
    ({"min_tokens": 9}, "min_tokens", "max_tokens"),
])
def test_chat_requests_that_ask_for_what_is_not_served_are_400(server, change, param, words):
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]}
    response = httpx.post(server + "/v1/chat/completions", json=body | change,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "max_new_tokens" not in error["message"]


@pytest.mark.parametrize("endpoint, change, param, words", [
    ("completions", {"best_of": 0}, "best_of", "only 1"),
    ("completions", {"best_of": 2}, "best_of", "only 1"),
    ("completions", {"logit_bias": {"5": 100, "05": -100}}, "logit_bias", "'05' is not a token id"),
    ("completions", {"logit_bias": {" 5": 100}}, "logit_bias", "' 5' is not a token id"),
    ("completions", {"logit_bias": {"٥": 100}}, "logit_bias", "is not a token id"),
    ("completions", {"logit_bias": {"-1": 100}}, "logit_bias", "is not a token id"),
    ("completions", {"logit_bias": {"5": "100"}}, "logit_bias.5", "valid number"),
    ("completions", {"max_tokens": True}, "max_tokens", "valid integer"),
    ("completions", {"max_tokens": 4.0}, "max_tokens", "valid integer"),
    ("completions", {"temperature": "0"}, "temperature", "valid number"),
    ("completions", {"n": "2"}, "n", "valid integer"),
    ("completions", {"echo": 1}, "echo", "valid boolean"),
    ("completions", {"prompt": [1, True]}, "prompt", "valid"),
    ("completions", {"speculation": {"enabled": "no"}}, "speculation.enabled", "valid boolean"),
    ("chat", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant",
      "content": None, "tool_calls": [{"id": "1", "type": "function"}]}]},
     "messages.1.tool_calls", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "a", "name": "bob"}]},
     "messages.0.name", "not supported"),
    ("chat", {"messages": [{"role": "user", "content": "a", "weight": 2}]},
     "messages.0.weight", "xtra"),
    ("chat", {"store": True}, "store", "not supported"),
    ("chat", {"service_tier": "priority"}, "service_tier", "one tier"),
    ("chat", {"logprobs": 1}, "logprobs", "valid boolean"),
])
def test_lenient_values_that_would_change_meaning_are_400(server, endpoint, change, param,
                                                          words):
    """Issue 45: strict parsing on both endpoints (each of these was accepted and read as
    something else, or dropped)."""
    body = ({"model": MODEL, "max_tokens": 4, "prompt": PROMPT} if endpoint == "completions"
            else {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "a"}]})
    response = httpx.post(f"{server}/v1/{'chat/' if endpoint == 'chat' else ''}completions",
                          json=body | change, headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_what_sdks_echo_back_in_messages_is_accepted_empty(server):
    body = {"model": MODEL, "max_tokens": 2, "service_tier": "auto", "user": "u1",
            "messages": [{"role": "user", "content": "a"},
                         {"role": "assistant", "content": "b", "tool_calls": None,
                          "function_call": None, "refusal": None, "audio": None,
                          "annotations": []},
                         {"role": "user", "content": "c"}]}
    response = httpx.post(server + "/v1/chat/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    response = httpx.post(server + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                          json={"model": MODEL, "max_tokens": 2, "prompt": PROMPT,
                                "best_of": 1, "echo": False, "logit_bias": {"0": 1, "10": -1}})
    assert response.status_code == 200, response.text


# --- the queue: full → 503; a client that leaves cancels its generation -------------------

class GatedProposer(Proposer):
    """Prompt lookup that waits for ``gate`` before each proposal: holds the engine busy."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.inner = PromptLookupProposer(1, 3)
        self.delay = 0.0  # seconds per proposal once the gate is open

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        assert self.gate.wait(timeout=60)
        time.sleep(self.delay)
        return self.inner.propose(token_ids, k, pipeline, rng, min_confidence)


@pytest.fixture
def gated():
    proposer = GatedProposer()
    app = create_app(make_target(), proposer, model_name=MODEL,
                     speculation=SpeculationSettings(4, "constant"), max_queue=1)
    proposer.worker = app.state.worker  # for the tests that wait on its jobs
    with serving(app) as url:
        yield url, proposer
        proposer.gate.set()


def test_full_queue_answers_503_at_once(gated):
    url, proposer = gated
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    outcomes: dict[int, object] = {}

    def request(i: int) -> None:
        outcomes[i] = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5,
                                                temperature=0)

    running = threading.Thread(target=request, args=(0,))
    running.start()
    deadline = time.monotonic() + 10
    while metric(url, "exactspec:num_requests_running") < 1:  # the engine holds it
        assert time.monotonic() < deadline
        time.sleep(0.02)
    waiting = threading.Thread(target=request, args=(1,))
    waiting.start()
    while metric(url, "exactspec:num_requests_waiting") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    start = time.monotonic()
    with pytest.raises(openai.InternalServerError) as raised:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=5)
    assert raised.value.status_code == 503 and "busy" in str(raised.value)
    assert raised.value.response.headers["retry-after"] == "1"
    assert time.monotonic() - start < 5  # at once, not after the queue drained
    proposer.gate.set()
    running.join(30)
    waiting.join(30)
    assert [outcomes[i].usage.completion_tokens for i in (0, 1)] == [5, 5]


def test_disconnected_client_cancels_its_generation(gated):
    url, proposer = gated
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "stream": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.status_code == 200
        deadline = time.monotonic() + 10
        while metric(url, "exactspec:num_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    # the client is gone: the server notices at its next keep-alive (the job is cancelled);
    # then the engine, released, must stop generating for it
    deadline = time.monotonic() + 10 * KEEPALIVE_SECONDS
    while not any(job.cancelled.is_set() for job, _ in list(proposer.worker._rows.values())):
        assert time.monotonic() < deadline, "the server never noticed the client leave"
        time.sleep(0.05)
    proposer.gate.set()
    deadline = time.monotonic() + 20
    while metric(url, "exactspec:request_aborted_total") < 1:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert metric(url, "exactspec:generation_tokens_total") == 0  # it never finished
    # the server is idle again: the gauges say so before any other request comes
    deadline = time.monotonic() + 5
    while metric(url, "exactspec:num_requests_running") != 0:
        assert time.monotonic() < deadline, "num_requests_running stayed above 0"
        time.sleep(0.05)
    assert metric(url, "exactspec:num_requests_waiting") == 0
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3,
                                     temperature=0).usage.completion_tokens == 3


def test_disconnected_client_cancels_a_non_streamed_generation(gated):
    """Tokens keep coming while the client is gone: the server still checks, every
    KEEPALIVE_SECONDS, whether the client is there."""
    url, proposer = gated
    proposer.delay = 0.01
    proposer.gate.set()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 200, "n": 8, "temperature": 0,
            "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(url + "/v1/completions", json=body, timeout=0.5)
    deadline = time.monotonic() + 15
    while metric(url, "exactspec:request_aborted_total") < 1:
        assert time.monotonic() < deadline, "the generation was not cancelled"
        time.sleep(0.05)
    assert metric(url, "exactspec:generation_tokens_total") < 8 * 200


def test_suffix_corpus_learns_across_requests_and_is_reported():
    from exactspec import SuffixCorpus, SuffixProposer

    corpus = SuffixCorpus(1000)
    app = create_app(make_target(), SuffixProposer(corpus=corpus), model_name=MODEL,
                     speculation=SpeculationSettings(6, "constant"))
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        kwargs = dict(model=MODEL, prompt="hello world", max_tokens=40, temperature=0)
        first, second = (client.completions.create(**kwargs) for _ in range(2))
        assert first.choices[0].text == second.choices[0].text
        assert (second.model_extra["speculation"]["accepted_tokens"]
                > first.model_extra["speculation"]["accepted_tokens"])
        assert metric(url, "exactspec:suffix_corpus_tokens") == corpus.num_tokens == 80
        assert metric(url, "exactspec:suffix_corpus_max_tokens") == 1000
        assert metric(url, "exactspec:suffix_corpus_ngrams") == corpus.num_ngrams > 0


def test_one_scopes_traffic_leaves_anothers_acceptance_unchanged():
    """Issue 45: with a small corpus (300 tokens) a victim's repeated request accepts as
    many drafts after another key generated 720 tokens as before (a shared bound evicted
    the victim's outputs, and a prober's own acceptance measured others' volume)."""
    from exactspec import SuffixCorpus, SuffixProposer

    corpus = SuffixCorpus(300)
    app = create_app(make_target(), SuffixProposer(corpus=corpus), model_name=MODEL,
                     speculation=SpeculationSettings(6, "constant"),
                     api_key=["key-victim", "key-other"])
    with serving(app) as url:
        victim, other = ({"Authorization": f"Bearer key-{who}"} for who in ("victim", "other"))

        def accepted(headers, prompt):
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0}
            response = httpx.post(url + "/v1/completions", json=body, headers=headers,
                                  timeout=60)
            assert response.status_code == 200, response.text
            return response.json()["speculation"]["accepted_tokens"]

        accepted(victim, "hello world")
        before = accepted(victim, "hello world")
        assert before > 0
        for i in range(18):  # 720 tokens of another scope
            accepted(other, f"{chr(97 + i)} prompt number {i}")
        assert 0 < corpus.scope_tokens((1, None)) <= 300  # the other key: its own bound
        assert accepted(victim, "hello world") == before


SECRET_AT = range(12, 16)
"""Where the victim's output holds its "PIN": four tokens the attacker does not know, after
twelve it does (the text before a PIN is often predictable)."""


def corpus_attack(url: str, victim: list[int], headers: dict, salt: str | None) -> list[int]:
    """The attack of issue 28: for each secret position, each guess g forced with logit_bias
    and one token drafted from the context the attacker knows (the victim's output up to
    that position); ``speculation.accepted_tokens`` then says whether the proposer proposed
    g, i.e. whether a corpus in the attacker's scope continues that context with g.
    Returns the observation: accepted tokens per (position, guess)."""
    observed = []
    for position in SECRET_AT:
        truth = victim[position]
        for guess in sorted({truth, *range(10)}):  # ten "digits", the true one among them
            body = {"model": MODEL, "prompt": victim[:position], "max_tokens": 2,
                    "temperature": 0, "logit_bias": {str(guess): 100},
                    "speculation": {"num_speculative_tokens": 1, "policy": "constant"}}
            if salt is not None:
                body["cache_salt"] = salt
            response = httpx.post(url + "/v1/completions", json=body, headers=headers,
                                  timeout=30)
            assert response.status_code == 200, response.text
            observed.append(response.json()["speculation"]["accepted_tokens"])
    return observed


def recovered(observed: list[int], victim: list[int]) -> list[int | None]:
    """The guesses ``corpus_attack`` found drafted, per secret position (None: no guess
    accepted, or several)."""
    out, i = [], 0
    for position in SECRET_AT:
        guesses = sorted({victim[position], *range(10)})
        hits = [g for g, accepted in zip(guesses, observed[i:i + len(guesses)]) if accepted]
        out.append(hits[0] if len(hits) == 1 else None)
        i += len(guesses)
    return out


@pytest.mark.parametrize("separated_by", ["cache_salt", "api_key"])
def test_suffix_corpus_does_not_leak_one_scope_to_another(separated_by):
    """Issue 28's PIN attack. The victim's sampled output enters the corpus. An attacker
    observes the same before the victim's request as after it, from another scope (another
    cache_salt, or another of several API keys): the corpus told it nothing. The same
    attack in the victim's own scope recovers every secret token: the corpus does draft
    within a scope (and the attack is a real one)."""
    from exactspec import SuffixCorpus, SuffixProposer

    params = SamplingParams(temperature=1, seed=3, max_new_tokens=24, ignore_eos=True)
    expected = SpeculativeGenerator(make_target(), SuffixProposer(), 4, "constant").generate(
        "pin", params).token_ids  # a seeded request drafts from its own text only
    scopes = ["victim", "before", "after"]
    by_salt = separated_by == "cache_salt"
    app = create_app(make_target(), SuffixProposer(corpus=SuffixCorpus(10_000)),
                     model_name=MODEL, speculation=SpeculationSettings(4, "constant"),
                     api_key=None if by_salt else [f"key-{scope}" for scope in scopes])

    def attack(url: str, scope: str) -> list[int]:
        if by_salt:
            return corpus_attack(url, expected, {}, scope)
        return corpus_attack(url, expected, {"Authorization": f"Bearer key-{scope}"}, None)

    with serving(app) as url:
        before = attack(url, "before")
        body = {"model": MODEL, "prompt": "pin", "max_tokens": 24, "temperature": 1,
                "seed": 3, "ignore_eos": True}
        headers = {}
        if by_salt:
            body["cache_salt"] = "victim"
        else:
            headers["Authorization"] = "Bearer key-victim"
        response = httpx.post(url + "/v1/completions", json=body, headers=headers)
        assert response.status_code == 200, response.text
        assert make_target().tokenizer.encode(
            response.json()["choices"][0]["text"]) == expected
        after = attack(url, "after")
        own_scope = attack(url, "victim")
    secret = [expected[p] for p in SECRET_AT]
    assert after == before
    assert recovered(before, expected) != secret
    assert recovered(own_scope, expected) == secret  # the corpus drafts within a scope


def test_metrics_count_requests_not_choices(server, client):
    """One request of n = 2 choices: one success, one TTFT, one latency, one time per
    output token; the token counters add both choices."""
    names = ["exactspec:time_to_first_token_seconds_count",
             "exactspec:e2e_request_latency_seconds_count",
             "exactspec:time_per_output_token_seconds_count",
             "exactspec:generation_tokens_total"]
    success = ("exactspec:request_success_total", '{finished_reason="length"}')
    before = [metric(server, name) for name in names] + [metric(server, *success)]
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, n=2, temperature=0)
    after = [metric(server, name) for name in names] + [metric(server, *success)]
    assert [b - a for a, b in zip(before, after)] == [1, 1, 1, 14, 1]


# --- the command ------------------------------------------------------------------------

def test_serve_help_names_the_endpoints(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["serve", "--help"])
    assert raised.value.code == 0
    help_text = capsys.readouterr().out
    for text in ("/v1/chat/completions", "--api-key", "--max-queue", "127.0.0.1"):
        assert text in help_text


def test_serve_reports_a_port_in_use(model_folder, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code = main(["serve", "--model", str(model_folder), "--port",
                     str(busy.getsockname()[1]), "--log-level", "critical"])
    assert code == 1
    assert "could not start" in capsys.readouterr().err


def test_serve_refuses_a_bad_port(capsys):
    with pytest.raises(SystemExit) as raised:
        main(["serve", "--port", "70000"])
    assert raised.value.code == 2
    assert "--port 70000 is invalid" in capsys.readouterr().err


# --- the load-test script ---------------------------------------------------------------

def load_test_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "scripts" / "serve_load_test.py"
    spec = importlib.util.spec_from_file_location("serve_load_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_load_test_script_passes_and_catches_a_broken_stream(server, tmp_path, monkeypatch,
                                                             capsys):
    import json
    import os

    from exactspec.server import streaming

    script = load_test_script()
    args = ["--url", server, "--api-key", KEY, "--clients", "3", "--seconds", "2",
            "--max-tokens", "12", "--prompt", PROMPT, "--prompt", "hello there", "--pid", str(os.getpid()), "--max-rss-growth", "1"]
    assert script.main(args + ["--output", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["requests"] >= 3 and report["errors"] == report["mismatches"] == 0
    assert report["ttft_p50_seconds"] <= report["ttft_p95_seconds"]
    assert report["completion_tokens"] == 12 * report["requests"]
    capsys.readouterr()
    # control: a stream that loses a character must fail the test
    delta = streaming.StreamedChoice.delta
    monkeypatch.setattr(streaming.StreamedChoice, "delta",
                        lambda self, ids: delta(self, ids)[1:])
    assert script.main(args) == 1
    assert '"mismatches": 0' not in capsys.readouterr().out
    with pytest.raises(SystemExit, match="not a loopback"):
        script.main(["--url", "http://10.1.2.3:8000"])


# --- batching: concurrent requests share the engine's forwards -------------------------

def test_concurrent_requests_are_batched_and_each_equals_the_library(library):
    """Eight streaming greedy requests at once (different prompts and lengths) join one
    batch: the engine decodes several together (its batch holds more than one row while
    they run), and each stream equals the library's greedy output for its request alone; a
    seeded sampling request among them samples what it samples alone."""
    app = create_app(make_target(), PromptLookupProposer(1, 3), model_name=MODEL,
                     speculation=SpeculationSettings(4, "constant"), max_batch_size=4)
    prompts = [PROMPT, "xyzxyzxy", "hello hello hel", "aaaaaaa", "abcdabcdab", "qwqwqwq",
               "the cat the cat the", "0101010"]
    texts: dict[int, str] = {}
    most_active = []

    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def request(i: int) -> None:
            extra = {"seed": 5, "temperature": 0.9} if i == 3 else {"temperature": 0}
            stream = client.completions.create(model=MODEL, prompt=prompts[i],
                                               max_tokens=30 + 5 * i, stream=True, **extra)
            texts[i] = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        threads = [threading.Thread(target=request, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        while any(thread.is_alive() for thread in threads):
            most_active.append(app.state.worker.batched.num_active)
            time.sleep(0.005)
        for thread in threads:
            thread.join()
    assert max(most_active) >= 2, "the engine never decoded two requests together"
    assert max(most_active) <= 4
    for i, prompt in enumerate(prompts):
        params = (SamplingParams(temperature=0.9, seed=5, max_new_tokens=30 + 5 * i) if i == 3
                  else SamplingParams(max_new_tokens=30 + 5 * i))
        assert texts[i] == library.generate(prompt, params).text, i


class BatchableGatedProposer(GatedProposer):
    """The gated prompt lookup, batchable: several rows decode together while it waits."""

    batchable = True


@pytest.fixture
def gated_batch():
    proposer = BatchableGatedProposer()
    app = create_app(make_target(), proposer, model_name=MODEL,
                     speculation=SpeculationSettings(4, "constant"), max_queue=1,
                     max_batch_size=2)
    with serving(app) as url:
        yield url, proposer, app
        proposer.gate.set()


def test_a_full_batch_and_queue_answer_503_and_a_leaving_client_frees_its_row(gated_batch,
                                                                             library):
    """Batch of 2, queue of 1, drafting slowed to 0.1 s a cycle: two requests run together,
    one waits, a fourth gets 503 at once. One of the running clients leaves: its row is
    dropped (aborted) and the waiting request takes its place; the others finish with the
    library's output."""
    url, proposer, app = gated_batch
    proposer.delay = 0.1
    proposer.gate.set()
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    outcomes: dict[int, object] = {}
    prompts = [PROMPT, "xyzxyzxyz", "hello hello hel"]

    def request(i: int) -> None:
        outcomes[i] = client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=40,
                                                temperature=0, extra_body={"ignore_eos": True})

    body = {"model": MODEL, "prompt": "qwqwqwqw", "max_tokens": 200, "stream": True,
            "temperature": 0, "ignore_eos": True}
    deadline = time.monotonic() + 10
    with httpx.stream("POST", url + "/v1/completions", json=body) as leaving:
        assert leaving.status_code == 200
        running = threading.Thread(target=request, args=(0,))
        running.start()
        while metric(url, "exactspec:num_requests_running") < 2:  # both rows in the batch
            assert time.monotonic() < deadline
            time.sleep(0.01)
        waiting = threading.Thread(target=request, args=(1,))
        waiting.start()
        while metric(url, "exactspec:num_requests_waiting") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        start = time.monotonic()
        with pytest.raises(openai.InternalServerError) as raised:
            client.completions.create(model=MODEL, prompt=prompts[2], max_tokens=5)
        assert raised.value.status_code == 503 and time.monotonic() - start < 5
    deadline = time.monotonic() + 20
    while metric(url, "exactspec:request_aborted_total") < 1:
        assert time.monotonic() < deadline, "the leaving client's row was not dropped"
        time.sleep(0.05)
    running.join(60)
    waiting.join(60)
    assert metric(url, "exactspec:generation_tokens_total") == 80  # the aborted row's: none
    for i in (0, 1):
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        assert outcomes[i].choices[0].text == library.generate(prompts[i], params).text
    assert app.state.worker.batched.num_active == 0


def test_several_prompts_and_n_samples_in_a_batch_equal_the_library(library):
    """A completions request with two prompts and n = 2 seeded samples, beside a greedy
    chat request: each prompt is one row decoding its n samples on one rng, as
    generate_samples does."""
    app = create_app(make_target(), PromptLookupProposer(1, 3), model_name=MODEL,
                     speculation=SpeculationSettings(4, "constant"), max_batch_size=4)
    prompts = [PROMPT, "xyzxyzxyzx"]
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        other = threading.Thread(target=lambda: client.completions.create(
            model=MODEL, prompt="hello hello", max_tokens=40, temperature=0))
        other.start()
        response = client.completions.create(model=MODEL, prompt=prompts, max_tokens=15,
                                             temperature=0.9, n=2, seed=3)
        other.join(30)
    params = SamplingParams(temperature=0.9, seed=3, max_new_tokens=15)
    expected = [r.text for p in prompts for r in library.generate_samples(p, params, n=2)]
    assert [c.text for c in sorted(response.choices, key=lambda c: c.index)] == expected


def test_logprobs_of_tokens_outside_the_nucleus_are_json_numbers(server):
    """top_p keeps one token: the alternatives have probability 0, written -9999.0 (vLLM's
    convention: JSON has no -inf) rather than failing the response."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "top_p": 0.01, "logprobs": 5,
            "seed": 1}
    response = httpx.post(server + "/v1/completions", json=body,
                          headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 200, response.text
    top = response.json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert sorted(top.values())[0] == -9999.0 and max(top.values()) == 0.0


def test_return_token_ids_gives_the_prompt_and_generated_ids(server, library):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0.0,
            "return_token_ids": True, "n": 2}
    headers = {"Authorization": f"Bearer {KEY}"}
    choices = httpx.post(server + "/v1/completions", json=body, headers=headers).json()["choices"]
    expected = library.generate(PROMPT, SamplingParams(temperature=0.0, max_new_tokens=6))
    assert all(c["token_ids"] == expected.token_ids for c in choices)
    assert choices[0]["prompt_token_ids"] == expected.prompt_token_ids
    streamed = httpx.post(server + "/v1/completions", json=body | {"stream": True, "n": 1},
                          headers=headers)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_token_ids"


def test_structured_outputs_through_the_openai_client():
    """vLLM's structured_outputs on both endpoints, streamed and not, n = 2: every finished
    choice matches; the same seed gives the library's output under the same constraint."""
    from conftest import ALPHABET
    from exactspec.constraints import Constraint

    eos = ALPHABET.index("?")
    target = tiny_backend(5, eos=[eos], max_context=256)
    app = create_app(target, PromptLookupProposer(1, 3), model_name=MODEL,
                     speculation=SpeculationSettings(3, "constant"))
    regex = r"(ab|cd)+e"
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        ask = dict(model=MODEL, n=2, temperature=1.0, seed=4, max_tokens=30,
                   extra_body={"structured_outputs": {"regex": regex}})
        for stream in (False, True):
            texts, reasons = ["", ""], [None, None]
            response = client.chat.completions.create(
                messages=[{"role": "user", "content": "abcd abcd"}], stream=stream, **ask)
            for part in (response if stream else [response]):
                for choice in part.choices:
                    texts[choice.index] += (choice.delta.content or "") if stream \
                        else choice.message.content
                    reasons[choice.index] = choice.finish_reason or reasons[choice.index]
            for text, reason in zip(texts, reasons):  # (the tiny tokenizer writes EOS: ?)
                assert re.fullmatch(regex + r"\?" if reason == "stop" else r"((ab|cd)*(a|c)?)",
                                    text), (text, reason)
        completion = client.completions.create(prompt="abcd", **ask | {
            "extra_body": {"structured_outputs": {"choice": ["abcd", "cab"]}}})
        assert {c.text for c in completion.choices} <= {"abcd?", "cab?"}
        expected = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3, "constant") \
            .generate_samples("abcd", SamplingParams(
                temperature=1.0, seed=4, max_new_tokens=30,
                constraint=Constraint.choice(["abcd", "cab"])), n=2)
        assert [c.text for c in completion.choices] == [r.text for r in expected]


@pytest.mark.parametrize("tree", [None, 6])
def test_a_draft_head_serves_constrained_requests(tiny_head_file, tree):
    """Issue 63: a draft head under a constraint that forces tokens answered HTTP 500. Each
    structured output kind is served, with plain decoding's greedy tokens."""
    from exactspec.constraints import Constraint
    from exactspec.proposers.head import HeadProposer

    from conftest import ALPHABET

    target = tiny_backend(0, eos=[ALPHABET.index("?")], max_context=256)  # the head's model
    app = create_app(target, HeadProposer(target, tiny_head_file, tree_nodes=tree),
                     model_name=MODEL, speculation=SpeculationSettings(4, "constant"))
    plain = SpeculativeGenerator(target, None)
    cases = [({"regex": "(ab|cd)+e"}, Constraint.regex("(ab|cd)+e")),
             ({"choice": ["abcdabcd1", "abcdabcd2"]},
              Constraint.choice(["abcdabcd1", "abcdabcd2"])),
             ({"grammar": 'start: "ab" ("," "cd")*'}, Constraint.grammar('start: "ab" ("," "cd")*'))]
    with serving(app) as url:
        for structured, constraint in cases:
            response = httpx.post(url + "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                "structured_outputs": structured})
            assert response.status_code == 200, (structured, response.text)
            expected = plain.generate(PROMPT, SamplingParams(max_new_tokens=12,
                                                             constraint=constraint))
            assert response.json()["choices"][0]["text"] == expected.text, structured


def test_a_draft_model_server_decodes_concurrent_requests_together():
    """Issue 65 item 5: ``serve`` with a draft model batches (each row its own draft
    sequence, the draft forwards packed): three concurrent requests, greedy and seeded, get
    the library's outputs alone, and the batch holds three rows."""
    target = make_target()
    draft = tiny_backend(0, model=target.model)  # the target's weights: drafts accepted
    app = create_app(target, DraftModelProposer(draft, target), model_name=MODEL,
                     speculation=SpeculationSettings(3, "constant"), max_batch_size=3)
    assert app.state.worker.batched.max_batch_size == 3
    prompts = [PROMPT, "xyzxyzxyz", "hello hello hel"]
    params = [SamplingParams(max_new_tokens=30), SamplingParams(max_new_tokens=25),
              SamplingParams(temperature=0.9, seed=5, max_new_tokens=20)]
    texts: dict[int, str] = {}
    with serving(app) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)

        def request(i: int) -> None:
            p = params[i]
            texts[i] = client.completions.create(
                model=MODEL, prompt=prompts[i], max_tokens=p.max_new_tokens,
                temperature=p.temperature, seed=p.seed).choices[0].text

        threads = [threading.Thread(target=request, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    alone = SpeculativeGenerator(make_target(), DraftModelProposer(
        tiny_backend(0, model=target.model), target), 3, "constant")
    assert [texts[i] for i in range(3)] == [alone.generate(p, q).text
                                           for p, q in zip(prompts, params)]
