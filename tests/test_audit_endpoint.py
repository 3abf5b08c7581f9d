"""The audit over HTTP (``exactspec audit --endpoint``): its two-sample statistics are
calibrated and catch what they claim; it reads every API's shape, never counts a failed
request, keeps what was drawn on Ctrl-C; and on real servers started here on loopback
(exactspec serve over a tiny model) it passes speculation against plain decoding, fails a
server with a broken verifier, and checks a local reference."""

from __future__ import annotations

import functools
import json

import httpx
import numpy as np
import pytest

from conftest import tiny_backend
from exactspec import PromptLookupProposer, SamplingParams
from exactspec.audit.broken import BrokenGenerator
from exactspec.audit.endpoint import END, Endpoint, EndpointError
from exactspec.audit import AuditResult, ExactReference, verdict
from exactspec.audit.remote import compare_greedy, draw_interleaved
from exactspec.audit.result import distribution_test
from exactspec.audit.stats import decide
from exactspec.audit.two_sample import (compare_prompt, hamming_mmd, max_draws_for,
                                        permutation_p_value, tables)
from exactspec.cli import main
from exactspec.server import SpeculationSettings, create_app
from test_audit import lookup_friendly_prompt
from test_server import serving

MODEL = "tiny"
_TARGET = tiny_backend(0, max_context=256)
PROMPT = _TARGET.tokenizer.decode(lookup_friendly_prompt(_TARGET, 1, [2, 3, 4]))
"""Text on which prompt lookup drafts a token the tiny model often accepts."""
OFF = '{"speculation": {"enabled": false}}'


# --- the two-sample statistics ------------------------------------------------------------

def chain(rng, n, first, second):
    """n samples of 2 tokens: x1 ~ first, x2 ~ second[x1]."""
    x1 = rng.choice(len(first), n, p=first)
    return [(int(a), int(rng.choice(len(second[a]), p=second[a]))) for a in x1]


FIRST = np.array([0.5, 0.3, 0.2])
SECOND = np.array([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3], [0.1, 0.2, 0.7]])


def test_false_alarm_rate_is_at_most_the_level():
    """Equal engines: each position's permutation p-value falls at or below 0.05 in at most
    about 5 % of 200 repetitions (binomial upper 99.9 % bound), at small counts."""
    rng = np.random.default_rng(0)
    below = np.zeros(2)
    for _ in range(200):
        a, b = chain(rng, 60, FIRST, SECOND), chain(rng, 60, FIRST, SECOND)
        comparison = compare_prompt(a, b, 2, 1000, seed=int(rng.integers(1 << 30)))
        below += [p.p_value <= 0.05 for p in comparison.positions]
    assert (below <= 200 * 0.05 + 3.1 * np.sqrt(200 * 0.05 * 0.95)).all(), below


def test_a_conditional_deviation_with_equal_marginals_is_caught_only_by_the_conditional_test():
    """B swaps the second token's conditionals between the first token's values 0 and 1
    with FIRST's mass of 0 and 1 equal: every position's marginal is unchanged (the MMD
    test with a Hamming kernel cannot see it), the conditional at token 2 is not; and a
    shift of the marginals alone is the MMD test's."""
    first = np.array([0.5, 0.5])
    second = np.array([[0.8, 0.2], [0.2, 0.8]])
    rng = np.random.default_rng(1)
    a = chain(rng, 1500, first, second)
    b = chain(rng, 1500, first, second[::-1])
    comparison = compare_prompt(a, b, 2, max_draws_for(0.01, 2))
    decide([comparison], 0.01)
    assert not comparison.positions[0].rejected
    assert comparison.positions[1].rejected and comparison.positions[1].tv > 0.5
    assert comparison.mmd.p_value > 0.01
    marginal_shift = compare_prompt(a, chain(rng, 1500, first, np.array([[0.9, 0.1]] * 2)), 2,
                                    max_draws_for(0.01, 2))
    assert marginal_shift.mmd.p_value < 0.01  # the control: MMD sees marginal deviations


def test_the_stated_detectable_deviation_is_caught_four_times_in_five():
    """A first-token deviation of exactly the stated detectable TV, moved between two halves
    of the mass (the least favourable direction), is caught in ≥ 70 % of 40 repetitions
    (80 % stated, minus sampling error)."""
    p = np.array([0.25, 0.25, 0.25, 0.25])
    rng = np.random.default_rng(2)
    n = 800
    probe = compare_prompt([(int(t),) for t in rng.choice(4, n, p=p)],
                           [(int(t),) for t in rng.choice(4, n, p=p)], 1, 2000)
    level = decide([probe], 0.01)
    delta = probe.positions[0].detectable_tv
    shifted = p + np.array([delta, delta, -delta, -delta]) / 2
    caught = 0
    for _ in range(40):
        comparison = compare_prompt([(int(t),) for t in rng.choice(4, n, p=p)],
                                    [(int(t),) for t in rng.choice(4, n, p=shifted)], 1,
                                    max_draws_for(0.01, 1), seed=int(rng.integers(1 << 30)))
        caught += comparison.positions[0].p_value <= level
    assert caught >= 28, (caught, delta)


def test_tables_pool_rare_tokens_and_skip_prefixes_one_engine_never_reached():
    a = [(0, 1)] * 10 + [(1, 0)] * 3 + [(2, 0)]
    b = [(0, 1)] * 8 + [(0, 2)] * 2 + [(3, 3)] * 2
    found = tables(a, b, 2)
    first = found[0][0]
    assert first.bins == [0, None]  # tokens 1, 2, 3 drawn 6 times together: one pooled bin
    assert first.counts_a.tolist() == [10, 4] and first.counts_b.tolist() == [10, 2]
    assert 1 not in found  # at (0,) one bin after merging the rare token; (1,) only A's


def test_permutation_p_value_is_exact_for_a_tiny_table():
    """2 × 2 table [[3, 0], [0, 3]]: of the C(6, 3) = 20 equally likely A rows, two are as
    extreme (the observed and its mirror): p = 0.1."""
    from exactspec.audit.two_sample import Table, g_statistics

    table = Table([0, 1], np.array([3, 0]), np.array([0, 3]))
    observed = float(g_statistics(table.counts_a, table.counts_b))
    p, draws = permutation_p_value([table], observed, np.random.default_rng(0), 20000)
    assert abs(p - 0.1) < 0.01 and draws <= 20000


def test_mmd_is_about_zero_for_equal_samples():
    rng = np.random.default_rng(3)
    a, b = chain(rng, 400, FIRST, SECOND), chain(rng, 400, FIRST, SECOND)
    result = hamming_mmd(a, b, 2, rng, 2000)
    assert result.p_value > 0.01 and abs(result.statistic) < 0.01


# --- the client: what it reads, what it never counts ----------------------------------

def mock_endpoint(handler, **kwargs) -> Endpoint:
    return Endpoint("http://mock", model="m", max_retries=0,
                    http_client=httpx.Client(transport=httpx.MockTransport(handler)), **kwargs)


def choice(index, tokens, finish="length", **extra):
    return {"index": index, "text": "".join(tokens), "finish_reason": finish,
            "logprobs": {"tokens": tokens, "token_logprobs": [-1.0] * len(tokens),
                         "top_logprobs": [{t: -1.0} for t in tokens]}} | extra


def test_tokens_come_from_ids_then_logprobs_and_a_stop_ends_with_end():
    def handler(request):
        body = json.loads(request.content)
        assert body["return_token_ids"] and body["logprobs"] == 1 and body["top_k"] == 0
        assert body["repeat_penalty"] == 1.0  # --extra-body wins
        return httpx.Response(200, json={"choices": [
            choice(0, ["a", "b"], "stop", token_ids=[5, 9]),
            choice(1, ["a", "b", "c"], token_ids=[5, 9, 2])]})

    endpoint = mock_endpoint(handler, extra_body={"repeat_penalty": 1.0})
    ids, texts = endpoint.complete("x", SamplingParams(max_new_tokens=3), n=2)
    assert ids.tokens == (5, 9, END) and ids.source == "token_ids"
    assert texts.tokens == (5, 9, 2)  # ended by max_tokens: no END
    endpoint2 = mock_endpoint(lambda r: httpx.Response(200, json={"choices": [
        choice(0, ["a", "b", "c"])]}))
    texts = endpoint2.complete("x", SamplingParams(max_new_tokens=3))[0]
    assert texts.tokens == ("a", "b", "c") and texts.source == "logprob_text"
    content = {"content": [{"id": 7, "token": "a", "logprob": -0.5, "top_logprobs": []}]}
    endpoint3 = mock_endpoint(lambda r: httpx.Response(200, json={"choices": [
        {"index": 0, "text": "a", "finish_reason": "length", "logprobs": content}]}))
    assert endpoint3.sample("x", SamplingParams(max_new_tokens=1), 2) == [(7,), (7,)]
    assert endpoint3.token_source == "logprob_ids"  # llama-server's shape


def test_failed_requests_are_reported_never_counted_and_a_refusal_stops():
    calls = []

    def handler(request):
        calls.append(json.loads(request.content)["seed"])
        if len(calls) % 3 == 0:
            return httpx.Response(503, json={"error": {"message": "busy"}})
        return httpx.Response(200, json={"choices": [choice(0, ["a", "b"])]})

    endpoint = mock_endpoint(handler, concurrency=1)
    samples = endpoint.sample("x", SamplingParams(max_new_tokens=2, seed=4), 9)
    assert len(samples) == 6 and len(endpoint.failures) == 3
    assert "503" in endpoint.failures[0] and sorted(calls) == [4 * 64 + r for r in range(9)]
    refusing = mock_endpoint(lambda r: httpx.Response(400, json={"error": {
        "message": "top_k is not allowed"}}))
    with pytest.raises(EndpointError, match="400: top_k is not allowed"):
        refusing.sample("x", SamplingParams(max_new_tokens=2), 3)


MALFORMED = {  # issue 45: each once ended the audit in a traceback, or blamed n
    "invalid JSON": lambda: httpx.Response(200, content=b'{"choices": [', headers={
        "content-type": "application/json"}),
    "a JSON array": lambda: httpx.Response(200, json=[1, 2]),
    "token ids that are words": lambda: httpx.Response(200, json={"choices": [
        choice(0, ["a", "b"], token_ids=["a", 2])]}),
    "token ids that are floats": lambda: httpx.Response(200, json={"choices": [
        choice(0, ["a", "b"], token_ids=[1.5, 2])]}),
    "no choices": lambda: httpx.Response(200, json={"object": "text_completion"}),
    "a choice that is a string": lambda: httpx.Response(200, json={"choices": ["ab"]}),
}


@pytest.mark.parametrize("malformed", MALFORMED)
def test_an_unreadable_answer_is_a_failed_request_with_its_reason(malformed):
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) % 2 == 0:
            return MALFORMED[malformed]()
        return httpx.Response(200, json={"choices": [choice(0, ["a", "b"], token_ids=[3, 4])],
                                         "speculation": {"drafted_tokens": "many",
                                                         "accepted_tokens": 1}})

    endpoint = mock_endpoint(handler, concurrency=1)
    samples = endpoint.sample("x", SamplingParams(max_new_tokens=2, seed=1), 6)
    assert samples == [(3, 4)] * 3 and len(endpoint.failures) == 3
    assert all("unreadable answer" in f for f in endpoint.failures), endpoint.failures
    assert endpoint.draft_stats is None  # figures that are not counts are not counted
    always = mock_endpoint(lambda r: MALFORMED[malformed](), concurrency=1)
    with pytest.raises(EndpointError, match="failed in a row, the last with: unreadable answer"):
        always.sample("x", SamplingParams(max_new_tokens=2), 30)


def test_an_engine_ignoring_n_is_refused_and_unsendable_parameters_too():
    endpoint = mock_endpoint(lambda r: httpx.Response(200, json={"choices": [choice(0, ["a"])]}))
    with pytest.raises(EndpointError, match="ignores n"):
        endpoint.complete("x", SamplingParams(max_new_tokens=1), n=4)
    with pytest.raises(ValueError, match="repetition_penalty"):
        endpoint.body(SamplingParams(repetition_penalty=1.2), None, 1)


def test_ctrl_c_keeps_what_was_drawn():
    calls = []

    def handler(request):
        calls.append(1)
        if len(calls) > 60:
            raise KeyboardInterrupt
        return httpx.Response(200, json={"choices": [choice(0, ["a", "b"])]})

    endpoint = mock_endpoint(handler, concurrency=1)
    samples, interrupted = draw_interleaved([endpoint], ["x"], SamplingParams(max_new_tokens=2,
                                                                             seed=0), [200],
                                            lambda n: None)
    assert interrupted and len(samples[0][0]) == 50  # the first chunk; the second was cut


# --- real servers on loopback ---------------------------------------------------------------

def app(**kwargs):
    return create_app(tiny_backend(0, max_context=256), PromptLookupProposer(1, 3),
                      model_name=MODEL, speculation=SpeculationSettings(3, "constant"), **kwargs)


@pytest.fixture(scope="module")
def server():
    with serving(app()) as url:
        yield url


@pytest.fixture(scope="module")
def broken_server():
    broken = functools.partial(BrokenGenerator, broken="accept-all")
    with serving(app(generator_factory=broken)) as url:
        yield url


def run_audit(url, tmp_path, *extra) -> dict:
    status = main(["audit", "--endpoint", url, "--against-body", OFF, "--prompt", PROMPT,
                   "--samples", "600", "--tokens", "3", "--greedy-tokens", "12",
                   "--samples-per-request", "16", "--output", str(tmp_path), *extra])
    result = json.loads((tmp_path / "audit.json").read_text())
    assert status == (0 if result["verdict"] == "exact" else 1)
    return result


def test_exactspec_serve_with_speculation_is_exact_against_itself_without(server, tmp_path):
    result = run_audit(server, tmp_path)
    assert result["verdict"] == "exact", result["reasons"]
    assert result["control"]["prompts"][0]["positions"][0]["rejected"]
    test = result["distribution"]
    assert test["drafted_per_position"][:2] >= [500, 100], test["drafted_per_position"]
    assert test["accepted_per_position"][0] >= 100, test["accepted_per_position"]
    assert result["token_source"] == "token_ids" and not result["failures"]
    assert all(c["identical"] for c in result["greedy"])
    assert (tmp_path / "report.md").read_text().count("| 0 | ") >= 6
    assert (tmp_path / "prompt-0.png").stat().st_size > 1000


def test_a_server_with_a_broken_verifier_is_not_exact(broken_server, tmp_path):
    result = run_audit(broken_server, tmp_path)
    assert result["verdict"] == "NOT exact", result["reasons"]
    rejected = [p["position"] for p in result["distribution"]["prompts"][0]["positions"]
                if p["rejected"]]
    assert rejected and "deviates" in " ".join(result["reasons"])


def test_reference_mode_checks_the_served_model_and_its_distribution(server, broken_server):
    """The library's reference test on the endpoint's samples: the correct server passes,
    the broken one fails, at the same seeds."""
    target = tiny_backend(0, max_context=256)
    prompt_ids = [target.tokenizer.encode(PROMPT)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=0, max_new_tokens=3)
    for url, expected in ((server, False), (broken_server, True)):
        endpoint = Endpoint(url, samples_per_request=16, ids_only=True)
        samples, _ = draw_interleaved([endpoint], [PROMPT], params, [600], lambda n: None)
        reference = ExactReference(target, prompt_ids, params)
        test = distribution_test(endpoint.name, [reference.test_prompt(0, samples[0][0])], 0.01,
                                 endpoint.draft_stats)
        assert test.rejected == expected
        assert test.drafted_per_position[0] >= 500


def test_greedy_mode_reports_the_first_divergence_with_both_logprobs(server):
    """Another model behind B: the greedy outputs diverge; the report names the position
    and both sides' logprobs."""
    with serving(create_app(tiny_backend(1, max_context=256), None, model_name=MODEL,
                            speculation=SpeculationSettings(0, "constant"))) as other:
        a, b = Endpoint(server), Endpoint(other)
        params = SamplingParams(temperature=0.0, max_new_tokens=8)
        found, _, _ = compare_greedy(lambda i: a.complete(PROMPT, params, top_logprobs=5)[0],
                               lambda i: b.complete(PROMPT, params, top_logprobs=5)[0], 1)
    assert not found[0].identical and found[0].position is not None
    assert found[0].logprob_a is not None and found[0].logprob_b is not None
    result = verdict(AuditResult({}, found, mode="greedy"))
    assert result.verdict == "NOT exact" and "differs at token" in result.reasons[0]


def test_the_endpoint_options_refuse_what_does_not_apply(server, capsys):
    with pytest.raises(SystemExit):
        main(["audit", "--endpoint", server, "--prompt", PROMPT])  # B missing
    assert "--against" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["audit", "--endpoint", server, "--against-body", OFF, "--proposer", "suffix"])
    assert "does not apply" in capsys.readouterr().err


def test_an_endpoint_that_keeps_failing_stops_the_audit():
    endpoint = mock_endpoint(lambda r: httpx.Response(500, json={"error": {"message": "down"}}),
                             concurrency=1)
    with pytest.raises(EndpointError, match="requests failed in a row, the last with: 500"):
        endpoint.sample("x", SamplingParams(max_new_tokens=2), 30)


def test_requests_of_n_choices_get_seeds_n_apart():
    """llama-server seeds choice i with seed + i: requests' seeds must be n apart."""
    seeds = []

    def handler(request):
        body = json.loads(request.content)
        seeds.append(body["seed"])
        return httpx.Response(200, json={"choices": [choice(i, ["a"]) for i in range(body["n"])]})

    endpoint = mock_endpoint(handler, samples_per_request=4, seed_offset=1000)
    assert len(endpoint.sample("x", SamplingParams(max_new_tokens=1, seed=2), 12)) == 12
    assert sorted(seeds) == [(2 * 64 + r) * 4 + 1000 for r in range(3)]


def test_chat_requests_send_one_user_message_and_read_the_chat_logprobs():
    def handler(request):
        assert request.url.path.endswith("/chat/completions")
        body = json.loads(request.content)
        assert body["messages"] == [{"role": "user", "content": "hi"}]
        assert body["logprobs"] is True and body["top_logprobs"] == 1
        content = [{"token": t, "logprob": -0.1, "top_logprobs": [{"token": t, "logprob": -0.1}]}
                   for t in ("a", "b")]
        return httpx.Response(200, json={"choices": [{
            "index": 0, "message": {"role": "assistant", "content": "ab"},
            "finish_reason": "stop", "logprobs": {"content": content}}]})

    completion = mock_endpoint(handler, chat=True).complete("hi", SamplingParams(max_new_tokens=4))[0]
    assert completion.tokens == ("a", "b", END) and completion.logprobs == [-0.1, -0.1]


# --- the endpoint as an Engine, and one verdict for every audit -----------------------------

def test_an_endpoint_is_an_engine_generating_timed_requests():
    def handler(request):
        body = json.loads(request.content)
        assert body["n"] == 1 and body["seed"] == 7
        tokens = ["a", "b"] if body["prompt"] == "x" else ["c"]
        return httpx.Response(200, json={"choices": [choice(0, tokens, "stop", token_ids=[
            ord(t) for t in tokens])]})

    endpoint = mock_endpoint(handler)
    assert endpoint.corpus is None and endpoint.draft_stats is None
    params = SamplingParams(max_new_tokens=4, seed=7)
    for at_once in (False, True):
        found = endpoint.generate(["x", "y"], params, at_once=at_once)
        assert [g.token_ids for g in found] == [[97, 98], [99]]  # END left out
        assert all(0 <= g.seconds <= g.latency for g in found) and found[0].stats is None


def test_the_barely_exercised_threshold_is_one_for_every_audit():
    """Fewer draft tokens than samples is inconclusive in a two-sample audit as in a local
    one (they once differed: samples // 2 over HTTP)."""
    from exactspec.audit import DistributionTest

    rng = np.random.default_rng(5)
    same = [compare_prompt(chain(rng, 300, FIRST, SECOND), chain(rng, 300, FIRST, SECOND), 2,
                           max_draws_for(0.01, 3))]
    shifted = [compare_prompt(chain(rng, 300, FIRST[::-1], SECOND), chain(rng, 300, FIRST, SECOND),
                              2, max_draws_for(0.01, 3))]
    decide(same, 0.01)
    decide(shifted, 0.01)
    assert not same[0].rejected and shifted[0].rejected
    control = DistributionTest("control", shifted, "B")
    for drafted, expected in ((300, "exact"), (299, "inconclusive"), (200, "inconclusive")):
        tested = DistributionTest("A", same, "B", drafted=drafted, accepted=0)
        result = verdict(AuditResult({}, distribution=tested, control=control, mode="two-sample"))
        assert result.verdict == expected, result.reasons


def test_run_needs_exactly_one_kind_of_audit():
    from exactspec.audit import AuditSpec, EndpointSpec, run

    with pytest.raises(ValueError, match="exactly one of setup"):
        run(AuditSpec(["x"], SamplingParams(seed=0)))
    with pytest.raises(ValueError, match="B is missing"):
        run(AuditSpec(["x"], SamplingParams(seed=0), endpoint=EndpointSpec("http://mock")))
