"""Figures of the draft head's benches that report.md does not print: the head's drafting
cost per drafted token against a plain step, and what bounds the speedup at the measured
costs (a perfect drafter; the head's own per-position acceptance). Usage:
python analyse.py BENCH_FOLDER..."""

import json
import sys
from collections import defaultdict
from pathlib import Path

for folder in sys.argv[1:]:
    results = json.loads((Path(folder) / "results.json").read_text())
    forward = {int(n): s for n, s in results["forward_seconds"].items() if s}
    plain_step = forward[1]
    by_method = defaultdict(lambda: defaultdict(float))
    per_position = defaultdict(lambda: [[0, 0] for _ in range(8)])
    for record in results["records"]:
        stats, m = record["stats"], by_method[record["method"]]
        for key in ("draft_seconds", "drafted_tokens", "accepted_tokens", "cycles",
                    "num_generated_tokens"):
            m[key] += stats[key]
        for i, (d, a) in enumerate(zip(stats["drafted_per_position"],
                                       stats["accepted_per_position"])):
            per_position[record["method"]][i][0] += d
            per_position[record["method"]][i][1] += a
    print(f"## {folder}\n\nplain step (1-token target forward): {plain_step * 1e3:.1f} ms; "
          "forward over n tokens: " + ", ".join(f"{n}: {s * 1e3:.1f}" for n, s in sorted(forward.items())))
    for method, m in by_method.items():
        if not m["drafted_tokens"]:
            continue
        per_token = m["draft_seconds"] / m["drafted_tokens"]
        conditional = [a / d for d, a in per_position[method] if d]
        print(f"\n{method}: drafting {per_token * 1e3:.2f} ms per drafted token = "
              f"{per_token / plain_step:.1%} of a plain step; mean acceptance length "
              f"{m['num_generated_tokens'] / m['cycles']:.2f} (tokens per cycle); "
              f"per-position acceptance " + ", ".join(f"{c:.2f}" for c in conditional))
        for k in range(1, min(len(conditional), max(forward) - 1) + 1):
            cost = forward[k + 1] + k * per_token
            survive, expected = 1.0, 1.0
            for c in conditional[:k]:
                survive *= c
                expected += survive
            print(f"  k = {k} every cycle: perfect drafter {(k + 1) * plain_step / cost:.2f}x, "
                  f"this acceptance {expected * plain_step / cost:.2f}x "
                  f"(E = {expected:.2f} tokens per cycle)")
