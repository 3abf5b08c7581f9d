"""The benchmark as one call: :func:`run` takes a :class:`BenchSpec` (what to compare, on
which model and questions, how long) and returns the measurements, which
:func:`~exactspec.bench.report.write_report` (or, under load,
:func:`~exactspec.bench.concurrency.write_concurrency_report`) writes out. ``exactspec
bench`` maps its flags to a spec and prints.

Two measurements, one spec:

- **speedup per task group** (``concurrency`` None): every method on every question,
  interleaved, here or on Ray workers (:attr:`BenchSpec.executor`), each loading the spec's
  models once (:func:`build`); :func:`~exactspec.bench.runner.run_bench`.
- **throughput under load** (``concurrency`` given): waves of C questions at once;
  :func:`~exactspec.bench.concurrency.run_concurrency_bench`.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from exactspec.backends.base import Backend
from exactspec.bench.concurrency import ConcurrencyResults, run_concurrency_bench
from exactspec.bench.methods import Method, parse_method
from exactspec.bench.questions import Question
from exactspec.bench.runner import BenchResults, BenchSetup, prepare_bench, run_bench
from exactspec.distributed import Executor
from exactspec.models import ModelSpec
from exactspec.sampling import SamplingParams
from exactspec.speculation import SpeculationSpec


@dataclass
class BenchSpec:
    """What a benchmark compares, on what, and how long.

    Attributes:
        model: the target; the methods' draft models load with its options.
        methods: method specs (:mod:`exactspec.bench.methods`), ``plain`` among them (the
            baseline of every speedup).
        questions: the questions (:func:`~exactspec.bench.questions.load_questions`).
        params: the sampling parameters (``max_new_tokens``: tokens per run; temperature 0:
            greedy, and every exactspec method is checked token-identical to ``plain``).
        repetitions: runs of every method on every question (≥ 1).
        chat: apply the target's chat template to the questions.
        allow_batch_variance: as :class:`~exactspec.generator.SpeculativeGenerator`'s.
        concurrency: None: speedup per task group; else the wave sizes (each ≥ 1) of a
            throughput-under-load run.
        config: what the report lists about the run beside what the spec holds (e.g. where
            the questions came from), first.
        executor: makes the executor of the question runs from a function that loads a
            worker's state (picklable; None: here). Not with ``concurrency``.
    """

    model: ModelSpec
    methods: Sequence[str]
    questions: Sequence[Question]
    params: SamplingParams
    repetitions: int = 1
    chat: bool = True
    allow_batch_variance: bool = False
    concurrency: Sequence[int] | None = None
    config: dict = field(default_factory=dict)
    executor: Callable[[Callable[[], BenchSetup]], Executor] | None = None


def load(spec: BenchSpec) -> tuple[Backend, list[Method]]:
    """The spec's target and methods, loaded.

    Raises:
        ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError, ValueError:
            as loading the models and parsing the methods do.
    """
    plain = SpeculationSpec(spec.model, "plain").load()  # the target; drafts load once each
    return plain.target, [parse_method(method, plain.target, plain.load_model,
                                       allow_batch_variance=spec.allow_batch_variance)
                          for method in spec.methods]


def build(spec: BenchSpec) -> BenchSetup:
    """A worker's state: :func:`load`, then warmed up and calibrated
    (:func:`~exactspec.bench.runner.prepare_bench`)."""
    target, methods = load(spec)
    return prepare_bench(target, list(spec.questions), methods, params=spec.params,
                         chat=spec.chat)


def run(spec: BenchSpec, show_progress: bool = True) -> BenchResults | ConcurrencyResults:
    """Run the benchmark ``spec`` describes (see the module docstring). On Ctrl-C, returns
    what was measured with ``incomplete`` saying so.

    Raises:
        ValueError: for sizes out of range, an executor with ``concurrency``, no ``plain``
            method, or what loading and parsing raise (see :func:`load`).
        ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError: as loading does.
        RayNotInstalledError, ConnectionError, RuntimeError: as the executor's start does.
        KeyboardInterrupt: on Ctrl-C before anything was measured.
    """
    if spec.repetitions < 1 or not spec.questions:
        raise ValueError(f"repetitions {spec.repetitions} must be ≥ 1 and questions "
                         f"({len(spec.questions)}) at least one")
    if spec.concurrency is not None and spec.executor is not None:
        raise ValueError("an executor shards question runs over workers; concurrency measures "
                         "one process under load: give one of them")
    target, methods = load(spec)
    config = spec.config | {
        "model": spec.model.name_or_path, "backend": target.description,
        "device": str(target.device), "methods": [m.name for m in methods],
        "max_new_tokens": spec.params.max_new_tokens, "temperature": spec.params.temperature,
        "repetitions": spec.repetitions, "seed": spec.params.seed, "chat": spec.chat}
    config |= {f"{m.name}: how": m.notes for m in methods if m.notes}
    if spec.concurrency is not None:
        return run_concurrency_bench(target, list(spec.questions), methods, spec.concurrency,
                                     params=spec.params, repetitions=spec.repetitions,
                                     chat=spec.chat, config=config,
                                     show_progress=show_progress)
    executor = None
    if spec.executor is not None:
        executor = spec.executor(functools.partial(build, dataclasses.replace(spec,
                                                                              executor=None)))
        config["ran_on"] = executor.description
    try:
        return run_bench(target, list(spec.questions), methods, params=spec.params,
                         repetitions=spec.repetitions, chat=spec.chat, config=config,
                         show_progress=show_progress, executor=executor)
    finally:
        if executor is not None:
            executor.close()
