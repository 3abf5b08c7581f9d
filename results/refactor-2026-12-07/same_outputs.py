"""Issue 66's check that the set-up refactor changed no output: every command run the same
way on two trees, their JSON compared with the timings left out.

Usage (from the repository root, with the project's .venv):

    python results/refactor-2026-12-07/same_outputs.py run TREE OUT_DIR   # writes OUT_DIR/outputs.json
    python results/refactor-2026-12-07/same_outputs.py compare BEFORE.json AFTER.json

Each tree's CLI is run with ``PYTHONPATH=TREE/src`` (:data:`LAUNCH`) (the installed
dependencies, the tree's code). ``compare`` prints one line per command: the hash of its normalised
output on each tree and whether they are the same, and exits 1 if any differ. Normalised:
every key naming a time, a speed or a run's identity (see ``VOLATILE``) removed, at any depth.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPT = "Write a Python function that returns the n-th Fibonacci number."
CODE = "def add(a, b):\n    return a + b\n\n# the same function, with type hints\n"
GENERATE = {  # name → generate's arguments (every output in --json)
    "greedy prompt-lookup": [CODE, "--max-new-tokens", "48"],
    "greedy suffix k=6 auto": [CODE, "--suffix", "-k", "6", "--policy", "auto",
                               "--max-new-tokens", "48"],
    "seeded suffix n=2": [PROMPT, "--proposer", "suffix", "--temperature", "0.8", "--top-p",
                          "0.95", "--seed", "7", "-n", "2", "--max-new-tokens", "40"],
    "greedy draft model": [PROMPT, "--draft-model", "smollm2-135m-instruct",
                           "--max-new-tokens", "40"],
    "seeded draft model q8_0": [PROMPT, "--proposer", "draft:smollm2-135m-instruct:weights=q8_0",
                                 "--temperature", "0.7", "--seed", "3", "--max-new-tokens", "32"],
    "greedy head tree": [PROMPT, "--proposer", "head:tree=8", "--max-new-tokens", "40"],
    "seeded suffix+head": [PROMPT, "--proposer", "suffix+head", "--temperature", "0.7",
                           "--seed", "5", "--max-new-tokens", "32"],
    "json object forced": ["Give a JSON object with a name and an age.", "--json-object",
                           "--proposer", "forced", "--max-new-tokens", "40"],
    "plain -k 0 logprobs": [PROMPT, "-k", "0", "--logprobs", "2", "--max-new-tokens", "16"],
}
LAUNCH = "import sys; from exactspec.cli import main; sys.exit(main(sys.argv[1:]))"
"""The CLI of the tree on PYTHONPATH (the installed ``exactspec`` script would run main's)."""
VOLATILE = re.compile(r"seconds|per_second|tokens_per_s|_ms$|^ms|time|ttft|tpot|itl|latency|"
                      r"speedup|created|^id$|ran_on|wall|throughput|^cv$|stable|unstable|"
                      r"cost|rate_per|^files?$|output|draft_tokens_per_target|ratio|share|spread|per_cycle")


def normalised(value):
    """``value`` without :data:`VOLATILE` keys (nor, under ``auto``, whose k follows the
    timings, the drafting figures: only the tokens must be the same)."""
    if isinstance(value, dict):
        if isinstance(value.get("stats"), dict) and value["stats"].get("policy") == "auto":
            value = {k: v for k, v in value.items() if k != "stats"}
        return {k: normalised(v) for k, v in value.items() if not VOLATILE.search(k)}
    if isinstance(value, list):
        return [normalised(v) for v in value]
    return value


def digest(value) -> str:
    return hashlib.md5(json.dumps(normalised(value), sort_keys=True).encode()).hexdigest()[:8]


def cli(tree: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    return subprocess.run([sys.executable, "-c", LAUNCH, *args], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=900)


def run_tree(tree: Path, out: Path) -> dict[str, object]:
    out.mkdir(parents=True, exist_ok=True)
    outputs: dict[str, object] = {}
    for name, args in GENERATE.items():
        policy = [] if "auto" in name else ["--policy", "constant"]  # auto's k follows timings
        done = cli(tree, "generate", *args, *policy, "--json", cwd=out)
        outputs[f"generate: {name}"] = (json.loads(done.stdout) if done.returncode == 0
                                        else {"exit": done.returncode, "err": done.stderr[-300:]})
    questions = Path(__file__).resolve().parents[3] / "shared/data/spec_bench/question.jsonl"
    done = cli(tree, "bench", "--questions", str(questions), "--per-category", "1",
               "--method", "plain", "--method", "prompt-lookup", "--method", "suffix:k=6",
               "--method", "draft:smollm2-135m-instruct", "--max-new-tokens", "24",
               "--output", str(out / "bench"), cwd=out)
    outputs["bench"] = (json.loads((out / "bench/results.json").read_text())
                        if done.returncode in (0, 3) else {"exit": done.returncode,
                                                           "err": done.stderr[-300:]})
    for name, args in {"audit quick suffix": ["--proposer", "suffix"],
                       "audit quick prompt-lookup batched": ["--proposer", "prompt-lookup",
                                                             "--max-batch-size", "3"],
                       "audit quick draft model": ["--proposer", "draft:smollm2-135m-instruct"],
                       "audit quick head no-residual": ["--proposer", "head", "--broken",
                                                        "no-residual"]}.items():
        done = cli(tree, "audit", "--quick", *args, "--output", str(out / name), cwd=out)
        outputs[name] = (json.loads((out / name / "audit.json").read_text())
                         if done.returncode in (0, 1) and (out / name / "audit.json").exists()
                         else {"exit": done.returncode, "err": done.stderr[-300:]})
    outputs |= serve(tree, out)
    (out / "outputs.json").write_text(json.dumps(outputs, indent=1, sort_keys=True))
    return outputs


def serve(tree: Path, out: Path) -> dict[str, object]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    server = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--proposer",
                               "suffix", "--policy", "constant", "--port", str(port)], env=env, cwd=out,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(240):
            try:
                httpx.get(f"{base}/models", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        bodies = {
            "serve completions greedy": ("completions", {"prompt": CODE, "max_tokens": 32,
                                                         "temperature": 0,
                                                         "return_token_ids": True}),
            "serve chat seeded n=2": ("chat/completions", {
                "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 32,
                "temperature": 0.8, "seed": 9, "n": 2, "return_token_ids": True}),
            "serve completions logprobs": ("completions", {"prompt": PROMPT, "max_tokens": 8,
                                                           "temperature": 0, "logprobs": 2}),
            "serve bad field": ("completions", {"prompt": PROMPT, "max_tokens": -1}),
            "serve speculation off": ("completions", {"prompt": CODE, "max_tokens": 24,
                                                      "temperature": 0,
                                                      "speculation": {"enabled": False}}),
        }
        answers = {}
        for name, (path, body) in bodies.items():
            reply = httpx.post(f"{base}/{path}", json={"model": "smollm2-135m-instruct", **body},
                               timeout=120)
            answers[name] = {"status": reply.status_code, "body": reply.json()}
        stream = httpx.post(f"{base}/completions", json={
            "model": "smollm2-135m-instruct", "prompt": CODE, "max_tokens": 16,
            "temperature": 0, "stream": True}, timeout=120)
        answers["serve stream"] = [json.loads(line[6:]) for line in stream.text.splitlines()
                                   if line.startswith("data: {")]
        return answers
    finally:
        server.terminate()
        server.wait(timeout=30)


def main() -> int:
    if sys.argv[1] == "run":
        run_tree(Path(sys.argv[2]).resolve(), Path(sys.argv[3]).resolve())
        return 0
    before, after = (json.loads(Path(a).read_text()) for a in sys.argv[2:4])
    differ = 0
    for name in before:
        same = digest(before[name]) == digest(after.get(name))
        differ += not same
        print(f"{name:40s} {digest(before[name])} {digest(after.get(name))} "
              f"{'same' if same else 'DIFFERENT'}")
    print(f"{len(before) - differ} of {len(before)} outputs the same")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
