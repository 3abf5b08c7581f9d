"""One engine, one thread, a bounded queue: how the server runs generations.

The engine decodes one sequence at a time and its backend holds one KV cache, so a single
worker thread owns it and takes jobs first come, first served. HTTP handlers (asyncio)
submit a :class:`Job` and read its events from an ``asyncio.Queue`` that the worker fills
through ``loop.call_soon_threadsafe``; a full job queue is refused at once (the caller
answers 503). Cancelling a job (its client went away) stops its generation at the next
cycle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from exactspec.backends.base import Backend
from exactspec.engine import SpeculativeGenerator
from exactspec.proposers.base import Proposer
from exactspec.sampling import SamplingParams
from exactspec.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The job queue holds ``max_queue`` jobs already."""


class Cancelled(Exception):
    """Raised inside generation when the job was cancelled."""


@dataclass(frozen=True)
class SpeculationSettings:
    """What a request's generation runs with: k_max (0 = plain decoding) and the policy."""

    num_speculative_tokens: int
    policy: str


@dataclass
class Job:
    """One request's generations: every prompt × ``n`` choices, in order.

    Events put on ``events`` (read them with ``await events.get()``):
    ``("tokens", choice, token_ids)`` after each cycle, ``("result", choice,
    GenerationResult)`` when a choice is complete, ``("error", None, exception)``, and
    ``("end", None, None)`` last, always.
    """

    prompts: Sequence[list[int]]
    params: SamplingParams
    n: int
    speculation: SpeculationSettings
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)

    def put(self, kind: str, choice: int | None, value: Any) -> None:
        """Hand an event to the request's handler (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, choice, value))


class EngineWorker:
    """The thread that runs every job on one target and drafter.

    Args:
        target: the loaded target model.
        proposer: the server's drafter (None: plain decoding only).
        speculation: the server's default k_max and policy.
        metrics: where finished requests are counted.
        max_queue: most jobs waiting (beyond it :meth:`submit` raises QueueFullError).
        allow_batch_variance: as :class:`~exactspec.engine.SpeculativeGenerator`.
    """

    def __init__(self, target: Backend, proposer: Proposer | None,
                 speculation: SpeculationSettings, metrics: ServerMetrics, *,
                 max_queue: int = 64, allow_batch_variance: bool = False) -> None:
        self.target, self.proposer = target, proposer
        self.default_speculation = speculation
        self.metrics = metrics
        self.allow_batch_variance = allow_batch_variance
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._generators: dict[SpeculationSettings, SpeculativeGenerator] = {}
        self.generator(speculation)  # a bad default fails at start, not at the first request
        self._thread = threading.Thread(target=self._run, name="exactspec-engine", daemon=True)
        self._thread.start()

    def generator(self, speculation: SpeculationSettings) -> SpeculativeGenerator:
        """The generator for these settings (made once, then reused: the engine resets its
        policy and drafter at every generation).

        Raises:
            ValueError: if the policy cannot run with the server's drafter.
        """
        if speculation not in self._generators:
            plain = speculation.num_speculative_tokens == 0 or self.proposer is None
            self._generators[speculation] = SpeculativeGenerator(
                self.target, None if plain else self.proposer,
                speculation.num_speculative_tokens, speculation.policy,
                allow_batch_variance=self.allow_batch_variance)
        return self._generators[speculation]

    def submit(self, job: Job) -> None:
        """Queue ``job``.

        Raises:
            QueueFullError: when ``max_queue`` jobs are waiting.
        """
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            raise QueueFullError(f"the server is busy: {self._jobs.maxsize} requests are "
                                 "waiting; retry later") from None
        self.metrics.waiting.set(self._jobs.qsize())

    def close(self) -> None:
        """Stop the thread after the job it is running (waiting jobs are cancelled)."""
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.put("error", None, Cancelled("the server is shutting down"))
                job.put("end", None, None)
        self._jobs.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self.metrics.waiting.set(self._jobs.qsize())
            self.metrics.running.set(1)
            try:
                self._run_job(job)
            except Cancelled:
                self.metrics.aborted.inc()
            except Exception as error:  # reported to the client, the server goes on
                logger.exception("generation failed")
                job.put("error", None, error)
            finally:
                self.metrics.running.set(0)
                job.put("end", None, None)

    def _run_job(self, job: Job) -> None:
        if job.cancelled.is_set():
            raise Cancelled
        generator = self.generator(job.speculation)
        first_token: list[float] = []

        for p, prompt in enumerate(job.prompts):
            def on_commit(index: int, token_ids: list[int], base: int = p * job.n) -> None:
                if job.cancelled.is_set():
                    raise Cancelled
                if not first_token:
                    first_token.append(time.perf_counter())
                job.put("tokens", base + index, token_ids)

            results = generator.generate_samples(prompt, job.params, n=job.n, on_commit=on_commit)
            for index, result in enumerate(results):
                job.put("result", p * job.n + index, result)
                self.metrics.record(result, len(prompt) if index == 0 else 0)
        ttft = (first_token[0] if first_token else time.perf_counter()) - job.arrival
        self.metrics.ttft.observe(ttft)
        self.metrics.e2e.observe(time.perf_counter() - job.arrival)

