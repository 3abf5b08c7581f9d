"""llama.cpp's own speculative decoding (``llama-server --spec-type draft-simple -md``, the same 0.5B draft file) against
its plain decoding and exactspec's native plain and draft decoding, on HumanEval's first N
problems asked as ``exactspec bench --questions humaneval`` asks them (the target's chat
template, rendered by exactspec's tokenizer and sent as token ids), greedy, 256 new tokens.

Per llama.cpp configuration one server is started (2 threads, nothing else running), every
problem sent once after one warm-up request, then the server is stopped; decoding tokens/s
is llama-server's own ``timings.predicted_per_second`` (prefill excluded), acceptance its
``draft_n_accepted / draft_n``. exactspec's methods run in this process between the servers
(the server stopped), prefill excluded as well. Each llama.cpp greedy output is compared
with llama.cpp's plain output, token for token.

Usage: python llama_spec.py N LLAMA_SERVER [CONFIG...]   CONFIG: plain, default, or
       NMAX,PMIN (e.g. 4,0.75); prints one JSON line per configuration."""
import json, subprocess, sys, time, urllib.request

from exactspec import SamplingParams
from exactspec.bench import load_humaneval
from exactspec.models import ModelSpec, check_model_path
from measure import build

count, server, configs = int(sys.argv[1]), sys.argv[2], sys.argv[3:] or ["plain", "default"]
TOKENS, PORT = 256, 8391
spec = ModelSpec("qwen2.5-coder-1.5b-instruct")
target_path = check_model_path("qwen2.5-coder-1.5b-instruct")
draft_path = check_model_path("qwen2.5-coder-0.5b-instruct")
target = spec.load()
prompts = [target.tokenizer.apply_chat_template(q.prompt) for q in load_humaneval(count)]


def post(body):
    request = urllib.request.Request(f"http://127.0.0.1:{PORT}/completion",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.load(response)


def run_server(config):
    command = [server, "-m", str(target_path), "-t", "2", "-tb", "2", "-c", "4096", "-np", "1",
               "--port", str(PORT), "--host", "127.0.0.1"]
    if config != "plain":
        command += ["--spec-type", "draft-simple", "-md", str(draft_path), "-td", "2", "-tbd", "2"]
        if config != "default":
            n_max, p_min = config.split(",")
            command += ["--spec-draft-n-max", n_max, "--spec-draft-n-min", "0",
                        "--spec-draft-p-min", p_min]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(240):
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{PORT}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.5)
        body = lambda ids: {"prompt": ids, "n_predict": TOKENS, "temperature": 0.0, "top_k": 1,
                            "cache_prompt": False, "return_tokens": True, "seed": 0}
        post(body(prompts[0]))  # warm-up
        rows = [post(body(ids)) for ids in prompts]
    finally:
        process.terminate()
        process.wait()
    timings = [r["timings"] for r in rows]
    seconds = sum(t["predicted_ms"] for t in timings) / 1000
    tokens = sum(t["predicted_n"] for t in timings)
    drafted = sum(t.get("draft_n", 0) for t in timings)
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    return {"method": f"llama-server {config}", "decode_tok_s": round(tokens / seconds, 2),
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "tokens": [r["tokens"] for r in rows]}


def run_exactspec(method):
    generator = build(spec, target, [method])[method]
    params = SamplingParams(max_new_tokens=TOKENS)
    generator.generate(prompts[0], params)  # warm-up
    results = [generator.generate(ids, params) for ids in prompts]
    seconds = sum(r.stats.total_seconds - r.stats.prefill_seconds for r in results)
    tokens = sum(r.stats.num_generated_tokens for r in results)
    drafted = sum(r.stats.drafted_tokens for r in results)
    return {"method": f"exactspec {method}", "decode_tok_s": round(tokens / seconds, 2),
            "acceptance_rate": round(sum(r.stats.accepted_tokens for r in results) / drafted, 4)
            if drafted else None, "tokens": [r.token_ids for r in results]}


rows = [run_exactspec("plain")]
for config in configs:
    rows.append(run_server(config))
    if config == "plain":
        rows.append(run_exactspec("draft:qwen2.5-coder-0.5b-instruct,5,constant"))
tokens = {r["method"]: r.pop("tokens") for r in rows}
for row in rows:
    reference = tokens["llama-server plain" if row["method"].startswith("llama")
                       else "exactspec plain"]
    row["identical_to_own_plain"] = sum(a == b for a, b in zip(tokens[row["method"]], reference))
for row in rows:
    row["vs_exactspec_plain"] = round(row["decode_tok_s"] / rows[0]["decode_tok_s"], 3)
    print(json.dumps(row), flush=True)
