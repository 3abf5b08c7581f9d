"""``exactspec audit --endpoint`` on other engines' own servers over the embedded model,
started here on loopback: llama-cpp-python's OpenAI server with its prompt-lookup draft,
and llama.cpp's ``llama-server`` (built by scripts/build_llama_server.sh) with a draft model
and with n-gram speculation, each against itself without speculation. Whatever their
verdict, the audit must run to its end on them: every sample read, none failed, the greedy
outputs compared, and a control (a temperature far off) caught. Marked real_model."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from exactspec.cli import main
from exactspec.model_files import DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotFoundError

pytestmark = pytest.mark.real_model

try:
    GGUF = str(EMBEDDED_MODELS[DEFAULT_MODEL].path())
except ModelNotFoundError as error:
    pytest.skip(str(error), allow_module_level=True)

PROMPT = "Monday, Tuesday, Wednesday, Thursday, Friday, Monday, Tuesday,"
"""Prompt lookup and n-gram speculation draft here from the first token."""
SAMPLES = 150
"""Per side (A, B and the control): enough to catch the control (temperature 2.0 moves the
first token's probability by far more than the audit detects at this count) and to read
every answer shape; the verdict on A itself needs more (results/audit-http-2026-12-02)."""
LLAMA_SERVER = Path(os.environ.get("LLAMA_SERVER", Path(__file__).parents[1]
                                   / ".cache/llama-server/bin/llama-server"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def started(command: list[str], port: int):
    """Run a server command (its log in a temporary file: a pipe nobody reads would fill
    and stall it); yields its base URL once GET /v1/models answers."""
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                log.seek(0)
                raise AssertionError(log.read().decode(errors="replace")[-2000:])
            assert time.monotonic() < deadline, "the server did not start in 120 s"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=30)
        process.kill()
        log.close()


def audit(tmp_path, a: str, b: str, *extra: str) -> dict:
    status = main(["audit", "--endpoint", a, "--against", b, "--prompt", PROMPT,
                   "--tokens", "3", "--samples", str(SAMPLES), "--greedy-tokens", "24",
                   "--control-body", '{"temperature": 2.0}', "--output", str(tmp_path),
                   *extra])
    result = json.loads((tmp_path / "audit.json").read_text())
    assert status == (0 if result["verdict"] == "exact" else 1)
    assert result["samples_drawn"] == result["samples_asked"] == 3 * SAMPLES, result["failures"]
    assert not result["failures"] and len(result["greedy"]) == 1
    assert result["control"]["prompts"][0]["positions"][0]["rejected"], "control not caught"
    assert (tmp_path / "report.md").read_text().startswith("# exactspec audit (two-sample")
    return result


@pytest.mark.skipif(importlib.util.find_spec("sse_starlette") is None
                    or importlib.util.find_spec("llama_cpp") is None,
                    reason="llama-cpp-python's server is not installed "
                           "(pip install 'llama-cpp-python[server]')")
def test_llama_cpp_python_server_with_prompt_lookup_against_itself_without(tmp_path):
    ports = free_port(), free_port()
    server = [sys.executable, "-m", "llama_cpp.server", "--model", GGUF, "--n_threads", "1",
              "--model_alias", "smollm2"]
    with (started(server + ["--port", str(ports[0]), "--draft_model", "prompt-lookup-decoding",
                            "--draft_model_num_pred_tokens", "10"], ports[0]) as a,
          started(server + ["--port", str(ports[1])], ports[1]) as b):
        result = audit(tmp_path, a, b, "--extra-body", '{"repeat_penalty": 1.0}',
                       "--no-logprobs", "--backend", "llama_cpp")
    assert result["token_source"] == "text"  # no ids: the text re-tokenised


@pytest.mark.skipif(not LLAMA_SERVER.is_file(),
                    reason=f"llama-server is not built at {LLAMA_SERVER} "
                           "(scripts/build_llama_server.sh builds it)")
@pytest.mark.parametrize("speculation", [
    ["-md", GGUF, "--spec-type", "draft-simple", "--spec-draft-n-max", "4"],
    ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3",
     "--spec-ngram-simple-size-m", "8"]], ids=["draft-model", "ngram"])
def test_llama_server_with_speculation_against_itself_without(tmp_path, speculation):
    ports = free_port(), free_port()
    server = [str(LLAMA_SERVER), "-m", GGUF, "-t", "1", "-fa", "off", "--host", "127.0.0.1"]
    with (started(server + ["--port", str(ports[0]), *speculation], ports[0]) as a,
          started(server + ["--port", str(ports[1])], ports[1]) as b):
        result = audit(tmp_path, a, b, "--no-token-ids")
    assert result["token_source"] == "logprob_ids"  # llama-server's logprobs carry ids
    assert result["distribution"]["drafted"] > 0  # from its timings: it did speculate


def test_llama_draft_without_llama_server_says_how_to_build_it(monkeypatch, tmp_path):
    from exactspec.bench.methods import parse_method_spec
    from exactspec.peers import LlamaServerPeer
    from exactspec.models import load_model

    spec = parse_method_spec(f"llama-draft:{DEFAULT_MODEL}:k=3")
    assert (spec.peer, spec.kind, spec.model, spec.k) == ("llama", "draft", DEFAULT_MODEL, 3)
    monkeypatch.setenv("LLAMA_SERVER", str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="build_llama_server.sh"):
        LlamaServerPeer(load_model(DEFAULT_MODEL, backend="native"), GGUF, 3)


@pytest.mark.skipif(not LLAMA_SERVER.is_file(),
                    reason=f"llama-server is not built at {LLAMA_SERVER} "
                           "(scripts/build_llama_server.sh builds it)")
def test_llama_draft_peer_is_llama_servers_own_speculation(monkeypatch):
    """``bench --method llama-draft:MODEL:k=N``: llama-server with the draft file drafts
    (its timings count drafted and accepted tokens), decodes greedily the same twice, a
    seeded sample is reproducible, what it cannot compare is refused, and it stops."""
    from exactspec import ModelSpec, SamplingParams, SpeculationSpec
    from exactspec.bench.methods import parse_method

    monkeypatch.setenv("LLAMA_SERVER", str(LLAMA_SERVER))
    speculation = SpeculationSpec(ModelSpec(DEFAULT_MODEL, backend="native", threads=1),
                                  "plain").load()
    method = parse_method(f"llama-draft:{DEFAULT_MODEL}:k=4", speculation.target,
                          speculation.load_model)
    peer = method.engine
    assert peer.command[peer.command.index("-md") + 1] == GGUF
    prompts = [speculation.prompt_ids("Count: one, two, three,", True),
               speculation.prompt_ids("def add(a, b):", True)]
    greedy = SamplingParams(max_new_tokens=24)
    try:
        first = peer.generate(prompts, greedy)
        assert [g.token_ids for g in peer.generate(prompts, greedy)] == [
            g.token_ids for g in first]
        assert all(0 < len(g.token_ids) <= 24 for g in first)
        assert sum(g.stats["drafted_tokens"] for g in first) > 0
        assert all(0 < g.stats["prefill_seconds"] < g.stats["total_seconds"] for g in first)
        seeded = SamplingParams(temperature=0.8, seed=3, max_new_tokens=12)
        assert peer.sample(prompts[0], seeded, 3) == peer.sample(prompts[0], seeded, 3)
        with pytest.raises(ValueError, match="audited with temperature, seed"):
            peer.sample(prompts[0], SamplingParams(temperature=0.8, top_k=5), 2)
    finally:
        peer.close()
    assert peer._process.poll() is not None
