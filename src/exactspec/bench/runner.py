"""Runs the benchmark: every method on every question, interleaved, plus the cost model.

Interleaving (for each question and repetition: method A, B, C, then again) spreads drift
on a shared machine evenly over the methods. A warm-up generation per method comes first.
Greedy runs of exactspec's speculative methods must equal plain decoding token for token;
any difference is recorded as a failure (peers' differences are recorded too, as facts).
Ctrl-C keeps what was measured: every method's runs on the questions finished so far.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import transformers

from exactspec import __version__
from exactspec.backends.base import Backend, forward_one, new_sequence_id
from exactspec.backends.llama_cpp_backend import llama_cpp_available
from exactspec.bench.methods import Method
from exactspec.bench.questions import Question
from exactspec.constraints import Constraint
from exactspec.distributed import Executor, LocalExecutor, Missing
from exactspec.progress import LoggedProgress
from exactspec.request import logits_pipeline, prompt_tokens
from exactspec.sampling import SamplingParams
from exactspec.threads import torch_threads
from exactspec.verification import verify


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
    worker: str | None = None  # with Ray: the worker (host:pid) that ran it


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


def measure_host_seconds(target: Backend, params: SamplingParams | None = None,
                         trials: int = 30) -> float:
    """Median seconds of a plain cycle's host-side work (logits processing, the greedy
    choice or the warpers and a draw, the logprobs asked for) on random logits, as the
    engine runs it (one thread) with the run's sampling ``params`` (default greedy): the
    calibration the report compares the measured overhead with, to flag a run disturbed by
    other work. A sampling run's plain cycle costs more (sorting for top-p, the draw) than
    a greedy one's, so it is calibrated with its own settings (a constraint's mask too)."""
    params = dataclasses.replace(params or SamplingParams(), max_new_tokens=2, min_new_tokens=0,
                                 stop=())
    tokens = [1, 2, 3]
    pipeline = logits_pipeline(target, params, tokens)
    logits = torch.randn(1, target.vocab_size, generator=torch.Generator().manual_seed(0))
    rng = torch.Generator(device=target.device).manual_seed(0)
    times = []
    with torch_threads(1):
        for _ in range(trials):
            start = time.perf_counter()
            verify(tokens, [], None, logits, pipeline, rng)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


@dataclass
class BenchSetup:
    """What a bench runs on, loaded and calibrated once per process (with ``--ray``, once
    per worker): the target, the methods, each question's prompt tokenised (``prompts``, by
    question id), and the calibrations measured after a warm-up generation per method."""

    target: Backend
    questions: list[Question]
    methods: list[Method]
    params: SamplingParams
    prompts: dict[int, list[int]]
    forward_seconds: dict[int, float]
    host_seconds: float


def _check_baseline(methods: list[Method], questions: list[Question]) -> None:
    """Raises: ValueError if no method is ``plain`` (the baseline of every speedup), or a
    peer is asked to run a question whose output is constrained (peers take none)."""
    if not any(m.kind == "plain" for m in methods):
        raise ValueError("the methods must include 'plain' (the baseline)")
    peers = [m.name for m in methods if m.is_peer]
    if peers and any(q.json_schema is not None for q in questions):
        raise ValueError(f"{', '.join(peers)} cannot run the structured group: peers take no "
                         "output constraint; leave them out (--method) or the group")


def question_params(params: SamplingParams, question: Question) -> SamplingParams:
    """``params`` for ``question``: its output constrained to its JSON schema, if it has one."""
    if question.json_schema is None:
        return params
    return dataclasses.replace(params, constraint=Constraint.json_schema(question.json_schema))


def prepare_bench(target: Backend, questions: list[Question], methods: list[Method], *,
                  params: SamplingParams, chat: bool) -> BenchSetup:
    """Tokenise the prompts, warm every method up, measure the cost model.

    Raises:
        ValueError: if no method is ``plain`` (the baseline every speedup is relative to).
    """
    _check_baseline(methods, questions)
    prompts = {q.question_id: prompt_tokens(target, q.prompt, chat) for q in questions}
    warm_up = dataclasses.replace(params, max_new_tokens=4, min_new_tokens=0)
    for method in methods:
        method.run(prompts[questions[0].question_id], warm_up)
    max_k = max(m.k for m in methods)
    median_prompt = int(statistics.median(len(p) for p in prompts.values()))
    return BenchSetup(target, questions, methods, params, prompts,
                      measure_forward_cost(target, median_prompt, max_k + 1),
                      measure_host_seconds(target, question_params(params, questions[0])))


def run_bench(target: Backend, questions: list[Question], methods: list[Method], *,
              params: SamplingParams, repetitions: int, chat: bool, config: dict,
              show_progress: bool = True, executor: Executor | None = None) -> BenchResults:
    """Run every method on every question ``repetitions`` times, interleaved.

    The unit of work is one *question run*: every method once on one question, in turn, in
    one process, so each ratio is measured side by side. ``executor``
    (:mod:`exactspec.distributed`) runs the question runs on workers, each holding its own
    :func:`prepare_bench` state; without it they run here on ``target`` and ``methods``.
    With workers, each worker's cost model and calibration go to ``machine["workers"]``,
    each record names its worker, and the report's cost model is the per-size median over
    workers.

    On Ctrl-C during the runs, returns what was measured with ``incomplete`` saying so:
    every method's runs of each question run finished, none of the one under way. A
    question run whose worker died twice is named in ``incomplete`` too.

    Raises:
        ValueError: if no method is ``plain`` (the baseline every speedup is relative to).
        KeyboardInterrupt: on Ctrl-C before one question was run by every method.
    """
    local = executor is None
    setup = None
    if local:
        setup = prepare_bench(target, questions, methods, params=params, chat=chat)
        executor = LocalExecutor(setup)
    else:
        _check_baseline(methods, questions)
    units = [(index, repetition) for index in range(len(questions))
             for repetition in range(repetitions)]
    done: dict[int, tuple[list[Record], dict] | Missing] = {}
    with LoggedProgress(disable=not show_progress, transient=False) as progress:
        task = progress.add_task("benchmark", total=len(units) * len(methods))

        def finished(index: int, outcome) -> None:
            done[index] = outcome
            if not local:
                progress.update(task, advance=len(methods),
                                description=f"{len(done)} of {len(units)} question runs")
        advance = (lambda description: progress.update(task, advance=1, description=description)
                   ) if local else None
        try:
            executor.map(functools.partial(bench_unit, advance=advance), units, finished)
            incomplete = None
        except KeyboardInterrupt:
            if not done:
                raise
            incomplete = f"interrupted (Ctrl-C) after {len(done)} of {len(units)} question runs"
    workers, records, missing = {}, [], []
    for index in sorted(done):
        if isinstance(done[index], Missing):
            question = questions[units[index][0]]
            missing.append(f"question {question.question_id} (repetition {units[index][1]}) "
                           f"was not run: {done[index].reason}")
            continue
        block, worker = done[index]
        records += block
        workers[worker["worker"]] = worker
    if local:
        results = BenchResults(config, machine_info(), setup.forward_seconds,
                               host_seconds_at_start=setup.host_seconds)
    else:
        calibrations = list(workers.values())
        results = BenchResults(config, machine_info() | {"workers": calibrations},
                               _median_costs([w["forward_seconds"] for w in calibrations]),
                               host_seconds_at_start=statistics.median(
                                   w["host_seconds"] for w in calibrations) if calibrations
                               else None)
    results.records = records
    results.incomplete = "; ".join(([incomplete] if incomplete else []) + missing) or None
    return results


def _median_costs(costs: list[dict[int, float]]) -> dict[int, float]:
    """The per-size median of several cost models."""
    return {n: statistics.median(cost[n] for cost in costs) for n in costs[0]} if costs else {}


def bench_unit(setup: BenchSetup, index: int, repetition: int, advance=None
               ) -> tuple[list[Record], dict]:
    """One question run (a unit of work of :func:`run_bench`): every method once on question
    ``index``; returns its records and the worker that ran them with its calibration.
    ``advance(description)`` after each method's run, when given (here)."""
    question = setup.questions[index]
    block = _run_block(question, repetition, setup.prompts[question.question_id],
                       setup.methods, setup.params, advance or (lambda description: None))
    worker = None if advance is not None else f"{platform.node()}:{os.getpid()}"
    for record in block:
        record.worker = worker
    return block, {"worker": worker, "forward_seconds": setup.forward_seconds,
                   "host_seconds": setup.host_seconds}


def _run_block(question: Question, repetition: int, prompt_ids: list[int],
               methods: list[Method], params: SamplingParams, advance) -> list[Record]:
    """Every method once on one question; greedy outputs compared with plain decoding's.
    ``advance(description)`` after each method's run."""
    block, plain_ids = [], None
    params = question_params(params, question)
    for method in methods:
        outcome = method.run(prompt_ids, params, question.question_id)
        block.append(Record(question.question_id, question.group, method.name, repetition,
                            len(outcome.token_ids), outcome.seconds, outcome.token_ids,
                            outcome.stats))
        if method.kind == "plain":
            plain_ids = outcome.token_ids
        advance(f"{question.group} #{question.question_id} {method.name}")
    if params.greedy:
        for record in block:
            record.matches_plain = record.token_ids == plain_ids
    return block
