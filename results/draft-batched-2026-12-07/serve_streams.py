"""`exactspec serve` under c concurrent code streams: total tokens/s with a draft model
against the same server without speculation (issue 65, item 5).

Starts one `exactspec serve` per configuration (each its own process and port, loaded once),
then sends waves of c HumanEval questions at once (chat, greedy, --max-tokens) to each
server in turn, interleaved (wave 1 to every server, then wave 2, ...), so that the servers
share the machine's drift and never run at the same time. A wave's total tokens/s = its
completion tokens / its wall time (prefill included: what the clients see). Every server's
greedy text must equal the plain server's, request for request.

    python serve_streams.py OUT.json [--streams 4] [--questions 12] [--max-tokens 192]
        [--config NAME=SERVE-ARGS ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import platform
import shlex
import socket
import subprocess
import sys
import time

import httpx

from exactspec.bench.questions import load_humaneval

MODEL = "qwen2.5-coder-1.5b-instruct"
DRAFT = "draft:qwen2.5-coder-0.5b-instruct"
DEFAULT_CONFIGS = [
    "plain=--proposer plain",
    f"draft-k2=--proposer {DRAFT} -k 2 --policy constant",
    f"draft-k3=--proposer {DRAFT} -k 3 --policy constant",
    f"draft-auto=--proposer {DRAFT} -k 4 --policy auto",
]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(name: str, args: str, streams: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [os.path.join(os.path.dirname(sys.executable), "exactspec"), "serve", "--model", MODEL,
               "--port", str(port), "--max-batch-size", str(streams), *shlex.split(args)]
    log = open(f"/tmp/serve-{name}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.HTTPError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"{name} did not start (see /tmp/serve-{name}.log)")
        time.sleep(1)


def ask(url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
    response.raise_for_status()
    data = response.json()
    return {"text": data["choices"][0]["message"]["content"],
            "tokens": data["usage"]["completion_tokens"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--questions", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=192)
    parser.add_argument("--config", action="append", default=None)
    args = parser.parse_args()
    configs = dict(item.split("=", 1) for item in (args.config or DEFAULT_CONFIGS))
    questions = load_humaneval(args.questions)
    servers = {}
    try:
        for name, serve_args in configs.items():
            servers[name] = start(name, serve_args, args.streams)
            ask(servers[name][1], "def add(a, b):", 8)  # warm-up
        waves = [questions[i:i + args.streams] for i in range(0, len(questions), args.streams)]
        records = []
        for number, wave in enumerate(waves):
            for name, (_, url) in servers.items():
                start_time = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(len(wave)) as pool:
                    answers = list(pool.map(lambda q: ask(url, q.prompt, args.max_tokens), wave))
                seconds = time.perf_counter() - start_time
                records.append({"config": name, "wave": number, "seconds": seconds,
                                "tokens": sum(a["tokens"] for a in answers),
                                "texts": [a["text"] for a in answers]})
                print(f"wave {number} {name}: {records[-1]['tokens'] / seconds:.1f} tok/s",
                      flush=True)
    finally:
        for process, _ in servers.values():
            process.terminate()
    summary = {}
    plain = [r for r in records if r["config"] == "plain"]
    for name in configs:
        mine = [r for r in records if r["config"] == name]
        rate = sum(r["tokens"] for r in mine) / sum(r["seconds"] for r in mine)
        summary[name] = {"tokens_per_second": rate,
                         "same_text_as_plain": sum(a == b for r, p in zip(mine, plain)
                                                   for a, b in zip(r["texts"], p["texts"])),
                         "requests": sum(len(r["texts"]) for r in mine)}
    base = summary["plain"]["tokens_per_second"]
    for name, entry in summary.items():
        entry["vs_plain"] = entry["tokens_per_second"] / base
        print(f"{name}: {entry['tokens_per_second']:.1f} tok/s, {entry['vs_plain']:.2f}× plain, "
              f"{entry['same_text_as_plain']}/{entry['requests']} texts as plain")
    machine = {"cpu": platform.processor() or open("/proc/cpuinfo").read().split("model name")[1]
               .split("\n")[0].strip(": "), "cores": os.cpu_count()}
    json.dump({"configs": configs, "streams": args.streams, "max_tokens": args.max_tokens,
               "questions": args.questions, "machine": machine, "summary": summary,
               "records": records}, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
