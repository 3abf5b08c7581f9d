"""Runs the benchmark: every method on every question, interleaved, plus the cost model.

Interleaving (for each question and repetition: method A, B, C, then again) spreads drift
on a shared machine evenly over the methods. A warm-up generation per method comes first.
Greedy runs of exactspec's speculative methods must equal plain decoding token for token;
any difference is recorded as a failure (peers' differences are recorded too, as facts).
Ctrl-C keeps what was measured: every method's runs on the questions finished so far.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch

from exactspec.backends.base import Backend, forward_one, new_sequence_id
from exactspec.bench.methods import Method
from exactspec.bench.questions import Question
from exactspec.progress import LoggedProgress
from exactspec.sampling import SamplingParams


@dataclass
class Record:
    """One generation of one method on one question."""

    question_id: int
    group: str
    method: str
    repetition: int
    num_tokens: int
    seconds: float
    token_ids: list[int]
    stats: dict | None
    matches_plain: bool | None = None  # greedy only: token-identical to plain decoding


@dataclass
class BenchResults:
    """Everything measured: raw records, the forward-cost model, config, machine."""

    config: dict
    machine: dict
    forward_seconds: dict[int, float]  # tokens scored in one target forward → seconds
    records: list[Record] = field(default_factory=list)
    host_seconds_at_start: float | None = None  # a plain cycle's host work, idle calibration
    incomplete: str | None = None  # why fewer runs than planned were made; None: all made

    def to_dict(self) -> dict:
        return asdict(self)


def machine_info() -> dict:
    """Machine, library versions, CPU model and PyTorch's CPU capability."""
    import transformers

    from exactspec import __version__

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "transformers": transformers.__version__, "exactspec": __version__,
            "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "llama_cpp": _llama_cpp_info()}


def _llama_cpp_info() -> str | None:
    """llama-cpp-python's version and llama.cpp's CPU features, if installed."""
    from exactspec.backends.llama_cpp_backend import llama_cpp_available

    if not llama_cpp_available():
        return None
    import llama_cpp

    return f"{llama_cpp.__version__}; {llama_cpp.llama_print_system_info().decode().strip()}"


def measure_forward_cost(target: Backend, context_length: int, max_tokens: int,
                         trials: int = 5) -> dict[int, float]:
    """Median seconds of one target forward over n = 1..max_tokens tokens after a cache of
    ``context_length`` tokens: the cost model behind the theoretical speedup bound."""
    vocab = min(target.vocab_size, 1000)
    context = [(7 * i) % vocab for i in range(max(context_length, 1))]
    sequence = new_sequence_id()
    cost = {}
    try:
        target.prefill(sequence, context)
        for n in range(1, max_tokens + 1):
            times = []
            for _ in range(trials):
                start = time.perf_counter()
                forward_one(target, sequence, context[:n])
                times.append(time.perf_counter() - start)
                target.rollback(sequence, n)
            cost[n] = statistics.median(times)
    finally:
        target.release(sequence)
    return cost


def measure_host_seconds(target: Backend, trials: int = 30) -> float:
    """Median seconds of a plain greedy cycle's host-side work (logits processing, argmax,
    stop check) on random logits, as the engine runs it (one thread): the calibration the
    report compares the measured overhead with, to flag a run disturbed by other work."""
    from exactspec.logits_pipeline import LogitsPipeline
    from exactspec.threads import torch_threads
    from exactspec.verification import verify

    params = SamplingParams(max_new_tokens=2)
    tokens = [1, 2, 3]
    pipeline = LogitsPipeline(params, tokens, target.vocab_size, target.eos_token_ids, [],
                              target.device)
    logits = torch.randn(1, target.vocab_size, generator=torch.Generator().manual_seed(0))
    times = []
    with torch_threads(1):
        for _ in range(trials):
            start = time.perf_counter()
            verify(tokens, [], None, logits, pipeline, None)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_bench(target: Backend, questions: list[Question], methods: list[Method], *,
              params: SamplingParams, repetitions: int, chat: bool, config: dict,
              show_progress: bool = True) -> BenchResults:
    """Run every method on every question ``repetitions`` times, interleaved.

    On Ctrl-C during the runs, returns what was measured with ``incomplete`` saying so:
    every method's runs of each (question, repetition) finished, none of the one under way.

    Raises:
        ValueError: if no method is ``plain`` (the baseline every speedup is relative to).
        KeyboardInterrupt: on Ctrl-C before one question was run by every method.
    """
    if not any(m.kind == "plain" for m in methods):
        raise ValueError("the methods must include 'plain' (the baseline)")
    tokenizer = target.tokenizer
    prompts = {q.question_id: tokenizer.apply_chat_template(q.prompt) if chat
               else tokenizer.encode(q.prompt) for q in questions}
    warm_up = SamplingParams(**{**asdict(params), "max_new_tokens": 4, "min_new_tokens": 0})
    for method in methods:
        method.run(prompts[questions[0].question_id], warm_up)
    max_k = max(m.k for m in methods)
    median_prompt = int(statistics.median(len(p) for p in prompts.values()))
    results = BenchResults(config, machine_info(),
                           measure_forward_cost(target, median_prompt, max_k + 1),
                           host_seconds_at_start=measure_host_seconds(target))

    total = len(questions) * repetitions * len(methods)
    blocks = 0
    with LoggedProgress(disable=not show_progress, transient=False) as progress:
        task = progress.add_task("benchmark", total=total)
        try:
            for question in questions:
                for repetition in range(repetitions):
                    block = _run_block(question, repetition, prompts[question.question_id],
                                       methods, params, progress, task)
                    results.records.extend(block)
                    blocks += 1
        except KeyboardInterrupt:
            if not results.records:
                raise
            results.incomplete = (f"interrupted (Ctrl-C) after {blocks} of "
                                  f"{len(questions) * repetitions} question runs")
    return results


def _run_block(question: Question, repetition: int, prompt_ids: list[int],
               methods: list[Method], params: SamplingParams, progress, task) -> list[Record]:
    """Every method once on one question; greedy outputs compared with plain decoding's."""
    block, plain_ids = [], None
    for method in methods:
        progress.update(task, description=f"{question.group} #{question.question_id} "
                                          f"{method.name}")
        outcome = method.run(prompt_ids, params, question.question_id)
        block.append(Record(question.question_id, question.group, method.name, repetition,
                            len(outcome.token_ids), outcome.seconds, outcome.token_ids,
                            outcome.stats))
        if method.kind == "plain":
            plain_ids = outcome.token_ids
        progress.advance(task)
    if params.greedy:
        for record in block:
            record.matches_plain = record.token_ids == plain_ids
    return block
