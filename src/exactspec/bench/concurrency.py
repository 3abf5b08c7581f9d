"""The benchmark under concurrency: waves of c requests at once, total tokens/s and latency.

``exactspec bench --concurrency 1,2,4,8``: the questions are cut into waves of c questions;
each wave is submitted at once to every method in turn (interleaved: for each wave, every
method, then the next wave), so the methods share the machine's drift. exactspec's methods
decode a wave with :class:`~exactspec.batching.BatchedGenerator` (``max_batch_size`` = c,
one target forward per cycle for the whole wave); transformers' plain ``generate()``
(``hf-plain``) decodes it as one left-padded batch; every other peer serves the wave's
requests one after another (transformers' assisted generation refuses batches;
llama-cpp-python's ``Llama`` holds one sequence). Figures per method and c: total tokens
per second (all of the wave's tokens / its wall time) and its ratio to c = 1, and the mean
request latency (seconds from the wave's start to the request's last token). Greedy
outputs of exactspec's methods must equal plain decoding of each question alone (the
one-sequence engine, run once before the waves).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exactspec.backends.base import Backend
from exactspec.bench.methods import Method
from exactspec.bench.questions import Question
from exactspec.bench.runner import machine_info
from exactspec.files import readable_json, replaced_atomically, write_text_atomically
from exactspec.progress import LoggedProgress
from exactspec.request import prompt_tokens
from exactspec.sampling import SamplingParams
from exactspec.speculation import Speculation


@dataclass
class WaveRecord:
    """One wave of ``concurrency`` requests decoded by one method."""

    method: str
    concurrency: int
    repetition: int
    question_ids: list[int]
    num_tokens: int
    seconds: float
    latencies: list[float]  # per request: seconds from the wave's start to its last token
    prefill_seconds: float | None = None  # the prompts' prefill (None: peers do not say)
    matches_alone: bool | None = None  # greedy, exactspec: every output as decoded alone


@dataclass
class ConcurrencyResults:
    """Everything measured: the waves, config, machine."""

    config: dict
    machine: dict
    records: list[WaveRecord] = field(default_factory=list)
    incomplete: str | None = None


def run_concurrency_bench(target: Backend, questions: list[Question], methods: list[Method],
                          concurrencies: Sequence[int], *, params: SamplingParams,
                          repetitions: int, chat: bool, config: dict,
                          show_progress: bool = True) -> ConcurrencyResults:
    """Decode every question at every concurrency with every method, interleaved.

    The questions used are the first multiple of max(concurrencies) (each concurrency then
    decodes the same questions). Ctrl-C keeps the waves finished by every method.

    Raises:
        ValueError: for a concurrency < 1, fewer questions than the largest concurrency, or
            a question of the structured group.
        KeyboardInterrupt: on Ctrl-C before any wave was finished by every method.
    """
    if any(q.json_schema is not None for q in questions):
        raise ValueError("--concurrency does not run the structured group yet (a wave's "
                         "requests share one set of sampling parameters): leave it out")
    if any(c < 1 for c in concurrencies):
        raise ValueError(f"--concurrency {list(concurrencies)} is invalid: each must be ≥ 1")
    widest = max(concurrencies)
    usable = len(questions) // widest * widest
    if not usable:
        raise ValueError(f"{len(questions)} questions cannot fill a wave of {widest}: use more "
                         "questions (--per-category) or a smaller --concurrency")
    questions = questions[:usable]
    prompts = [prompt_tokens(target, q.prompt, chat) for q in questions]
    warm_up = SamplingParams(**{**asdict(params), "max_new_tokens": 4, "min_new_tokens": 0})
    for method in methods:
        for c in sorted(set(concurrencies)):
            method.wave(prompts[:c], warm_up)
    alone = None  # greedy: plain decoding of each question alone, the one-sequence engine
    if params.greedy:
        plain = Speculation(target, None).generator()
        alone = [plain.generate(ids, params).token_ids for ids in prompts]
    results = ConcurrencyResults(config | {"questions_used": usable,
                                           "concurrencies": list(concurrencies)},
                                 machine_info())
    plan = [(r, c, start) for r in range(repetitions) for c in concurrencies
            for start in range(0, usable, c)]
    with LoggedProgress(disable=not show_progress) as progress:
        task = progress.add_task("benchmark", total=len(plan) * len(methods))
        try:
            for repetition, c, start in plan:
                wave = slice(start, start + c)
                block = []  # every method's record of this wave, kept only once all ran
                for method in methods:
                    progress.update(task, description=f"c={c} wave {start // c + 1} {method.name}")
                    begin = time.perf_counter()
                    outputs, latencies, prefill = method.wave(prompts[wave], params)
                    record = WaveRecord(method.name, c, repetition,
                                        [q.question_id for q in questions[wave]],
                                        sum(len(o) for o in outputs),
                                        time.perf_counter() - begin, latencies, prefill)
                    if alone is not None and not method.is_peer:
                        record.matches_alone = outputs == alone[wave]
                    block.append(record)
                    progress.advance(task)
                results.records.extend(block)
        except KeyboardInterrupt:
            if not results.records:
                raise
            results.incomplete = "interrupted (Ctrl-C): only the waves finished are reported"
    return results


def summarize_concurrency(results: ConcurrencyResults) -> dict:
    """Per method and concurrency: total tokens/s (all waves' tokens / their seconds), its
    ratio to the method's c = 1, mean request latency, greedy mismatches."""
    summary: dict[str, dict[int, dict]] = {}
    for record in results.records:
        summary.setdefault(record.method, {}).setdefault(record.concurrency, []).append(record)
    table = {}
    for method, by_c in summary.items():
        table[method] = {}
        for c, records in sorted(by_c.items()):
            rate = sum(r.num_tokens for r in records) / sum(r.seconds for r in records)
            decoding = sum(r.seconds - r.prefill_seconds for r in records
                           if r.prefill_seconds is not None)
            table[method][c] = {
                "tokens_per_second": rate,
                "decode_tokens_per_second": (
                    sum(r.num_tokens for r in records) / decoding
                    if all(r.prefill_seconds is not None for r in records) and decoding > 0
                    else None),
                "mean_latency_seconds": statistics.fmean(x for r in records for x in r.latencies),
                "waves": len(records),
                "mismatches": (None if all(r.matches_alone is None for r in records)
                               else sum(r.matches_alone is False for r in records))}
        base = table[method].get(1)
        for entry in table[method].values():
            entry["vs_concurrency_1"] = (entry["tokens_per_second"] / base["tokens_per_second"]
                                         if base else None)
            entry["decode_vs_concurrency_1"] = (
                entry["decode_tokens_per_second"] / base["decode_tokens_per_second"]
                if base and entry["decode_tokens_per_second"] and base["decode_tokens_per_second"]
                else None)
    return table


def write_concurrency_report(results: ConcurrencyResults, out_dir: str | Path) -> dict:
    """Write results.json, report.md and throughput.png to ``out_dir`` (each whole or not
    at all). Returns the summary with ``files``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = summarize_concurrency(results)
    write_text_atomically(out / "results.json", readable_json(
        {"config": results.config, "machine": results.machine, "summary": table,
         "records": [asdict(r) for r in results.records], "incomplete": results.incomplete}))
    write_text_atomically(out / "report.md", concurrency_markdown(results, table))
    files = [out / "results.json", out / "report.md", _plot(table, out / "throughput.png")]
    return {"table": table, "files": [str(f) for f in files]}


def concurrency_markdown(results: ConcurrencyResults, table: dict) -> str:
    config = results.config
    lines = ["# exactspec bench: concurrency", ""]
    if results.incomplete:
        lines += [f"**Incomplete: {results.incomplete}.**", ""]
    lines += ["## Configuration", ""]
    lines += [f"- {key}: {value}" for key, value in config.items()]
    machine = results.machine
    lines += [f"- machine: {machine['cpu']}, {machine['cpu_count']} cores, "
              f"{machine['torch_threads']} torch threads, torch {machine['torch']}", "",
              "Each wave submits c questions at once; total tokens/s = the wave's tokens / its "
              "wall time. Latency: seconds from the wave's start to a request's last token.", ""]
    concurrencies = sorted({c for by_c in table.values() for c in by_c})
    header = "| method | " + " | ".join(f"c={c} tokens/s (× c=1) · latency" for c in concurrencies)
    lines += [header + " | greedy mismatches |",
              "|---" * (len(concurrencies) + 2) + "|"]
    for method, by_c in table.items():
        cells = []
        for c in concurrencies:
            entry = by_c.get(c)
            cells.append("–" if entry is None else
                         f"{entry['tokens_per_second']:.1f} ({_times(entry['vs_concurrency_1'])})"
                         f" · {entry['mean_latency_seconds']:.2f} s")
        counts = [e["mismatches"] for e in by_c.values() if e["mismatches"] is not None]
        mismatches = sum(counts) if counts else "not checked"
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {mismatches} |")
    lines += ["", "Decoding alone (the prompts' prefill excluded; exactspec's methods, whose stats "
              "time it): total tokens/s (× c = 1).", "",
              "| method | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
              "|---" * (len(concurrencies) + 1) + "|"]
    for method, by_c in table.items():
        if not any(e["decode_tokens_per_second"] for e in by_c.values()):
            continue
        cells = [f"{by_c[c]['decode_tokens_per_second']:.1f} "
                 f"({_times(by_c[c]['decode_vs_concurrency_1'])})"
                 if c in by_c and by_c[c]["decode_tokens_per_second"] else "–"
                 for c in concurrencies]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    plain = table.get("plain")
    if plain:
        lines += ["", "Total tokens/s against exactspec's plain decoding at the same concurrency:",
                  "", "| method | " + " | ".join(f"c={c}" for c in concurrencies) + " |",
                  "|---" * (len(concurrencies) + 1) + "|"]
        for method, by_c in table.items():
            cells = [f"{by_c[c]['tokens_per_second'] / plain[c]['tokens_per_second']:.2f}×"
                     if c in by_c and c in plain else "–" for c in concurrencies]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _times(ratio: float | None) -> str:
    """A ratio as ``1.23×``; ``no c=1`` where there is none (c = 1 was not run)."""
    return "no c=1" if ratio is None else f"{ratio:.2f}×"


def _plot(table: dict, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for method, by_c in table.items():
        cs = sorted(by_c)
        ax.plot(cs, [by_c[c]["tokens_per_second"] for c in cs], marker="o", label=method)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for by_c in table.values() for c in by_c}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("total tokens/s")
    ax.set_title("Throughput under concurrency")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with replaced_atomically(path) as partial:
        fig.savefig(partial, dpi=110, format="png")
    plt.close(fig)
    return path
