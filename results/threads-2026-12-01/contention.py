"""Decoding tokens/s on an idle machine and with one other busy process at normal priority
(`python -c "while True: pass"`), per backend and thread setting, plain and speculative
(suffix drafting, k ≤ 8, auto); then two exactspec processes side by side.

    python results/threads-2026-12-01/contention.py            # the whole table
    python results/threads-2026-12-01/contention.py one BACKEND THREADS METHOD  # one cell

Each cell is a fresh process: the embedded model, 3 chat prompts × 64 greedy tokens after a
warm-up, decoding tokens/s (prefill excluded), median over prompts. THREADS: "auto" is the
default (transformers: one thread or two per forward, whichever is measured faster;
llama.cpp: half the cores), "1" / "2" fixed (transformers: the chooser given one count).
"""
import statistics
import subprocess
import sys
import time

PROMPTS = ["Tell me a story about a dragon.", "Explain how a bicycle works.",
           "Write a letter to a friend about your holiday."]


def one(backend: str, threads: str, method: str) -> float:
    from exactspec import SamplingParams, SpeculativeGenerator, load_model
    from exactspec.proposers.build import build_proposer
    from exactspec.proposers.spec import parse_proposer
    from exactspec.threads import ThreadChooser

    fixed = None if threads == "auto" else int(threads)
    target = load_model(backend=backend, threads=fixed if backend == "llama_cpp" else None)
    if backend == "transformers" and fixed is not None:
        target.threads = ThreadChooser(2)
        target.threads.choose = lambda num_tokens: fixed
    proposer = build_proposer(parse_proposer(method), target, None)
    generator = SpeculativeGenerator(target, proposer, 8, "auto")
    params = SamplingParams(max_new_tokens=64, ignore_eos=True)
    generator.generate(PROMPTS[0], params, chat=True)
    rates = []
    for prompt in PROMPTS:
        stats = generator.generate(prompt, params, chat=True).stats
        rates.append(stats.num_generated_tokens / (stats.total_seconds - stats.prefill_seconds))
    return statistics.median(rates)


def cell(*args: str) -> float:
    out = subprocess.run([sys.executable, __file__, "one", *args], capture_output=True,
                         text=True, check=True).stdout
    return float(out.strip().splitlines()[-1])


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "one":
    print(one(*sys.argv[2:5]))
    sys.exit()

configs = [("transformers", t, m) for t in ("auto", "1", "2") for m in ("plain", "suffix")] + \
          [("llama_cpp", t, m) for t in ("auto", "2") for m in ("plain", "suffix")]
table = {}
for load in ("idle", "busy"):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if load == "busy" else None
    time.sleep(1)
    try:
        for config in configs:
            table[(load,) + config] = cell(*config)
            print(load, config, f"{table[(load,) + config]:.1f}", flush=True)
    finally:
        if busy:
            busy.kill()
print("\n| backend | threads | method | idle tokens/s | one busy process | busy / idle |")
print("|---|---|---|---|---|---|")
for config in configs:
    idle, busy = table[("idle",) + config], table[("busy",) + config]
    print(f"| {config[0]} | {config[1]} | {config[2]} | {idle:.1f} | {busy:.1f} | {busy / idle:.2f} |")

print("\nTwo exactspec processes side by side (the default threads), tokens/s each:")
for backend in ("transformers", "llama_cpp"):
    pair = [subprocess.Popen([sys.executable, __file__, "one", backend, "auto", "plain"],
                             stdout=subprocess.PIPE, text=True) for _ in range(2)]
    rates = [float(p.communicate()[0].strip().splitlines()[-1]) for p in pair]
    idle = table[("idle", backend, "auto", "plain")]
    print(f"{backend}: {rates[0]:.1f} and {rates[1]:.1f} (idle alone {idle:.1f}: "
          f"{min(rates) / idle:.2f}× of it)")
