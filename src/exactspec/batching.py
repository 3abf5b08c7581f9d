"""Batched speculative decoding: many sequences advance together, one target forward per cycle.

Each cycle every active row drafts on its own (its own proposer state, policy, k, possibly
none), one packed forward of the target scores every row's ``[last, d_1 .. d_k]``
(:meth:`~exactspec.backends.base.Backend.forward`), and each row is verified,
committed and rolled back on its own, exactly as :class:`~exactspec.engine.SpeculativeGenerator`
does for one sequence (the same :class:`~exactspec.engine.SampleDecoding`). Rows join
between cycles as others finish (continuous batching, Yu et al. 2022, "Orca",
iteration-level scheduling); a joining prompt is prefilled in chunks while the others
decode, within a time budget that keeps their time per token within about 1.8× its idle
value (chunked prefill, Agrawal et al. 2023, "Sarathi"; :meth:`BatchedGenerator._prefill`).

Exactness: a row's logits in the packed forward are bit-identical to scoring it alone (the
backend's kernels work row by row, attention per sequence over its own cache: see
:mod:`~exactspec.backends.batch_invariant`), its sampling parameters, stop conditions and
``rng`` (seeded from its own ``SamplingParams.seed``) are its own, and its policy is
*untimed* (prior cost model only: a forward's time belongs to the whole batch), so a row's
tokens do not depend on its companions: greedy rows equal plain decoding, and a seeded row
gives what :meth:`SpeculativeGenerator.generate` gives for the same request.
"""

from __future__ import annotations

import copy
import functools
import time
from collections import deque
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from exactspec.backends.base import Backend, UnsupportedModelError, new_sequence_id
from exactspec.engine import (PLAIN_STEP, GenerationResult, OnCommit, SampleDecoding,
                              SpeculativeGenerator)
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.proposers.base import Proposer
from exactspec.request import Prompt, Request, prepare_request
from exactspec.sampling import SamplingParams
from exactspec.speculation_length import (Choice, ForwardCost, SpeculationLengthPolicy,
                                          batch_speculation_lengths, survival)
from exactspec.threads import torch_threads

DEFAULT_MAX_BATCH_SIZE = 8
"""Rows decoded together when none is given."""
PREFILL_SHARE = 0.8
"""While rows decode, prefill gets this many seconds per second of decoding (at most), so
their time per token stays within about (1 + this)× its value without prefill."""
PREFILL_SECONDS_ALONE = 0.25
"""With no row decoding, prefill chunks run each cycle until this many seconds are spent
(at least one chunk), so that a request arriving meanwhile waits at most about this."""


@dataclass
class _Row:
    """One request being decoded: its settings, proposer, policy and randomness, and the
    sample being decoded. A request of ``n`` samples decodes them one after another in its
    row, on one ``rng`` (as :meth:`SpeculativeGenerator.generate_samples` does)."""

    request_id: int
    generator: SpeculativeGenerator  # the row's proposer, k_max and policy come from it
    prompt_token_ids: list[int]
    pipeline: LogitsPipeline
    rng: torch.Generator
    proposer: Proposer | None
    policy: SpeculationLengthPolicy
    timed: bool  # greedy or unseeded: may depend on what ran before (SpeculationLengthPolicy.reset)
    batch_chosen: bool  # k comes from the batch-level auto policy (BatchedGenerator._choose)
    num_samples: int
    on_commit: OnCommit | None = field(default=None, repr=False)
    start: float = 0.0
    scope: Hashable = None  # whose earlier outputs a learning proposer may use (Proposer.reset)
    prefill_seconds: float = 0.0
    results: list[GenerationResult] = field(default_factory=list)
    num_prefilled: int = 0  # prompt tokens in the row's cache so far (chunked prefill)
    prefill_seconds_per_token: float | None = None  # its last prefill chunk's (the budget)
    sample: SampleDecoding | None = None  # None while the prompt is being prefilled

    def start_sample(self) -> None:
        """Begin the next sample (the first one's stats include the prefill)."""
        emit = None if self.on_commit is None else functools.partial(self.on_commit,
                                                                     len(self.results))
        self.sample = SampleDecoding(self.generator, self.prompt_token_ids, self.pipeline,
                                     self.rng, self.proposer, self.policy,
                                     observe_seconds=False, start=self.start,
                                     prefill_seconds=self.prefill_seconds, emit=emit)
        self.prefill_seconds = 0.0


RequestOutput = list[GenerationResult] | Exception
"""What :meth:`BatchedGenerator.step` returns for a finished request: its ``n`` results, or
the error that ended it (its parameters left nothing to sample, say)."""


class BatchedGenerator:
    """Exact speculative decoding of many sequences at once on one target.

    Args:
        generator: the single-sequence engine whose target, proposer, k and policy rows use
            by default (each row gets its own copy of the proposer and the policy; a request
            may bring another generator on the same target, see :meth:`submit`).
        max_batch_size: most rows decoded together (≥ 1); more requests wait in order.
    Raises:
        ValueError: if the proposer is not ``batchable`` (a draft model or early exit: one model
            cache; prompt lookup and suffix are) and ``max_batch_size`` > 1, or
            ``max_batch_size`` < 1 or above what the backend holds.
        UnsupportedModelError: if the target scores a sequence in a batch differently from
            alone (``sequences_invariant`` False, measured on first use) and the generator
            was not made with ``allow_batch_variance``.
    """

    def __init__(self, generator: SpeculativeGenerator,
                 max_batch_size: int = DEFAULT_MAX_BATCH_SIZE) -> None:
        target = generator.target
        if (not isinstance(max_batch_size, int) or isinstance(max_batch_size, bool)
                or max_batch_size < 1):
            raise ValueError(f"max_batch_size = {max_batch_size!r} is invalid: it must be an "
                             "integer ≥ 1")
        try:
            target.reserve(max_batch_size)
        except ValueError as error:
            raise ValueError(f"max_batch_size = {max_batch_size} is invalid: {error}") from None
        self.target: Backend = target
        self.max_batch_size = max_batch_size
        self._check(generator)
        if not generator.allow_batch_variance and not target.sequences_invariant:
            raise UnsupportedModelError(
                f"this backend ({target.description}) scores a sequence differently when other "
                "sequences share its forward pass, so batched decoding would not reproduce "
                "decoding it alone; batching is refused (allow_batch_variance=True batches "
                "anyway, exact only up to rounding)")
        self.generator = generator
        self._waiting: deque[_Row] = deque()
        self._active: list[_Row] = []
        self._stepping = False
        self._cancelled: set[int] = set()  # cancelled during a step (from a callback)
        self.costs = ForwardCost(max_batch_size * (generator.num_speculative_tokens + 1))
        """Seconds of a packed forward over N tokens, measured (the batch-level auto policy)."""
        self._decode_cycle_seconds: float | None = None  # a decoding cycle's, moving average
        self._prefill_credit = 0.0  # seconds of prefill the decoding rows can spare now

    @property
    def num_active(self) -> int:
        """Rows being decoded now."""
        return len(self._active)

    @property
    def num_waiting(self) -> int:
        """Requests submitted but not started (the batch is full)."""
        return len(self._waiting)

    def is_active(self, request_id: int) -> bool:
        """Whether the request is being decoded (not waiting, not finished)."""
        return any(row.request_id == request_id for row in self._active)

    def generate(self, prompts: Sequence[str | Sequence[int]],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 chat: bool = False) -> list[GenerationResult]:
        """Decode every prompt, at most ``max_batch_size`` at a time, and return their results
        in order.

        Args:
            prompts: ``[num_requests]`` texts or token-id lists.
            params: one :class:`SamplingParams` for all, or one per prompt (default greedy).
            chat: wrap text prompts in the model's chat template.
        Returns:
            ``[num_requests]`` :class:`GenerationResult`, one per prompt; each one's
            ``stats`` time the row's own wall time (prefill included), so its TPOT is the
            latency its client would see.
        Raises:
            ValueError: as :meth:`SpeculativeGenerator.generate`, for any prompt (before any
                decoding; none is left queued), when ``params`` is a list of another length,
                or while requests submitted with :meth:`submit` are pending; or the first
                error a request ended with.
            TypeError: if ``prompts`` is one prompt (a text or token ids), not a list.
        """
        if isinstance(prompts, str) or (prompts and not isinstance(prompts[0], (str, Sequence))):
            raise TypeError("prompts must be a list of prompts (texts or token-id lists), "
                            f"not {type(prompts).__name__} of {type(prompts[0]).__name__}")
        if self._waiting or self._active:
            raise ValueError(f"generate() decodes its own requests only, and "
                             f"{self.num_waiting + self.num_active} submitted ones are pending: "
                             "step() until they finish first")
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one "
                             "for all or one per prompt")
        ids: list[int] = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.submit(prompt, p, chat=chat))
        except Exception:
            for request_id in ids:  # all or nothing
                self.cancel(request_id)
            raise
        outputs: dict[int, RequestOutput] = {}
        while self._waiting or self._active:
            outputs.update(self.step())
        for output in outputs.values():
            if isinstance(output, Exception):
                raise output
        return [outputs[i][0] for i in ids]

    def submit(self, prompt: Prompt | Request, params: SamplingParams | None = None, *,
               n: int = 1, chat: bool = False, on_commit: OnCommit | None = None,
               rng: torch.Generator | None = None,
               generator: SpeculativeGenerator | None = None, scope: Hashable = None) -> int:
        """Queue one request; it joins the batch at the next :meth:`step` with room.

        Args:
            prompt, params, chat: as :meth:`SpeculativeGenerator.generate`; or ``prompt``
                is a :class:`~exactspec.request.Request` already prepared (by
                :func:`~exactspec.request.prepare_request`: the server checks a request
                before queueing it), whose own parameters and ``n`` then apply.
            n: samples of this prompt, decoded one after another in the request's row on one
                ``rng``, so a seeded request gives what ``generate_samples(n=n)`` gives.
            on_commit: called after every cycle that emitted tokens for this request, with
                the sample's index and those tokens (for streaming).
            rng: the request's random source (default: seeded from ``params.seed``, random
                without one). Given with an unseeded ``params``, the request is treated as
                unseeded (its k may follow the batch) but its draws are reproducible: the
                audit samples the serving path this way.
            generator: the proposer, k and policy of this request (default: the batch's);
                its target must be the batch's.
            scope: as :meth:`SpeculativeGenerator.generate_samples` (whose earlier outputs
                a learning proposer may use and feed).
        Returns:
            the request's id, the key of its output in what :meth:`step` returns.
        Raises:
            ValueError, TypeError: as :meth:`SpeculativeGenerator.generate_samples`, or for a
                generator on another target or with a proposer that is not batchable.
        """
        generator = self.generator if generator is None else generator
        self._check(generator)
        request = (prompt if isinstance(prompt, Request)
                   else prepare_request(self.target, prompt, params, n=n, chat=chat))
        start = time.perf_counter() if request is prompt else request.start  # from submission
        proposer = generator.proposer
        if proposer is not None and proposer.batchable:
            proposer = copy.copy(proposer)  # see Proposer.batchable; reset when it starts
        policy = copy.deepcopy(generator.policy)
        policy.reset(timed=False)  # a forward's time is the batch's: see the module docstring
        row = _Row(
            request_id=new_sequence_id(), generator=generator,
            prompt_token_ids=request.prompt_token_ids, pipeline=request.pipeline,
            rng=request.rng if rng is None else rng, proposer=proposer, policy=policy,
            timed=request.timed, batch_chosen=policy.follows_batch and request.timed,
            num_samples=request.n, on_commit=on_commit, start=start, scope=scope)
        self._waiting.append(row)
        return row.request_id

    def cancel(self, request_id: int) -> None:
        """Drop a request, waiting or active, without an output (no error if it is gone).
        Called from an ``on_commit`` callback, it takes effect at the end of the cycle."""
        if self._stepping:
            self._cancelled.add(request_id)
            return
        self._waiting = deque(row for row in self._waiting if row.request_id != request_id)
        if any(row.request_id == request_id for row in self._active):
            self.target.release(request_id)
            self._active = [row for row in self._active if row.request_id != request_id]

    def step(self) -> dict[int, RequestOutput]:
        """One cycle for every active row (after admitting waiting requests while there is
        room, and prefilling a chunk of joining prompts, see :meth:`_prefill`): choose k,
        draft, one packed target forward, verify, commit, roll back.

        Returns:
            the outputs of the requests that finished in this cycle, by request id: their
            results, or the error that ended one (the others go on). An error of the forward
            itself ends every request in it.
        """
        self._stepping = True
        try:
            with torch_threads(1):  # host-side work; the backend chooses its own (threads.py)
                finished = self._cycle()
        finally:
            self._stepping = False
        for request_id in finished:
            self.target.release(request_id)
        self._active = [row for row in self._active if row.request_id not in finished]
        for request_id in self._cancelled:
            finished.pop(request_id, None)
            self.cancel(request_id)
        self._cancelled.clear()
        return finished

    def _cycle(self) -> dict[int, RequestOutput]:
        """:meth:`step` but the clean-up; every error is one request's output."""
        finished: dict[int, RequestOutput] = self._admit()
        self._prefill(finished)
        decode_start = time.perf_counter()
        live = []  # (row, room): rows with room for at least one more token
        for row in self._active:
            if row.request_id in finished or row.sample is None:
                continue
            try:
                room = row.sample.room()
                if room:
                    live.append((row, room))
                else:
                    self._end_sample(row, finished)
            except Exception as error:
                finished[row.request_id] = error
        drafted, inputs = [], []  # rows that drafted, (sequence id, [last, drafts…]) each
        for (row, room), choice in zip(live, self._choose(live, finished)):
            if row.request_id in finished:
                continue
            try:
                inputs.append((row.request_id, row.sample.draft(choice, room)))
                drafted.append(row)
            except Exception as error:
                finished[row.request_id] = error
        if not drafted:
            return finished
        t0 = time.perf_counter()
        try:
            all_logits = self.target.forward(inputs)
        except Exception as error:
            finished.update((row.request_id, error) for row in drafted)
            return finished
        forward_seconds = time.perf_counter() - t0
        self.costs.observe(sum(len(ids) for _, ids in inputs), forward_seconds)
        for row, logits in zip(drafted, all_logits):
            if row.request_id in self._cancelled:
                continue
            try:
                self.target.retain(row.request_id, logits.shape[0],
                                   row.sample.verify_and_commit(logits, forward_seconds))
                if row.sample.finish_reason is not None:
                    self._end_sample(row, finished)
            except Exception as error:
                finished[row.request_id] = error
        seconds = time.perf_counter() - decode_start
        old = self._decode_cycle_seconds
        self._decode_cycle_seconds = seconds if old is None else 0.8 * old + 0.2 * seconds
        return finished

    def _check(self, generator: SpeculativeGenerator) -> None:
        if generator.target is not self.target:
            raise ValueError("a request's generator must run on the batch's target")
        proposer = generator.proposer
        if proposer is not None and proposer.drafts_trees:
            raise ValueError(f"{type(proposer).__name__} drafts token trees, which are scored "
                             "one sequence per forward pass; batched decoding packs chains: "
                             "draft a chain (a head without tree=) here")
        if proposer is not None and not proposer.batchable and self.max_batch_size > 1:
            raise ValueError(f"{type(proposer).__name__} keeps a model cache of its own and "
                             f"drafts for one sequence at a time: use max_batch_size = 1 with "
                             "it (proposers for several rows: prompt-lookup, suffix)")

    def admit(self) -> dict[int, RequestOutput]:
        """Start waiting requests while there is room (their prompts are prefilled in the
        next steps, see :meth:`_prefill`); :meth:`step` does it first anyway, this lets a
        caller see which are active before the cycle.

        Returns:
            the errors of those whose prefill failed, by request id (they are dropped).
        """
        failed = self._admit()
        for request_id in failed:
            self.target.release(request_id)
        self._active = [row for row in self._active if row.request_id not in failed]
        return failed

    def _admit(self) -> dict[int, RequestOutput]:
        """:meth:`admit` without dropping the failed rows."""
        failed: dict[int, RequestOutput] = {}
        while self._waiting and len(self._active) < self.max_batch_size:
            row = self._waiting.popleft()
            self._active.append(row)
            try:
                self.target.prefill(row.request_id, [])
            except Exception as error:
                failed[row.request_id] = error
        return failed

    def _prefill(self, finished: dict[int, RequestOutput]) -> None:
        """Prefill the prompts of rows that joined, in chunks of ``prefill_chunk_size``
        tokens (chunked prefill: Agrawal et al. 2023, "Sarathi"), the prompts with the
        fewest tokens left first, within a budget of *time*, not tokens (vLLM's
        ``max_num_batched_tokens`` plays this role): while other rows decode, each cycle
        adds :data:`PREFILL_SHARE` × the measured seconds of a decoding cycle to a credit,
        and a chunk runs when the credit covers its estimated seconds (the row's last chunk
        per token, × its tokens), so prefill takes at most about that share of the time
        and the decoding rows' time per token stays within about (1 + share)× its idle
        value; with no row decoding, chunks run until :data:`PREFILL_SECONDS_ALONE` (at
        least one), so a request arriving meanwhile joins soon. The chunks start at
        multiples of the chunk size whatever the budget, so the cache is bit for bit the
        one-call prefill's (``Backend.prefill``). A row whose prompt is in starts its first
        sample."""
        joining = [row for row in self._active
                   if row.sample is None and row.request_id not in finished]
        if not joining:
            self._prefill_credit = 0.0
            return
        decoding = any(row.sample is not None and row.request_id not in finished
                       for row in self._active)
        if decoding and self._decode_cycle_seconds is not None:
            self._prefill_credit += PREFILL_SHARE * self._decode_cycle_seconds
            budget = self._prefill_credit
        else:
            budget = PREFILL_SECONDS_ALONE
        spent = self._prefill_rows(joining, budget, at_least_one=not decoding,
                                   finished=finished)
        if decoding:
            self._prefill_credit -= spent

    def _prefill_rows(self, joining: list[_Row], budget: float, at_least_one: bool,
                      finished: dict[int, RequestOutput]) -> float:
        """Prefill chunks of ``joining``'s prompts, fewest tokens left first, while their
        estimated seconds fit ``budget`` (``at_least_one``: the first chunk runs whatever
        it costs); returns the seconds spent. A row whose prompt is in starts its first
        sample; a row whose prefill fails gets its error in ``finished``."""
        chunk = self.target.prefill_chunk_size
        known = [row.prefill_seconds_per_token for row in self._active
                 if row.prefill_seconds_per_token is not None]
        spent = 0.0
        for row in sorted(joining, key=lambda row: len(row.prompt_token_ids) - row.num_prefilled):
            end = len(row.prompt_token_ids) - 1  # the cache holds all but the last token
            try:
                while row.num_prefilled < end:
                    size = min(chunk, end - row.num_prefilled)
                    per_token = (row.prefill_seconds_per_token if row.prefill_seconds_per_token
                                 is not None else min(known, default=0.0))
                    if spent + per_token * size > budget and (spent > 0 or not at_least_one):
                        return spent
                    t0 = time.perf_counter()
                    self.target.prefill(
                        row.request_id,
                        row.prompt_token_ids[row.num_prefilled:row.num_prefilled + size])
                    seconds = time.perf_counter() - t0
                    row.prefill_seconds += seconds
                    row.prefill_seconds_per_token = seconds / size
                    row.num_prefilled += size
                    spent += seconds
                if row.proposer is not None:  # a shared one (batch size 1) is the row's now
                    row.proposer.reset(reproducible=not row.timed, scope=row.scope)
                    row.proposer.follow(row.request_id)
                row.start_sample()
            except Exception as error:
                finished[row.request_id] = error
        return spent

    def _choose(self, live: list[tuple[_Row, int]],
                finished: dict[int, RequestOutput]) -> list[Choice]:
        """Each live row's choice: rows under ``auto`` that may be timed (greedy or unseeded)
        get k from :func:`batch_speculation_lengths` over the batch's measured forward cost;
        the others (seeded sampling, other policies) choose on their own, as alone. A row
        whose policy fails gets its error in ``finished`` (and a plain step)."""
        choices: list[Choice] = [PLAIN_STEP] * len(live)
        batch_chosen, fixed_tokens, fixed_expected = [], 0, 0.0
        for i, (row, room) in enumerate(live):
            if row.batch_chosen and row.sample.k_max:
                batch_chosen.append(i)
                continue
            try:
                choices[i] = row.sample.choose()
            except Exception as error:
                finished[row.request_id] = error
                continue
            k = min(choices[i].k, room - 1)
            fixed_tokens += k + 1
            fixed_expected += 1 + sum(survival(row.policy.acceptance()[:k]))
        if batch_chosen:
            ks = batch_speculation_lengths(
                [live[i][0].policy.acceptance() for i in batch_chosen],
                [min(live[i][0].sample.k_max, live[i][1] - 1) for i in batch_chosen],
                self.costs, fixed_tokens, fixed_expected)
            for i, k in zip(batch_chosen, ks):
                choices[i] = live[i][0].policy.choice(k)
        return choices

    def _end_sample(self, row: _Row, finished: dict[int, RequestOutput]) -> None:
        """Record ``row``'s finished sample; start its next one, or finish the request."""
        row.results.append(row.sample.result())
        if len(row.results) == row.num_samples:
            finished[row.request_id] = row.results
            return
        self.target.rollback(row.request_id, self.target.num_cached_tokens(row.request_id)
                                      - (len(row.prompt_token_ids) - 1))
        row.start = time.perf_counter()
        row.start_sample()
