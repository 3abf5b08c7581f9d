"""Turns benchmark records into figures, ``report.md``, ``results.json`` and PNG plots.

Speedup (Spec-Bench's measure): for each repetition, a method's tokens/s over a group's
questions (total tokens / total seconds) divided by plain decoding's; reported as the
ratio of the medians over repetitions, with the min–max of the per-repetition ratios.

Two model speedups sit beside each measurement, from the measured target forward cost
c(n) of scoring n tokens (plain decoding costs c(1) a token):
    speedup_leviathan  Leviathan et al. 2022 (§3.1, eq. 1): with acceptance rate α and k
                       drafts every cycle, (1 − α^(k+1)) / (1 − α) × c(1) / (c(k+1) + d),
                       d = measured draft seconds per cycle. It assumes a full k-token
                       draft each cycle, which prompt lookup does not make (no match → an
                       empty draft costs c(1)).
    speedup_bound      the same cost model over the drafts actually made: measured mean
                       acceptance length × c(1) / mean over cycles of (c(drafted + 1) + d):
                       what a perfect implementation of the same drafting reaches; the gap
                       to the measured speedup is the implementation's overhead.

Unstable measurements (:func:`instabilities`): another process using the CPU distorts
timings unevenly, so three signs of it are reported at the top of ``report.md``: a forward
over more tokens measured much cheaper than over fewer (the cost model must rise with n),
repetitions of one method disagreeing, and one method's tokens/s far from the others' in a
group. The tolerances below sit well outside what the quiet runs in ``results/`` show
(``results/README.md``).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from exactspec.bench.methods import is_peer
from exactspec.bench.questions import GROUPS
from exactspec.bench.runner import BenchResults
from exactspec.files import readable_json, replaced_atomically, write_text_atomically
from exactspec.generation_stats import GenerationStats

OVERALL = "overall"
UNSTABLE_HEADLINE = ("Unstable measurements: something else was probably using the CPU; "
                     "re-run with nothing else running before trusting these figures.")
COST_TOLERANCE = 1.5
"""Most a forward over more tokens may be measured cheaper than one over fewer (×)."""
REPETITION_TOLERANCE = 1.5
"""Most one method's tokens/s in one group may differ between repetitions (max/min, ×)."""
OUTLIER_TOLERANCE = 4.0
"""Most a method's tokens/s in a group may differ from the other methods' median (×)."""
HOST_TOLERANCE = 4.0
"""Plain decoding's host overhead per cycle above this many times the idle calibration
(:func:`~exactspec.bench.runner.measure_host_seconds`) flags the run: host-side work on a
busy core."""
LOCKOUT_ACCEPTANCE = 0.3
"""A policy that drafted nothing in a group where a constant k of its proposer was accepted
above this rate is flagged in the verdict (:func:`never_drafted`)."""
SLOW_GENERATION_TOLERANCE = 2.0
"""A generation whose seconds per token are at least this many times both plain decoding's
on the same question and the median of the other methods' on it is flagged
(:func:`slow_generations`): one such generation can halve a group's speedup."""
SLOW_GENERATION_SECONDS = 1.0
"""...and only where it took at least this many seconds longer than at the slower of those two
rates: a few milliseconds of scheduling noise on a short generation are not what moves a
group's speedup."""
HOST_SLACK_SECONDS = 0.0005
"""Per-cycle bookkeeping the calibration does not time (stop checks, stats), allowed on top."""


def summarize(results: BenchResults) -> dict:
    """Per group (and overall) and per method: tokens/s, speedup (+ min–max), acceptance
    figures, draft/verify share, the bound, and identity failures."""
    methods = list(dict.fromkeys(r.method for r in results.records))
    groups = [g for g in GROUPS if any(r.group == g for r in results.records)] + [OVERALL]
    plain = next(r.method for r in results.records if r.method == "plain")
    summary: dict = {}
    for group in groups:
        rows = [r for r in results.records if group == OVERALL or r.group == group]
        reps = sorted({r.repetition for r in rows})
        tps = {m: [_tokens_per_second([r for r in rows if r.method == m and r.repetition == rep])
                   for rep in reps] for m in methods}
        summary[group] = {}
        for method in methods:
            mine = [r for r in rows if r.method == method]
            ratios = [a / b for a, b in zip(tps[method], tps[plain]) if b]
            entry = {
                "tokens_per_second": statistics.median(tps[method]),
                "tokens_per_second_per_repetition": tps[method],
                "speedup": statistics.median(tps[method]) / statistics.median(tps[plain]),
                "speedup_min": min(ratios), "speedup_max": max(ratios),
                "repetition_spread": _spread(tps[method]),
                "runs": len(mine),
                "mismatches": sum(r.matches_plain is False for r in mine),
            }
            entry |= _acceptance([r.stats for r in mine if r.stats], results.forward_seconds)
            entry |= _overhead([r.stats for r in mine if r.stats])
            summary[group][method] = entry
        plain_decoding = _decoding_rate([r for r in rows if r.method == plain])
        for method, entry in summary[group].items():
            rate = _decoding_rate([r for r in rows if r.method == method])
            if rate and plain_decoding:
                entry["decode_speedup"] = rate / plain_decoding
    return summary


def _spread(values: Sequence[float]) -> float:
    """(max − min) / median of the per-repetition figures: 0 with one repetition."""
    values = [v for v in values if v > 0]
    return (max(values) - min(values)) / statistics.median(values) if len(values) > 1 else 0.0


def never_drafted(summary: dict) -> list[str]:
    """Groups where a method whose policy chooses k (not ``constant``) drafted nothing while
    a constant-k method of the same proposer had an acceptance rate above
    :data:`LOCKOUT_ACCEPTANCE` there: the policy locked itself out of drafting where
    drafting was accepted (issue 40). One line each."""
    found = []
    for group, row in summary.items():
        if group == OVERALL or not isinstance(row, dict):
            continue
        for method, entry in row.items():
            if entry.get("policy") in (None, "constant") or entry.get("drafted_tokens"):
                continue
            proposer = method.split(":", 1)[0]
            for other, e in row.items():
                if (other.split(":", 1)[0] == proposer and e.get("policy") == "constant"
                        and e.get("acceptance_rate", 0) > LOCKOUT_ACCEPTANCE):
                    found.append(f"{method} drafted nothing on {group}, where {other} had an "
                                 f"acceptance rate of {e['acceptance_rate']:.2f}")
                    break
    return found


def slow_generations(results: BenchResults) -> list[dict]:
    """The generations at least :data:`SLOW_GENERATION_TOLERANCE` × slower a token than
    both plain decoding of the same question (the median over its repetitions) and the
    median of the other methods' generations of it, and at least
    :data:`SLOW_GENERATION_SECONDS` longer in all: each its question, group, method,
    repetition and the three seconds-per-token figures. A method's own other repetitions
    do not count as "others", so a method that is slow on a question every time is flagged
    too (that is a result to look at, not noise to average away). A method slower than the
    others on every question (a peer at half plain decoding's speed) is measured, not
    disturbed: the tolerance is multiplied by its typical slowness, the lower median of
    that ratio over all its generations, where it exceeds 1."""
    per_token: dict[int, dict[str, list[float]]] = {}
    for r in results.records:
        if r.num_tokens > 0:
            per_token.setdefault(r.question_id, {}).setdefault(r.method, []).append(
                r.seconds / r.num_tokens)
    candidates = []  # (record, its seconds a token, plain's, the others' median)
    for r in results.records:
        runs = per_token.get(r.question_id, {})
        if r.num_tokens <= 0 or r.method == "plain" or "plain" not in runs:
            continue
        others = [t for method, times in runs.items() if method != r.method for t in times]
        candidates.append((r, r.seconds / r.num_tokens, statistics.median(runs["plain"]),
                           statistics.median(others)))
    typical: dict[str, list[float]] = {}
    for r, mine, plain, median in candidates:
        typical.setdefault(r.method, []).append(mine / max(plain, median))
    found = []
    for r, mine, plain, median in candidates:
        expected = max(plain, median)
        tolerance = SLOW_GENERATION_TOLERANCE * max(1.0, statistics.median_low(typical[r.method]))
        if mine >= tolerance * expected \
                and (mine - expected) * r.num_tokens >= SLOW_GENERATION_SECONDS:
            found.append({"question_id": r.question_id, "group": r.group, "method": r.method,
                          "repetition": r.repetition, "seconds_per_token": mine,
                          "plain_seconds_per_token": plain,
                          "others_median_seconds_per_token": median})
    return found


def _slow_line(slow: dict) -> str:
    return (f"{slow['method']} on question {slow['question_id']} ({slow['group']}), repetition "
            f"{slow['repetition']}: {slow['seconds_per_token'] * 1000:.1f} ms a token, "
            f"{slow['seconds_per_token'] / slow['plain_seconds_per_token']:.1f}× plain "
            f"decoding's ({slow['plain_seconds_per_token'] * 1000:.1f} ms) and "
            f"{slow['seconds_per_token'] / slow['others_median_seconds_per_token']:.1f}× the "
            "other methods' median: one slow generation")


def _tokens_per_second(records) -> float:
    seconds = sum(r.seconds for r in records)
    return sum(r.num_tokens for r in records) / seconds if seconds else 0.0


def _decoding_rate(records) -> float | None:
    """Tokens per second of decoding alone (prefill excluded); None for peers (no stats)."""
    if not records or any(r.stats is None for r in records):
        return None
    seconds = sum(r.stats["total_seconds"] - r.stats["prefill_seconds"] for r in records)
    return sum(r.num_tokens for r in records) / seconds if seconds > 0 else None


def _overhead(stats: list[dict]) -> dict:
    """Host-side time per cycle outside the target's forward passes (seconds), and its
    share of decoding time (prefill excluded)."""
    if not stats or any("target_forward_seconds" not in s for s in stats):
        return {}
    cycles = sum(s["cycles"] for s in stats)
    decoding = sum(s["total_seconds"] - s["prefill_seconds"] for s in stats)
    overhead = sum(s["overhead_seconds"] for s in stats)
    return {"cycles": cycles, "overhead_per_cycle": overhead / cycles if cycles else 0.0,
            "forward_per_cycle": sum(s["target_forward_seconds"] for s in stats) / cycles
            if cycles else 0.0,
            "overhead_share": overhead / decoding if decoding else 0.0}


def _acceptance(stats: list[dict], forward_seconds: dict) -> dict:
    total = GenerationStats.merged(map(GenerationStats.from_dict, stats))
    k, cycles, committed = total.num_speculative_tokens, total.cycles, total.num_generated_tokens
    if not stats or k == 0:
        return {}
    alpha = total.acceptance_rate or 0.0
    expected = (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1
    draft_per_cycle = total.draft_seconds / cycles
    cost = {int(n): seconds for n, seconds in forward_seconds.items()}
    # Cycles that drafted exactly j tokens, from "cycles that drafted ≥ i + 1" per position.
    at_least = [cycles] + total.drafted_per_position + [0]
    mean_cycle_cost = sum((at_least[j] - at_least[j + 1]) * cost[j + 1]
                          for j in range(k + 1)) / cycles + draft_per_cycle
    return {
        "k": k, "policy": total.policy, "chosen_k_histogram": total.chosen_k_histogram,
        "drafted_tokens": total.drafted_tokens,
        "acceptance_rate": alpha, "mean_acceptance_length": committed / cycles,
        "per_position_acceptance": total.per_position_acceptance,
        "draft_share": total.draft_seconds / total.total_seconds,
        "verify_share": total.verify_seconds / total.total_seconds,
        "speedup_leviathan": expected * cost[1] / (cost[k + 1] + draft_per_cycle),
        "speedup_bound": (committed / cycles) * cost[1] / mean_cycle_cost,
    }


def instabilities(results: BenchResults, summary: dict) -> list[str]:
    """Signs that the timings were disturbed (e.g. by another process using the CPU), one
    line each, naming the figures (see the module docstring); empty when none.

    Checks: the forward cost model falls by more than :data:`COST_TOLERANCE` × as more
    tokens are scored (worst pair); a method's tokens/s in a group differs between
    repetitions by more than :data:`REPETITION_TOLERANCE` ×; a method's tokens/s in a group
    is more than :data:`OUTLIER_TOLERANCE` × above or below the median of the group's
    other methods; plain decoding's host overhead per cycle is more than
    :data:`HOST_TOLERANCE` × the idle calibration measured at the start (plus
    :data:`HOST_SLACK_SECONDS` for the cycle's bookkeeping); one generation much slower
    than the same question's others (:func:`slow_generations`).
    """
    found = []
    plain = summary.get(OVERALL, {}).get("plain", {})
    measured, calibrated = plain.get("overhead_per_cycle"), results.host_seconds_at_start
    if measured is not None and calibrated \
            and measured > HOST_TOLERANCE * calibrated + HOST_SLACK_SECONDS:
        found.append(f"host overhead of plain decoding: {measured * 1000:.2f} ms a cycle, "
                     f"{measured / calibrated:.0f}× the {calibrated * 1000:.2f} ms measured "
                     "for the same work at the start")
    cost = sorted((int(n), seconds) for n, seconds in results.forward_seconds.items())
    pairs = [(fewer[1] / more[1], fewer, more) for i, fewer in enumerate(cost)
             for more in cost[i + 1:] if more[1] > 0]
    if pairs:
        ratio, fewer, more = max(pairs)
        if ratio > COST_TOLERANCE:
            found.append(f"target forward cost falls as more tokens are scored: {more[0]} "
                         f"tokens took {more[1] * 1000:.1f} ms, {ratio:.1f}× less than "
                         f"{fewer[0]} ({fewer[1] * 1000:.1f} ms)")
    for group, row in summary.items():
        if group == OVERALL:
            continue
        for method, entry in row.items():
            per_repetition = [t for t in entry["tokens_per_second_per_repetition"] if t > 0]
            if len(per_repetition) > 1 \
                    and max(per_repetition) > REPETITION_TOLERANCE * min(per_repetition):
                found.append(f"{method} on {group}: repetitions disagree "
                             f"{max(per_repetition) / min(per_repetition):.1f}× ("
                             + ", ".join(f"{t:.1f}" for t in per_repetition) + " tokens/s)")
        for method, entry in row.items():
            others = [e["tokens_per_second"] for m, e in row.items() if m != method]
            median = statistics.median(others) if others else 0.0
            mine = entry["tokens_per_second"]
            if median > 0 and mine > 0 and max(mine / median, median / mine) > OUTLIER_TOLERANCE:
                found.append(f"{method} on {group}: {mine:.1f} tokens/s, "
                             f"{max(mine / median, median / mine):.1f}× "
                             f"{'above' if mine > median else 'below'} the other methods' "
                             f"median ({median:.1f})")
    found += [_slow_line(slow) for slow in slow_generations(results)]
    return found


def write_report(results: BenchResults, out_dir: str | Path) -> dict:
    """Write ``results.json``, ``report.md`` and the PNG plots into ``out_dir``, each file
    whole or not at all (an error or Ctrl-C while writing leaves no partial file).

    Returns:
        the summary (as :func:`summarize`), with the written paths under ``"files"``,
        :func:`instabilities` under ``"unstable"``, :func:`never_drafted` under
        ``"never_drafted"`` and :func:`slow_generations` under ``"slow_generations"``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    summary = summarize(results)
    unstable = instabilities(results, summary)
    locked = never_drafted(summary)
    slow = slow_generations(results)
    write_text_atomically(out / "results.json", readable_json(
        results.to_dict() | {"summary": summary, "unstable": unstable, "never_drafted": locked,
                             "slow_generations": slow}))
    write_text_atomically(out / "report.md", markdown(results, summary, unstable, locked))
    files = [out / "results.json", out / "report.md"] + plot(results, summary, out)
    return summary | {"files": [str(f) for f in files], "unstable": unstable,
                      "never_drafted": locked, "slow_generations": slow}


def verdict_line(summary: dict, unstable: Sequence[str] = ()) -> str:
    """The bench's outcome in one sentence: the fastest method overall against plain
    decoding with its range over groups, the greedy identity failures, a policy that never
    drafted where drafting was accepted (``summary["never_drafted"]``, from
    :func:`write_report`), the generations much slower than their question's others
    (``summary["slow_generations"]``), and whether the timings can be trusted."""
    overall = summary[OVERALL]
    others = [m for m in overall if m != "plain" and overall[m].get("speedup") is not None]
    failures = sum(e["mismatches"] or 0 for m, e in overall.items() if not is_peer(m))
    parts = []
    if others:
        best = max(others, key=lambda m: overall[m]["speedup"])
        by_group = [entry[best]["speedup"] for group, entry in summary.items()
                    if group != OVERALL and isinstance(entry, dict)  # not "files", "unstable"
                    and entry.get(best, {}).get("speedup") is not None]
        parts.append(f"{best} was the fastest, {overall[best]['speedup']:.2f}× plain decoding "
                     "overall" + (f" ({min(by_group):.2f}–{max(by_group):.2f}× by group)"
                                  if by_group else ""))
    parts.append(f"greedy outputs differing from plain decoding: {failures}")
    locked = summary.get("never_drafted") or []
    if locked:
        parts.append(f"a policy never drafted where drafting was accepted ({len(locked)} "
                     "groups, see report.md)")
    slow = summary.get("slow_generations") or []
    if slow:
        parts.append("slow generations: " + ", ".join(
            f"{s['method']} on question {s['question_id']} ({s['group']}, "
            f"{s['seconds_per_token'] / s['plain_seconds_per_token']:.1f}× plain)"
            for s in slow))
    parts.append("timings disturbed: see the warning above, compare nothing" if unstable
                 else "timings steady")
    return "verdict: " + "; ".join(parts)


def markdown(results: BenchResults, summary: dict, unstable: Sequence[str] = (),
             locked: Sequence[str] = ()) -> str:
    """The tables of ``report.md``, after the warnings: an incomplete run, ``unstable``
    measurements (see :func:`instabilities`), policies ``locked`` out of drafting
    (:func:`never_drafted`)."""
    methods = list(next(iter(summary.values())))
    failures = [r for r in results.records if r.matches_plain is False
                and not is_peer(r.method)]
    cost = results.forward_seconds
    lines = ["# exactspec bench", ""]
    if results.incomplete:
        lines += [f"**Incomplete: {results.incomplete}; the figures cover those runs only.**",
                  ""]
    if unstable:
        lines += [f"**{UNSTABLE_HEADLINE}**", ""] + [f"- {line}" for line in unstable] + [""]
    if locked:
        lines += ["**A policy never drafted where drafting was accepted:**", ""] \
            + [f"- {line}" for line in locked] + [""]
    lines += [f"Config: `{json.dumps(results.config)}`", "",
             f"Machine: `{json.dumps(results.machine)}`", "",
             "Target forward cost by tokens scored (ms): "
             + ", ".join(f"{n}: {s * 1000:.1f}" for n, s in cost.items()), "",
             f"**Greedy identity failures: {len(failures)}**"
             + "".join(f"\n- question {r.question_id} ({r.group}) {r.method}, repetition "
                       f"{r.repetition}" for r in failures), "",
             "## Speedup over plain decoding (tokens/s ratio; min–max over repetitions)", "",
             "| group | " + " | ".join(methods) + " |",
             "|---|" + "---|" * len(methods)]
    for group, row in summary.items():
        cells = [f"{e['speedup']:.2f}× ({e['speedup_min']:.2f}–{e['speedup_max']:.2f}); "
                 f"{e['tokens_per_second']:.1f} tok/s" for e in row.values()]
        lines.append(f"| {group} | " + " | ".join(cells) + " |")
    reps = len(next(iter(summary[OVERALL].values()))["tokens_per_second_per_repetition"])
    lines += ["", f"## Repeatability ({reps} repetitions, interleaved)", "",
              "Spread of each method's tokens/s between repetitions: (max − min) / median; "
              "0 with one repetition. Ratios between methods are trustworthy to about the "
              "larger of their two spreads.", "",
              "| group | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for group, row in summary.items():
        lines.append(f"| {group} | " + " | ".join(f"{e['repetition_spread']:.1%}"
                                                  for e in row.values()) + " |")
    ours = [m for m in methods if "decode_speedup" in summary[OVERALL][m]]
    lines += ["", "## Decoding speedup, prefill excluded (exactspec's methods)", "",
              "Where long prompts make prefill most of the time (llama.cpp), this separates "
              "what speculation changes from what it cannot.", "",
              "| group | " + " | ".join(ours) + " |", "|---|" + "---|" * len(ours)]
    for group, row in summary.items():
        lines.append(f"| {group} | " + " | ".join(f"{row[m]['decode_speedup']:.2f}×"
                                                  for m in ours) + " |")
    lines += ["", "## Acceptance and where the time goes (exactspec's speculative methods)", "",
              "*cycles choosing k*: the k the policy chose, capped so that no cycle drafts "
              "past `max_new_tokens` (so a constant policy also shows smaller k in the last "
              "cycles); the proposer may then propose fewer (prompt lookup without a match). "
              "*acceptance rate*: accepted over the drafts actually made.", "",
              "| group | method | k | cycles choosing k = 0, 1, … | acceptance rate | mean "
              "acceptance length | per-position acceptance | draft share | verify share | "
              "measured speedup | bound (drafts made) | Leviathan (k every cycle) |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for group, row in summary.items():
        for method, e in row.items():
            if "k" not in e:
                continue
            positions = ", ".join("–" if a is None else f"{a:.2f}"
                                  for a in e["per_position_acceptance"])
            chosen = "/".join(map(str, e["chosen_k_histogram"]))
            lines.append(f"| {group} | {method} | {e['k']} ({e['policy']}) | {chosen} | "
                         f"{e['acceptance_rate']:.3f} | "
                         f"{e['mean_acceptance_length']:.2f} | {positions} | "
                         f"{e['draft_share']:.1%} | {e['verify_share']:.1%} | "
                         f"{e['speedup']:.2f}× | {e['speedup_bound']:.2f}× | "
                         f"{e['speedup_leviathan']:.2f}× |")
    lines += ["", "## Host-side overhead (exactspec's methods, all groups)", "",
              "Overhead = decoding time outside the target's forward passes: drafting (prompt "
              "lookup is pure Python), logits processing, verification, bookkeeping."
              + ("" if results.host_seconds_at_start is None else
                 f" A plain cycle's host work measured alone at the start (idle calibration): "
                 f"{results.host_seconds_at_start * 1000:.2f} ms."), "",
              "| method | cycles | target forward per cycle | overhead per cycle | overhead share |",
              "|---|---|---|---|---|"]
    for method, e in summary[OVERALL].items():
        if "overhead_share" in e:
            lines.append(f"| {method} | {e['cycles']} | {e['forward_per_cycle'] * 1000:.2f} ms | "
                         f"{e['overhead_per_cycle'] * 1000:.2f} ms | {e['overhead_share']:.1%} |")
    peers = [r for r in results.records if is_peer(r.method) and r.matches_plain is False]
    lines += ["", f"Peers' greedy outputs differing from exactspec's plain decoding: {len(peers)} "
              f"of {sum(is_peer(r.method) for r in results.records)} runs "
              "(a peer may prefill or batch differently, so near-tied tokens can flip).", ""]
    for method, (differing, runs) in peer_speculation_changes(results).items():
        lines.append(f"- {method}: {differing} of {runs} greedy outputs differ from the same "
                     f"engine's own plain decoding ({method.split('-')[0]}-plain)")
    return "\n".join(lines)


def peer_speculation_changes(results: BenchResults) -> dict[str, tuple[int, int]]:
    """Per speculative peer method (``llama-draft:…``, ``hf-prompt-lookup:…``) run beside
    its engine's plain decoding (``llama-plain``, ``hf-plain``): (greedy outputs that
    differ from that plain decoding's of the same question and repetition, outputs
    compared). Empty unless greedy."""
    if results.config.get("temperature", 0.0) != 0.0:
        return {}
    by_run = {(r.method, r.question_id, r.repetition): r.token_ids for r in results.records}
    changes: dict[str, tuple[int, int]] = {}
    for (method, question, repetition), token_ids in by_run.items():
        plain = f"{method.split('-')[0]}-plain"
        if not is_peer(method) or method == plain:
            continue
        reference = by_run.get((plain, question, repetition))
        if reference is not None:
            differing, runs = changes.get(method, (0, 0))
            changes[method] = (differing + (token_ids != reference), runs + 1)
    return changes


def plot(results: BenchResults, summary: dict, out: Path) -> list[Path]:
    """speedup_by_group.png, committed_per_cycle.png, acceptance_by_position.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    files = []
    groups = list(summary)
    methods = [m for m in summary[groups[0]] if m != "plain"]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)) + 3, 4))
    width = 0.8 / max(len(methods), 1)
    for i, method in enumerate(methods):
        values = [summary[g][method]["speedup"] for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + width * (len(methods) - 1) / 2 for x in range(len(groups))], groups,
                  rotation=20)
    ax.set_ylabel("speedup over plain decoding (×)")
    ax.set_title("Speedup by task group")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # clear of the bars
    files.append(_save(fig, out / "speedup_by_group.png"))

    runs = [r for r in results.records if r.stats and r.stats["committed_per_cycle"]
            and r.stats["num_speculative_tokens"] > 0]
    if runs:
        run = max(runs, key=lambda r: r.stats["mean_acceptance_length"] or 0)
        cycles = run.stats["committed_per_cycle"][:60]
        fig, ax = plt.subplots(figsize=(9, 3))
        ax.bar(range(1, len(cycles) + 1), cycles, color="tab:green")
        ax.set_xlabel("cycle")
        ax.set_ylabel("tokens committed")
        ax.set_title(f"Committed tokens per cycle, first 60 cycles: {run.method}, question "
                     f"{run.question_id} ({run.group}), the run with the longest mean "
                     "acceptance length", fontsize=9)
        files.append(_save(fig, out / "committed_per_cycle.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for method in methods:
        entry = summary[OVERALL][method]
        if "per_position_acceptance" in entry:
            values = entry["per_position_acceptance"]
            ax.plot(range(1, len(values) + 1), [v if v is not None else float("nan")
                                                for v in values], marker="o", label=method)
    ax.set_xlabel("draft position")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # positions are whole
    ax.set_ylabel("P(accepted | drafted)")
    ax.set_ylim(0, 1)
    ax.set_title("Acceptance by draft position (all groups)")
    if ax.get_legend_handles_labels()[0]:  # no speculative method: nothing to label
        ax.legend(fontsize=8)
    files.append(_save(fig, out / "acceptance_by_position.png"))
    return files


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with replaced_atomically(path) as partial:
        fig.savefig(partial, dpi=110, format=path.suffix[1:])
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
