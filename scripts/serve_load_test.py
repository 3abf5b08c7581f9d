"""A bounded load test of ``exactspec serve`` on loopback: N concurrent streaming chat clients
for a fixed time, every streamed text checked against the same prompt's non-streamed greedy
output (nothing lost, duplicated or interleaved), TTFT percentiles, throughput and the
server's resident memory reported. Stops by itself.

By default it starts its own server (``exactspec serve`` on a free 127.0.0.1 port, with
``--server-args`` passed through) and stops it at the end; ``--url`` tests a running server
instead (loopback addresses only). Prompts: Spec-Bench questions (``--questions``), ``--prompt``
ones, else a few built-in ones.

    python scripts/serve_load_test.py --questions ../shared/data/spec_bench/question.jsonl \\
        --clients 16 --seconds 120 --output results/serve-load-YYYY-MM-DD

Exit status 0 only with no errors, no mismatches and memory growth under --max-rss-growth.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import httpx
import openai
import psutil

BUILT_IN_PROMPTS = [
    "Translate to French: The weather is nice today and I would like to go for a walk.",
    "Summarize in one sentence: The council voted to build bike lanes on Main Street next spring.",
    "Write a Python function that checks whether a number is prime.",
    "What is the capital of Japan? Answer briefly.",
    "List the first ten even numbers, separated by commas.",
    "Explain what a hash table is in two sentences.",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="a running server's base URL on loopback (default: "
                                      "start one)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, to "
                                                "measure its memory")
    parser.add_argument("--api-key", default="none", help="with --url: the server's API key")
    parser.add_argument("--server-args", default="",
                        help="extra arguments for the started 'exactspec serve', e.g. "
                             "'--backend transformers'")
    parser.add_argument("--model", default=None, help="model name in the API (default: the "
                                                      "server's only model)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients (16)")
    parser.add_argument("--seconds", type=float, default=120, help="test duration (120)")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per answer (64)")
    parser.add_argument("--prompt", action="append", default=[],
                        help="a prompt (repeatable; instead of --questions)")
    parser.add_argument("--questions", help="Spec-Bench question.jsonl to take prompts from")
    parser.add_argument("--num-prompts", type=int, default=12,
                        help="prompts used, taken across Spec-Bench's groups (12)")
    parser.add_argument("--max-rss-growth", type=float, default=0.10,
                        help="fail if the server's memory grows more than this fraction "
                             "from the end of the first minute (or half the run, if shorter) to the end")
    parser.add_argument("--long-prompt-tokens", type=int, default=0, metavar="N",
                        help="also send a prompt of about N tokens: first alone, with a short "
                             "request 1 s after it (its time to first token: head-of-line "
                             "blocking), then one every --long-prompt-every seconds during the "
                             "load; their TTFTs are reported apart (default 0: none)")
    parser.add_argument("--long-prompt-every", type=float, default=30, metavar="SECONDS",
                        help="interval between long prompts during the load (30)")
    parser.add_argument("--output", help="folder for report.json")
    return parser.parse_args(argv)


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = False
    if not loopback:
        raise SystemExit(f"--url {url} is not a loopback address: this test only runs on "
                         "this machine")


def long_prompt(num_tokens: int) -> str:
    """A prompt of about ``num_tokens`` tokens (numbered lines of a few words each)."""
    lines = [f"Line {i}: the {['red', 'green', 'blue', 'grey'][i % 4]} item number {i} is "
             f"on shelf {i % 17}." for i in range(num_tokens // 21)]
    return "Here is an inventory.\n" + "\n".join(lines) + "\nWhich shelf holds item 3?"


def load_prompts(args: argparse.Namespace) -> list[str]:
    if not args.questions:
        return (args.prompt or BUILT_IN_PROMPTS)[: args.num_prompts]
    from exactspec.bench.questions import GROUPS, load_questions

    per_group = -(-args.num_prompts // len(GROUPS))
    return [q.prompt for q in load_questions(args.questions, per_group=per_group)][
        : args.num_prompts]


@contextlib.contextmanager
def started_server(args: argparse.Namespace):
    """``exactspec serve`` on a free loopback port; yields (url, pid)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [sys.executable, "-c", "import sys; from exactspec.cli import main; "
               "sys.exit(main())", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "warning", *args.server_args.split()]
    server = subprocess.Popen(command)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(f"the server exited with status {server.returncode}")
            if time.monotonic() > deadline:
                raise SystemExit("the server did not come up within 300 s")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health").status_code == 200:
                    break
            time.sleep(0.5)
        yield url, server.pid
    finally:
        server.terminate()
        server.wait(timeout=60)


def rss_bytes(pid: int | None) -> int | None:
    if pid is None:
        return None
    process = psutil.Process(pid)
    return process.memory_info().rss + sum(child.memory_info().rss
                                           for child in process.children(recursive=True))


async def run(args: argparse.Namespace, url: str, pid: int | None) -> dict:
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=args.api_key, max_retries=0,
                                timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    prompts = load_prompts(args)

    def request(prompt: str) -> dict:
        return dict(model=model, messages=[{"role": "user", "content": prompt}],
                    max_tokens=args.max_tokens, temperature=0)

    async def streamed(prompt: str, sent: float) -> tuple[str, float | None, int, int]:
        """(text, time of its first text, completion tokens, prompt tokens)."""
        first, text, tokens, prompt_tokens = None, "", 0, 0
        stream = await client.chat.completions.create(**request(prompt), stream=True,
                                                      stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                tokens, prompt_tokens = chunk.usage.completion_tokens, chunk.usage.prompt_tokens
            for choice in chunk.choices:
                if choice.delta.content:
                    first = first or time.monotonic()
                    text += choice.delta.content
        return text, first, tokens, prompt_tokens

    print(f"references: {len(prompts)} prompts, non-streamed …", flush=True)
    references = [(await client.chat.completions.create(**request(p))).choices[0].message.content
                  for p in prompts]
    head_of_line = None
    if args.long_prompt_tokens:
        print(f"head-of-line probe: a {args.long_prompt_tokens}-token prompt, a short one 1 s "
              "later …", flush=True)
        sent = time.monotonic()
        long_task = asyncio.create_task(streamed(long_prompt(args.long_prompt_tokens), sent))
        await asyncio.sleep(1)
        short_sent = time.monotonic()
        _, short_first, _, _ = await streamed(prompts[0], short_sent)
        _, long_first, _, long_tokens = await long_task
        head_of_line = {"long_prompt_tokens": long_tokens,
                        "long_ttft_seconds": (long_first or time.monotonic()) - sent,
                        "short_ttft_seconds": (short_first or time.monotonic()) - short_sent}
        print(json.dumps(head_of_line), flush=True)
    records: list[dict] = []
    long_records: list[dict] = []
    errors: list[str] = []
    start = time.monotonic()
    end = start + args.seconds
    rss: list[tuple[float, int]] = []

    async def long_prompts() -> None:
        while args.long_prompt_tokens and time.monotonic() + args.long_prompt_every < end:
            await asyncio.sleep(args.long_prompt_every)
            sent = time.monotonic()
            try:
                _, first, _, _ = await streamed(long_prompt(args.long_prompt_tokens), sent)
            except openai.APIError as error:
                errors.append(f"long prompt: {error}")
                continue
            long_records.append({"ttft": (first or time.monotonic()) - sent,
                                 "seconds": time.monotonic() - sent})

    async def one_client(number: int) -> None:
        turn = number
        while time.monotonic() < end:
            index = turn % len(prompts)
            turn += args.clients
            sent = time.monotonic()
            try:
                text, first, tokens, _ = await streamed(prompts[index], sent)
            except openai.APIError as error:
                errors.append(f"client {number}: {error}")
                continue
            records.append({"prompt": index, "ttft": (first or time.monotonic()) - sent,
                            "seconds": time.monotonic() - sent, "tokens": tokens,
                            "finished": time.monotonic() - start,
                            "match": text == references[index]})

    async def watch_memory() -> None:
        while time.monotonic() < end:
            rss.append((time.monotonic() - start, rss_bytes(pid) or 0))
            await asyncio.sleep(1)

    print(f"load: {args.clients} streaming clients for {args.seconds:.0f} s …", flush=True)
    await asyncio.gather(watch_memory(), long_prompts(),
                         *(one_client(i) for i in range(args.clients)))
    duration = time.monotonic() - start
    ttfts = sorted(r["ttft"] for r in records)
    checkpoint = min(60.0, args.seconds / 2)
    first_rss = next((v for t, v in rss if t >= checkpoint), None) if pid else None
    last_rss = rss[-1][1] if pid and rss else None
    quantile = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] if ttfts else None
    return {
        "url": url, "model": model, "clients": args.clients, "seconds": duration,
        "max_tokens": args.max_tokens, "prompts": len(prompts), "requests": len(records),
        "errors": len(errors), "error_messages": errors[:10],
        "mismatches": sum(not r["match"] for r in records),
        "ttft_p50_seconds": quantile(0.5), "ttft_p95_seconds": quantile(0.95),
        "mean_request_seconds": statistics.fmean(r["seconds"] for r in records) if records else None,
        "completion_tokens": sum(r["tokens"] for r in records),
        "throughput_tokens_per_second": sum(r["tokens"] for r in records) / duration,
        "rss_after_first_minute_bytes": first_rss, "rss_at_end_bytes": last_rss,
        "rss_growth": (last_rss - first_rss) / first_rss if first_rss else None,
        "rss_checkpoint_seconds": checkpoint,
        "head_of_line_probe": head_of_line,
        "long_prompts": len(long_records),
        "long_prompt_ttft_seconds": [round(r["ttft"], 2) for r in long_records],
        "request_records": [{key: round(value, 3) if isinstance(value, float) else value
                             for key, value in r.items()} for r in records],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.url:
        check_loopback(args.url)
        server = contextlib.nullcontext((args.url.rstrip("/"), args.pid))
    else:
        server = started_server(args)
    with server as (url, pid):
        report = asyncio.run(run(args, url, pid))
    print(json.dumps(report, indent=2))
    if args.output:
        Path(args.output).mkdir(parents=True, exist_ok=True)
        (Path(args.output) / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    growth = report["rss_growth"]
    ok = (report["errors"] == 0 and report["mismatches"] == 0 and report["requests"] > 0
          and (growth is None or growth < args.max_rss_growth))
    print("PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
