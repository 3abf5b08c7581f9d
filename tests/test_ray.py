"""Past one machine, on a local Ray cluster the tests start (``ray.init(num_cpus=2)``, a
small object store), tiny models: ``audit --ray`` writes the audit.json of the run without
Ray; a killed worker is restarted and its work retried, and one killed twice is reported,
never silently dropped; ``bench --ray`` runs every question run side by side on one
worker; ``serve --replicas 2`` answers the ``openai`` client (streaming included) with the
single server's greedy outputs, answers or refuses every request while a replica dies, and
its metrics reach Ray's metrics export tagged per replica."""

import argparse
import dataclasses
import functools
import json
import os
import re
import socket
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'exactspec[ray]')")

from exactspec import PromptLookupProposer, SamplingParams, SpeculativeGenerator  # noqa: E402
from exactspec.audit import (AuditResult, AuditSetup, ExactspecEngine,  # noqa: E402
                             audit_distribution, verdict)
from exactspec.cli import build_parser, main  # noqa: E402
from exactspec.distributed import LocalExecutor, RayExecutor  # noqa: E402

from conftest import tiny_backend  # noqa: E402

TESTS = Path(__file__).parent
PARAMS = SamplingParams(temperature=0.9, seed=3, max_new_tokens=3)
PROMPTS = [[1, 2, 3, 1, 2, 3, 1, 2], [5, 6, 5, 6, 5, 6, 5]]


@pytest.fixture(scope="module")
def cluster():
    """A local Ray instance of 2 CPUs whose workers import this folder's modules."""
    path = os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")]))
    ray.init(num_cpus=2, object_store_memory=80 * 2**20, include_dashboard=False,
             log_to_driver=False, logging_level="ERROR",
             runtime_env={"env_vars": {"PYTHONPATH": path}})
    yield ray
    ray.shutdown()


def audit_json(folder: Path) -> tuple[dict, dict]:
    """audit.json without the wall time and where it ran (what may differ), and those two."""
    result = json.loads((folder / "audit.json").read_text())
    where = {key: result["config"].pop(key) for key in ("seconds", "ran_on")}
    return result, where


def test_audit_on_ray_writes_the_audit_json_of_the_run_here(cluster, model_folder, tmp_path,
                                                             capsys):
    args = ["audit", "--model", str(model_folder), "--prompt", "abcdabcdab", "--prompt",
            "hello hello hel", "--samples", "120", "--tokens", "3", "--greedy-tokens", "8",
            "--proposer", "prompt-lookup:ngram=1-3", "--threads", "1"]
    here = main(args + ["--output", str(tmp_path / "here")])
    on_ray = main(args + ["--output", str(tmp_path / "ray"), "--ray", "--workers", "2"])
    capsys.readouterr()
    (a, where_a), (b, where_b) = audit_json(tmp_path / "here"), audit_json(tmp_path / "ray")
    assert where_a["ran_on"] == "this process" and where_b["ran_on"] == "2 Ray workers × 1 CPU"
    assert a == b and here == on_ray
    # chunks of 50: 3 per prompt, spread over both workers; speculation was exercised
    assert a["distribution"]["drafted_per_position"][0] > 0
    assert sum(p["num_samples"] for p in a["distribution"]["prompts"]) == 240
    assert any(p["rejected"] for t in a["control"]["prompts"] for p in t["positions"])


class DiesWhenSampling(ExactspecEngine):
    """An engine whose process exits (as if killed) when asked for the chunk seeded
    ``seed``: once (a marker file remembers) or every time."""

    def __init__(self, generator, marker: Path, seed: int, once: bool) -> None:
        super().__init__(generator, "dies")
        self.marker, self.seed, self.once = marker, seed, once

    def sample(self, prompt_ids, params, num_samples):
        if params.seed == self.seed and not (self.once and self.marker.exists()):
            self.marker.touch()
            os._exit(1)
        return super().sample(prompt_ids, params, num_samples)


def dying_setup(marker: str, seed: int, once: bool) -> AuditSetup:
    target = tiny_backend(0)
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 3)
    return AuditSetup(target, {"engine": DiesWhenSampling(generator, Path(marker), seed, once)},
                      PROMPTS, PARAMS)


def audit(executor):
    """160 samples per prompt in chunks of 40 (the driver only names the engine: the
    workers hold their own)."""
    return audit_distribution(None, argparse.Namespace(name="dies"), PROMPTS, PARAMS, 160,
                              0.01, chunk=40, executor=executor)


def test_a_killed_worker_is_restarted_and_its_chunk_drawn_again(cluster, tmp_path):
    marker = tmp_path / "died"
    here = audit(LocalExecutor(dying_setup(str(marker), -1, once=True)))  # never dies
    seed = PARAMS.seed + 1000 * 1 + 2  # prompt 1, chunk 2
    pool = RayExecutor(functools.partial(dying_setup, str(marker), seed, True), 2)
    try:
        on_ray = audit(pool)
    finally:
        pool.close()
    assert marker.exists()  # a worker died on that chunk ...
    assert on_ray.missing == [] and dataclasses.asdict(on_ray) == dataclasses.asdict(here)
    assert sum(p.num_samples for p in on_ray.prompts) == 320  # ... and nothing was lost


def test_a_worker_killed_twice_is_reported_and_the_verdict_says_what_is_missing(cluster,
                                                                                tmp_path):
    seed = PARAMS.seed + 1000 * 0 + 1  # prompt 0, chunk 1
    pool = RayExecutor(functools.partial(dying_setup, str(tmp_path / "died"), seed, False), 2)
    try:
        test = audit(pool)
    finally:
        pool.close()
    # the chunk is named; other chunks queued on that worker are either run by its restarted
    # process before the retried chunk kills it again, or named too: none is dropped
    lost = [m.split(":")[1].strip() for m in test.missing]
    assert "prompt 0, samples 40–79" in lost and len(set(lost)) == len(lost)
    assert all(re.fullmatch(r"prompt [01], samples \d+–\d+", m) for m in lost)
    assert all("its Ray worker died twice" in m for m in test.missing)
    assert sum(p.num_samples for p in test.prompts) == 320 - 40 * len(lost)  # tested on the rest
    result = verdict(AuditResult({}, [], test, None))
    assert result.verdict == "inconclusive"
    assert f"{len(lost)} part(s) of the audit were not run" in result.reasons[0]
    assert "prompt 0, samples 40–79" in result.reasons[0]


def test_a_worker_that_cannot_load_is_an_error_naming_the_cause(cluster):
    with pytest.raises(RuntimeError, match="could not load.*no such model"):
        RayExecutor(functools.partial(failing_build, "no such model"), 1)


def failing_build(message: str):
    raise ValueError(message)


def test_an_error_in_a_unit_is_raised_in_the_driver(cluster):
    pool = RayExecutor(functools.partial(dict), 1)
    try:
        with pytest.raises(KeyError):
            pool.map(lambda state, key: state[key], [("absent",)])
    finally:
        pool.close()


QUESTIONS = [("qa", "abcd abcd abcd"), ("qa", "hello hello hel"),
             ("math_reasoning", "1 2 3 1 2 3 1 2"), ("math_reasoning", "the cat the cat the")]


def test_bench_on_ray_runs_each_question_run_side_by_side_on_one_worker(cluster, model_folder,
                                                                         tmp_path, capsys):
    questions = tmp_path / "questions.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": group,
                                             "turns": [text]}) + "\n"
                                 for i, (group, text) in enumerate(QUESTIONS)))
    out = tmp_path / "bench"
    code = main(["bench", "--model", str(model_folder), "--questions", str(questions),
                 "--method", "plain", "--method", "prompt-lookup:k=3", "--max-new-tokens", "24",
                 "--repetitions", "2", "--threads", "1", "--ray", "--workers", "2",
                 "--output", str(out)])
    capsys.readouterr()
    assert code in (0, 3)  # 3: timings unsteady on a shared machine; never a mismatch (1)
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    assert len(records) == 4 * 2 * 2 and results["incomplete"] is None
    assert all(r["matches_plain"] for r in records)
    assert len({r["worker"] for r in records}) == 2
    runs = {}
    for r in records:
        runs.setdefault((r["question_id"], r["repetition"]), set()).add(r["worker"])
    assert all(len(workers) == 1 for workers in runs.values())
    assert len(results["machine"]["workers"]) == 2
    assert results["config"]["ran_on"] == "2 Ray workers × 1 CPU"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def replicas(cluster, model_folder):
    """``serve --replicas 2`` on a free port; yields (base URL, the parsed options)."""
    from exactspec.cli.common import worker_args
    from exactspec.cli.serve import build_app
    from exactspec.server import replicas as ray_serve

    port = free_port()
    args = build_parser().parse_args(["serve", "--model", str(model_folder), "--replicas", "2",
                                      "--threads", "1", "--port", str(port),
                                      "--proposer", "prompt-lookup:ngram=1-3"])
    ray_serve.start(functools.partial(build_app, worker_args(args), ray_metrics=True),
                    replicas=2, port=port)
    try:
        yield f"http://127.0.0.1:{port}", args
    finally:
        ray_serve.stop()


def test_replicas_answer_the_openai_client_like_one_server(replicas, model_folder):
    from fastapi.testclient import TestClient
    from openai import OpenAI

    from exactspec.cli.serve import build_app

    url, args = replicas
    model = str(model_folder)
    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    prompts = ["abcdabcdab", "hello hello hel", "the cat the cat", "1 2 3 1 2"]
    single = TestClient(build_app(argparse.Namespace(**{**vars(args), "replicas": None})))
    for prompt in prompts:
        body = {"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0}
        expected = single.post("/v1/completions", json=body).json()["choices"][0]["text"]
        assert client.completions.create(**body).choices[0].text == expected
        streamed = "".join(chunk.choices[0].text for chunk in
                           client.completions.create(**body, stream=True))
        assert streamed == expected
    chat = {"model": model, "messages": [{"role": "user", "content": "abcabc"}],
            "max_tokens": 12, "temperature": 0}
    expected = single.post("/v1/chat/completions", json=chat).json()
    got = client.chat.completions.create(**chat)
    assert got.choices[0].message.content == expected["choices"][0]["message"]["content"]
    with pytest.raises(Exception, match="does not exist"):  # the single server's 404
        client.completions.create(model="other", prompt="ab", max_tokens=2)
    # both replicas served: each of the 9 answered requests counted once, by replica
    counts = ray_metric_by_replica("ray_exactspec_request_success_total", expected_total=9)
    assert len(counts) == 2 and sum(counts.values()) == 9


def ray_metric_by_replica(name: str, expected_total: float, timeout: float = 60) -> dict:
    """A counter's value per replica tag, read from the node's Ray metrics export (polled
    until its total reaches ``expected_total``: Ray exports every few seconds)."""
    import urllib.request

    port = ray.nodes()[0]["MetricsExportPort"]
    deadline, counts = time.monotonic() + timeout, {}
    while time.monotonic() < deadline:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        counts = {}
        for line in text.splitlines():
            if line.startswith(name + "{"):
                replica = re.search(r'replica="([^"]+)"', line).group(1)
                counts[replica] = counts.get(replica, 0) + float(line.rsplit(" ", 1)[1])
        if sum(counts.values()) >= expected_total:
            break
        time.sleep(2)
    return counts


def test_a_dying_replica_loses_no_request(replicas, model_folder):
    import concurrent.futures

    import httpx

    url, _ = replicas
    body = {"model": str(model_folder), "prompt": "abcdabcdab", "max_tokens": 200,
            "temperature": 0}
    expected = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    victim = next(actor for actor in ray.util.list_named_actors(all_namespaces=True)
                  if "ExactspecServer" in actor["name"])
    handle = ray.get_actor(victim["name"], namespace=victim["namespace"])

    def ask(_):
        try:
            response = httpx.post(url + "/v1/completions", json=body, timeout=60)
        except httpx.HTTPError as error:  # the connection cut: the client knows
            return type(error).__name__
        return response.status_code, (response.json()["choices"] if response.status_code == 200
                                      else None)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(ask, i) for i in range(16)]
        time.sleep(0.2)
        ray.kill(handle, no_restart=False)
        outcomes = [f.result(timeout=120) for f in futures]
    answered = [o for o in outcomes if isinstance(o, tuple) and o[0] == 200]
    # every request got an answer: the right text, or an error the client sees
    assert all(o[1] == expected["choices"] for o in answered)
    assert all(isinstance(o, str) or o[0] >= 500 for o in outcomes if o not in answered)
    assert len(answered) >= 4  # the live replica answered its share
    deadline = time.monotonic() + 90  # the replica comes back: all answered again
    while ask(0)[0] != 200 and time.monotonic() < deadline:
        time.sleep(2)
    assert all(ask(i) == (200, expected["choices"]) for i in range(4))


def test_an_address_where_no_cluster_answers_fails_at_once(model_folder):
    import subprocess
    import sys

    start = time.monotonic()  # a fresh process: this one may be connected already
    run = subprocess.run([sys.executable, "-c", "import sys; from exactspec.cli import main; "
                          "sys.exit(main())", "audit", "--model",
                          str(model_folder), "--samples", "10", "--ray",
                          f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and "no Ray cluster answers at 127.0.0.1:" in run.stderr
    assert "Traceback" not in run.stderr
    assert time.monotonic() - start < 60  # Ray itself would retry for minutes


def test_more_replicas_than_the_cluster_holds_is_refused(cluster, model_folder):
    from exactspec.cli.common import worker_args
    from exactspec.cli.serve import build_app
    from exactspec.server import replicas as ray_serve

    args = build_parser().parse_args(["serve", "--model", str(model_folder)])
    with pytest.raises(RuntimeError, match="3 replicas × 1 CPU need 3 CPUs; the Ray cluster "
                                           "has 2"):
        ray_serve.start(functools.partial(build_app, worker_args(args)), replicas=3,
                        port=free_port())
    assert ray.is_initialized()  # the tests' cluster is kept


def test_workers_running_other_exactspec_code_are_refused(cluster, monkeypatch):
    from exactspec import distributed

    monkeypatch.setattr(distributed, "code_fingerprint", lambda: "000000000000")  # "here"
    with pytest.raises(RuntimeError, match="runs other exactspec code than this process"):
        RayExecutor(functools.partial(dict), 1)
