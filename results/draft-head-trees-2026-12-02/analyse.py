"""Per-method cycle costs of the token-tree benches, and what bounds them: the mean
acceptance length, the target's forward and the host work (drafting, verification) per
cycle, and the speedup a perfect drafter (every drafted position accepted) would give at
those measured costs. Usage: python analyse.py BENCH_FOLDER..."""

import json
import sys
from collections import defaultdict
from pathlib import Path

FIELDS = ("cycles", "num_generated_tokens", "total_seconds", "prefill_seconds",
          "target_forward_seconds", "draft_seconds", "drafted_tokens", "accepted_tokens",
          "tree_nodes")

for folder in sys.argv[1:]:
    results = json.loads((Path(folder) / "results.json").read_text())
    sums = defaultdict(lambda: defaultdict(float))
    for record in results["records"]:
        for field in FIELDS:
            sums[record["method"]][field] += record["stats"].get(field, 0)
    print(f"## {folder}\n")
    print("| method | tokens per cycle | depth drafted per cycle | nodes per cycle | "
          "forward ms per cycle | drafting ms per cycle | other host ms per cycle | "
          "decode tokens/s vs plain | perfect drafter at these costs |")
    print("|---|---|---|---|---|---|---|---|---|")
    plain = sums["plain"]
    plain_rate = plain["num_generated_tokens"] / (plain["total_seconds"] - plain["prefill_seconds"])
    for method, s in sums.items():
        cycles = s["cycles"]
        decode = s["total_seconds"] - s["prefill_seconds"]
        rate = s["num_generated_tokens"] / decode
        depth = s["drafted_tokens"] / cycles
        per_cycle = decode / cycles
        print(f"| {method} | {s['num_generated_tokens'] / cycles:.2f} | {depth:.2f} | "
              f"{s['tree_nodes'] / cycles:.2f} | {s['target_forward_seconds'] / cycles * 1e3:.1f} | "
              f"{s['draft_seconds'] / cycles * 1e3:.1f} | "
              f"{(decode - s['target_forward_seconds'] - s['draft_seconds']) / cycles * 1e3:.1f} | "
              f"{rate / plain_rate:.2f}x | {(depth + 1) / per_cycle / plain_rate:.2f}x |")
    print()
