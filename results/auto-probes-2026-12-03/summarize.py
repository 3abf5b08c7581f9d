"""Issue 40's targets over the three greedy runs (greedy-1, greedy-2, greedy-3):
each auto method's overall speedup per run and its spread around the mean; per group, auto
against the best constant k of the same proposer (same run), and groups where auto drafted
nothing in one run while its acceptance rate exceeded 0.3 in another.

    python results/auto-probes-2026-12-03/summarize.py [RUN ...]   (default: the three)
"""
import json
import pathlib
import statistics
import sys

HERE = pathlib.Path(__file__).parent
RUNS = sys.argv[1:] or ["greedy-1", "greedy-2", "greedy-3"]
AUTO = {"suffix:k=8:policy=auto": "suffix:k=4", "prompt-lookup:k=4:policy=auto": "prompt-lookup:k=4",
        "head:k=4:policy=auto": "head:k=4"}
summaries = [json.loads((HERE / run / "results.json").read_text())["summary"] for run in RUNS]
groups = [g for g in summaries[0] if g != "overall"]

print("## Overall speedup over plain decoding, per run\n")
print("| method | " + " | ".join(RUNS) + " | mean | largest deviation from the mean |")
print("|---|" + "---|" * (len(RUNS) + 2))
for method in [*AUTO, *AUTO.values()]:
    values = [s["overall"][method]["speedup"] for s in summaries]
    mean = statistics.mean(values)
    print(f"| {method} | " + " | ".join(f"{v:.3f}×" for v in values)
          + f" | {mean:.3f}× | {max(abs(v / mean - 1) for v in values):.1%} |")

print("\n## Per group: auto ÷ the constant k = 4 of the same proposer (same run)\n")
print("| group | " + " | ".join(f"{m.split(':')[0]} ({r})" for m in AUTO for r in RUNS) + " |")
print("|---|" + "---|" * (len(AUTO) * len(RUNS)))
lowest = {}
for group in groups:
    cells = []
    for auto, constant in AUTO.items():
        for run, s in zip(RUNS, summaries):
            ratio = s[group][auto]["speedup"] / s[group][constant]["speedup"]
            lowest[auto] = min(lowest.get(auto, 9), ratio)
            cells.append(f"{ratio:.3f}")
    print(f"| {group} | " + " | ".join(cells) + " |")
print("\nLowest per method: " + ", ".join(f"{m} {v:.3f}" for m, v in lowest.items()))

print("\n## Tokens drafted by auto per group (acceptance rate), per run\n")
print("| group | method | " + " | ".join(RUNS) + " | locked out in one run, > 0.3 in another |")
print("|---|---|" + "---|" * (len(RUNS) + 1))
for group in groups:
    for auto in AUTO:
        entries = [s[group][auto] for s in summaries]
        rates = [e["acceptance_rate"] for e in entries]
        lock = any(e["drafted_tokens"] == 0 for e in entries) and any((r or 0) > 0.3 for r in rates)
        print(f"| {group} | {auto} | " + " | ".join(
            f"{e['drafted_tokens']} ({e['acceptance_rate'] or 0:.2f})" for e in entries)
              + f" | {'**yes**' if lock else 'no'} |")
