"""One engine, one thread, a bounded queue: how the server runs generations.

A single worker thread owns the target and a
:class:`~exactspec.batching.BatchedGenerator`: jobs join the batch first come, first served
while it has room (continuous batching: between any two cycles), and every cycle advances
all of them in one target forward. HTTP handlers (asyncio) submit a :class:`Job` of
requests already prepared (:func:`~exactspec.request.prepare_request`: checked before they
queue) and read its events from an ``asyncio.Queue`` that the worker fills through
``loop.call_soon_threadsafe``; jobs wait in a bounded queue while the batch is full, and a
full queue is refused at once (the caller answers 503). Cancelling a job (its client went
away) drops its rows before the next cycle.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from exactspec.generator import GenerationResult, SpeculativeGenerator
from exactspec.load_options import DEFAULT_MAX_BATCH_SIZE
from exactspec.request import Request
from exactspec.sampling import SamplingParams
from exactspec.server.metrics import ServerMetrics
from exactspec.speculation import Speculation, SpeculationSettings

logger = logging.getLogger(__name__)


class QueueFullError(Exception):
    """The job queue holds ``max_queue`` jobs already."""


class Cancelled(Exception):
    """Raised inside generation when the job was cancelled."""


@dataclass
class Job:
    """One HTTP request's generations: every prompt × ``n`` choices, in order.

    ``requests`` holds one prepared :class:`~exactspec.request.Request` per prompt, all
    with the same sampling parameters and ``n``. Events put on ``events`` (read them with
    ``await events.get()``): ``("tokens", choice, token_ids)`` after each cycle,
    ``("result", choice, GenerationResult)`` when a choice is complete, ``("error", None,
    exception)``, and ``("end", None, None)`` last, always.
    """

    requests: Sequence[Request]
    speculation: SpeculationSettings
    loop: asyncio.AbstractEventLoop
    scope: Hashable = None  # whose earlier outputs it may draft from (Proposer.reset)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrival: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    first_token: float | None = None  # when its first token was emitted (perf_counter)
    results: list[GenerationResult] = field(default_factory=list)  # its finished choices

    @property
    def params(self) -> SamplingParams:
        return self.requests[0].params

    @property
    def n(self) -> int:
        """Choices per prompt."""
        return self.requests[0].n

    @property
    def num_choices(self) -> int:
        return len(self.requests) * self.n

    @property
    def prompt_lengths(self) -> list[int]:
        """Tokens of each prompt (chat template applied)."""
        return [len(request.prompt_token_ids) for request in self.requests]

    def put(self, kind: str, choice: int | None, value: Any) -> None:
        """Hand an event to the request's handler (thread-safe)."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, choice, value))


class EngineWorker:
    """The thread that runs every job on one target and proposer, batched.

    Args:
        speculation: the loaded target and the server's proposer (None: plain decoding
            only), its settings the server's default num_speculative_tokens and policy.
        metrics: where finished requests are counted.
        max_queue: most jobs waiting (beyond it :meth:`submit` raises QueueFullError).
        max_batch_size: most prompts decoded together (1 with a proposer that is not
            ``batchable``: every one exactspec builds is).
        generator_factory: makes the generator of every speculative setting, called as
            :class:`~exactspec.generator.SpeculativeGenerator` is (the default; plain
            decoding always gets it; :meth:`Speculation.generator
            <exactspec.speculation.Speculation.generator>`'s ``factory``). Injected by a
            caller that verifies otherwise: for testing audits only, ``serve
            --broken-verifier`` passes :class:`~exactspec.audit.broken.BrokenGenerator`, a
            deliberately wrong one.
    """

    def __init__(self, speculation: Speculation, metrics: ServerMetrics, *,
                 max_queue: int = 64, max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
                 generator_factory: Callable[..., SpeculativeGenerator] = SpeculativeGenerator,
                 ) -> None:
        self.speculation = speculation
        self.target, self.proposer = speculation.target, speculation.proposer
        proposer = self.proposer
        self.metrics = metrics
        self.generator_factory = generator_factory
        self._jobs: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
        self._generators: dict[SpeculationSettings, SpeculativeGenerator] = {}
        self._generators_lock = threading.Lock()  # the HTTP thread checks settings too
        if proposer is not None and not proposer.batchable and max_batch_size > 1:
            logger.info("%s drafts for one sequence at a time: requests are decoded one by one",
                        type(proposer).__name__)
            max_batch_size = 1
        # a bad default fails at start, not at the first request
        self.batched = speculation.batched_generator(max_batch_size,
                                                     self.generator(speculation.settings))
        self._rows: dict[int, tuple[Job, int]] = {}  # request id → (job, prompt index)
        self._outstanding: dict[int, int] = {}  # id(job) → rows not finished
        self._jobs_waiting_for_room = 0  # jobs taken from the queue, none of their rows active
        self._thread = threading.Thread(target=self._run, name="exactspec-engine", daemon=True)
        self._thread.start()

    def generator(self, speculation: SpeculationSettings) -> SpeculativeGenerator:
        """The generator for these settings (made once, then reused: every row gets its
        own copy of its policy and proposer).

        Raises:
            ValueError: if the policy cannot run with the server's proposer.
        """
        with self._generators_lock:
            if speculation not in self._generators:
                self._generators[speculation] = self.speculation.generator(
                    speculation, factory=self.generator_factory)
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
        self.metrics.waiting.set(self._jobs.qsize() + self._jobs_waiting_for_room)

    def close(self) -> None:
        """Stop the thread after the jobs it is running (waiting jobs are cancelled)."""
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
        closing = False
        while not closing or self._rows:
            while not closing and self._has_room():
                try:  # block only when there is nothing to decode
                    job = self._jobs.get(block=not self._rows)
                except queue.Empty:
                    break
                if job is None:
                    closing = True
                else:
                    self._start(job)
            for request_id, (job, _) in list(self._rows.items()):
                if job.cancelled.is_set():
                    self.batched.cancel(request_id)
                    self._end_row(request_id, Cancelled())
            self._update_gauges()  # before blocking on the next job, too
            if not self._rows:
                continue
            try:
                outputs = self.batched.admit()
                self._update_gauges()  # the cycle may take a while: show who is in it
                outputs |= self.batched.step()
            except Exception as error:  # reported to every client, the server goes on
                logger.exception("generation failed")
                for request_id in self._rows:
                    self.batched.cancel(request_id)
                outputs = dict.fromkeys(self._rows, error)
            for request_id, output in outputs.items():
                self._end_row(request_id, output)
            self._update_gauges()

    def _has_room(self) -> bool:
        return self.batched.num_active + self.batched.num_waiting < self.batched.max_batch_size

    def _start(self, job: Job) -> None:
        """Submit every request of ``job`` (a prompt) as one row of ``n`` samples."""
        if job.cancelled.is_set():
            self.metrics.aborted.inc()
            job.put("end", None, None)
            return
        generator = self.generator(job.speculation)
        self._outstanding[id(job)] = 0
        for p, request in enumerate(job.requests):
            def on_commit(sample: int, token_ids: list[int], base: int = p * job.n) -> None:
                if job.first_token is None:
                    job.first_token = time.perf_counter()
                job.put("tokens", base + sample, token_ids)

            try:
                request_id = self.batched.submit(request, on_commit=on_commit,
                                                 generator=generator, scope=job.scope)
            except Exception as error:
                self._fail(job, error)
                return
            self._rows[request_id] = (job, p)
            self._outstanding[id(job)] += 1
        self._update_gauges()

    def _end_row(self, request_id: int, output: list[GenerationResult] | Exception) -> None:
        """A row finished (its results), failed or was cancelled (an exception)."""
        if request_id not in self._rows:  # its job already failed
            return
        job, p = self._rows.pop(request_id)
        if isinstance(output, Exception):
            self._fail(job, output)
            return
        for index, result in enumerate(output):
            job.put("result", p * job.n + index, result)
        job.results += output
        self._outstanding[id(job)] -= 1
        if not self._outstanding[id(job)]:
            del self._outstanding[id(job)]
            now = time.perf_counter()
            try:
                self.metrics.record(job.results, sum(job.prompt_lengths),
                                    (job.first_token or now) - job.arrival, now - job.arrival)
            except Exception:  # a metric must never cost a client its answer
                logger.exception("recording a request's metrics failed")
            job.put("end", None, None)

    def _fail(self, job: Job, error: Exception) -> None:
        """End ``job`` with ``error`` (a cancellation is counted, not reported), dropping
        its other rows."""
        for request_id, (other, _) in list(self._rows.items()):
            if other is job:
                self.batched.cancel(request_id)
                del self._rows[request_id]
        if isinstance(error, Cancelled):
            self.metrics.aborted.inc()
        else:
            if not isinstance(error, ValueError):
                logger.error("generation failed: %s", error)
            job.put("error", None, error)
        self._outstanding.pop(id(job), None)
        job.put("end", None, None)

    def _update_gauges(self) -> None:
        """Requests running (a row of theirs in the batch) and waiting (queued, or all of
        their rows waiting for room in the batch)."""
        running = {id(job) for request_id, (job, _) in self._rows.items()
                   if self.batched.is_active(request_id)}
        jobs = {id(job) for job, _ in self._rows.values()}
        self._jobs_waiting_for_room = len(jobs - running)
        self.metrics.running.set(len(running))
        self.metrics.waiting.set(self._jobs.qsize() + self._jobs_waiting_for_room)
