"""Batched speculative decoding: many sequences advance together, one target forward per cycle.

Each cycle every active row drafts on its own (its own proposer state, policy, k, possibly
none; a draft model's forwards for all rows packed, one per drafted position,
:func:`run_packed`), one packed forward of the target scores every row's ``[last, d_1 .. d_k]``
(:meth:`~exactspec.backends.base.Backend.forward`), and each row is verified,
committed and rolled back on its own, exactly as :class:`~exactspec.generator.SpeculativeGenerator`
does for one sequence (each row the same :class:`~exactspec.generator.SequenceState`). Rows join
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
import time
from collections import deque
from collections.abc import Collection, Generator, Hashable, Sequence
from typing import TypeVar

import torch

from exactspec.backends.base import Backend, UnsupportedModelError, new_sequence_id
from exactspec.generator import (PLAIN_STEP, GenerationResult, OnCommit, SequenceState,
                                 SpeculativeGenerator)
from exactspec.load_options import DEFAULT_MAX_BATCH_SIZE
from exactspec.proposers.base import ModelStep
from exactspec.request import Prompt, Request, prepare_request
from exactspec.sampling import SamplingParams
from exactspec.speculation_length import Choice, ForwardCost, batch_speculation_lengths, survival
from exactspec.threads import torch_threads

PREFILL_SHARE = 0.8
"""While rows decode, prefill gets this many seconds per second of decoding (at most), so
their time per token stays within about (1 + this)× its value without prefill."""
PREFILL_MAX_WAIT = 2.0
"""A joining prompt whose request started this many seconds ago is prefilled before those
with fewer tokens left (the oldest such first): fewest-tokens-first alone starves a long
prompt while shorter ones keep arriving (in a serve load test, 50 s to a first token)."""
PREFILL_SECONDS_ALONE = 0.25
"""With no row decoding, prefill chunks run each cycle until this many seconds are spent
(at least one chunk), so that a request arriving meanwhile waits at most about this."""


T = TypeVar("T")
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
        ValueError: if the proposer is not ``batchable`` (every one exactspec builds is:
            a proposer of the caller's own may not be) and ``max_batch_size`` > 1, or
            ``max_batch_size`` < 1 or above what the backend (or the proposer's model) holds.
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
        self._waiting: deque[SequenceState] = deque()
        self._active: list[SequenceState] = []
        self._stepping = False
        self._cancelled: set[int] = set()  # cancelled during a step (from a callback)
        self.costs = ForwardCost(max_batch_size * (generator.num_speculative_tokens + 1))
        """Seconds of a packed forward over N tokens, measured (the batch-level auto policy)."""
        self.draft_costs = ForwardCost(generator.num_speculative_tokens, prior=float)
        """Seconds of a cycle's drafting (every row's, a draft model's forwards packed) by
        its longest draft, measured (the batch-level auto policy's shared draft cost)."""
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
        return any(row.sequence_id == request_id for row in self._active)

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
        # untimed policy (alone=False): a forward's time is the batch's (module docstring)
        row = SequenceState(generator, request, new_sequence_id(), proposer,
                            copy.deepcopy(generator.policy), alone=False, rng=rng,
                            on_commit=on_commit, scope=scope, start=start)
        self._waiting.append(row)
        return row.sequence_id

    def cancel(self, request_id: int) -> None:
        """Drop a request, waiting or active, without an output (no error if it is gone).
        Called from an ``on_commit`` callback, it takes effect at the end of the cycle."""
        if self._stepping:
            self._cancelled.add(request_id)
            return
        self._waiting = deque(row for row in self._waiting if row.sequence_id != request_id)
        self._drop({request_id})

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
        self._drop(finished)
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
            if row.sequence_id in finished or not row.prefilled:
                continue
            try:
                if room := row.room():
                    live.append((row, room))
                else:
                    finished[row.sequence_id] = row.results
            except Exception as error:
                finished[row.sequence_id] = error
        drafting = [(row, row.sample.draft_steps(choice, room))
                    for (row, room), choice in zip(live, self._choose(live, finished))
                    if row.sequence_id not in finished]
        drafted, inputs = [], []  # rows that drafted, (sequence id, [last, drafts…], parents)
        t0 = time.perf_counter()
        blocks = run_packed([steps for _, steps in drafting])
        longest = max((len(b) - 1 for b in blocks if not isinstance(b, Exception)), default=0)
        if longest:
            self.draft_costs.observe(longest, time.perf_counter() - t0)
        for (row, _), block in zip(drafting, blocks):
            if isinstance(block, Exception):
                finished[row.sequence_id] = block
                continue
            inputs.append((row.sequence_id, block, row.sample.tree_parents()))
            drafted.append(row)
        if not drafted:
            return finished
        t0 = time.perf_counter()
        try:
            if any(parents is not None for _, _, parents in inputs):  # a row drafted a tree
                all_logits = self.target.forward_trees(inputs)
            else:
                all_logits = self.target.forward([(i, block) for i, block, _ in inputs])
        except Exception as error:
            finished.update((row.sequence_id, error) for row in drafted)
            return finished
        forward_seconds = time.perf_counter() - t0
        self.costs.observe(sum(len(ids) for _, ids, _ in inputs), forward_seconds)
        for row, logits in zip(drafted, all_logits):
            if row.sequence_id in self._cancelled:
                continue
            try:
                row.verify_and_commit(logits, forward_seconds)
                if row.done:
                    finished[row.sequence_id] = row.results
            except Exception as error:
                finished[row.sequence_id] = error
        seconds = time.perf_counter() - decode_start
        old = self._decode_cycle_seconds
        self._decode_cycle_seconds = seconds if old is None else 0.8 * old + 0.2 * seconds
        return finished

    def _drop(self, request_ids: Collection[int]) -> None:
        """Remove these active rows, freeing their sequences in the target and in their
        proposer's model (``Proposer.release``)."""
        for row in self._active:
            if row.sequence_id in request_ids:
                self.target.release(row.sequence_id)
                if row.proposer is not None:
                    row.proposer.release()
        self._active = [row for row in self._active if row.sequence_id not in request_ids]

    def _check(self, generator: SpeculativeGenerator) -> None:
        """Refuse a generator this batch cannot run; make room in its proposer's model for
        a row each (``Proposer.reserve``)."""
        if generator.target is not self.target:
            raise ValueError("a request's generator must run on the batch's target")
        proposer = generator.proposer
        if proposer is None:
            return
        if not proposer.batchable and self.max_batch_size > 1:
            raise ValueError(f"{type(proposer).__name__} is not batchable (it drafts for one "
                             "sequence at a time): use max_batch_size = 1 with it, or make it "
                             "batchable (Proposer.batchable)")
        try:
            proposer.reserve(self.max_batch_size)
        except ValueError as error:
            raise ValueError(f"max_batch_size = {self.max_batch_size} is invalid for the "
                             f"proposer's model: {error}") from None

    def admit(self) -> dict[int, RequestOutput]:
        """Start waiting requests while there is room (their prompts are prefilled in the
        next steps, see :meth:`_prefill`); :meth:`step` does it first anyway, this lets a
        caller see which are active before the cycle.

        Returns:
            the errors of those whose prefill failed, by request id (they are dropped).
        """
        failed = self._admit()
        self._drop(failed)
        return failed

    def _admit(self) -> dict[int, RequestOutput]:
        """:meth:`admit` without dropping the failed rows."""
        failed: dict[int, RequestOutput] = {}
        while self._waiting and len(self._active) < self.max_batch_size:
            row = self._waiting.popleft()
            self._active.append(row)
            try:
                row.prefill(0)  # creates the sequence: a failure shows now
            except Exception as error:
                failed[row.sequence_id] = error
        return failed

    def _prefill(self, finished: dict[int, RequestOutput]) -> None:
        """Prefill the prompts of rows that joined, in chunks of ``prefill_chunk_size``
        tokens (chunked prefill: Agrawal et al. 2023, "Sarathi"), the prompts with the
        fewest tokens left first but those waiting :data:`PREFILL_MAX_WAIT` seconds or more
        before them (oldest first), within a budget of *time*, not tokens (vLLM's
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
                   if not row.prefilled and row.sequence_id not in finished]
        if not joining:
            self._prefill_credit = 0.0
            return
        decoding = any(row.prefilled and row.sequence_id not in finished
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

    def _prefill_rows(self, joining: list[SequenceState], budget: float, at_least_one: bool,
                      finished: dict[int, RequestOutput]) -> float:
        """Prefill chunks of ``joining``'s prompts, those waiting :data:`PREFILL_MAX_WAIT`
        seconds or more first (oldest first), then the fewest tokens left first, while their
        estimated seconds fit ``budget`` (``at_least_one``: the first chunk runs whatever
        it costs); returns the seconds spent. A row whose prompt is in starts its first
        sample; a row whose prefill fails gets its error in ``finished``."""
        chunk = self.target.prefill_chunk_size
        known = [row.prefill_seconds_per_token for row in self._active
                 if row.prefill_seconds_per_token is not None]
        spent, now = 0.0, time.perf_counter()

        def priority(row: SequenceState) -> tuple[int, float]:
            if now - row.start >= PREFILL_MAX_WAIT:
                return 0, row.start
            return 1, row.num_tokens_to_prefill

        for row in sorted(joining, key=priority):
            try:
                while not row.prefilled:
                    size = min(chunk, row.num_tokens_to_prefill)
                    per_token = (row.prefill_seconds_per_token if row.prefill_seconds_per_token
                                 is not None else min(known, default=0.0))
                    if spent + per_token * size > budget and (spent > 0 or not at_least_one):
                        return spent
                    spent += row.prefill(size)
            except Exception as error:
                finished[row.sequence_id] = error
        return spent

    def _shared_draft_cost(self, k: int) -> float:
        """Seconds of a cycle's drafting whose longest draft is ``k`` (:attr:`draft_costs`;
        0 for k = 0 and before any is measured)."""
        return self.draft_costs(k) if k and self.draft_costs.fresh() else 0.0

    def _choose(self, live: list[tuple[SequenceState, int]],
                finished: dict[int, RequestOutput]) -> list[Choice]:
        """Each live row's choice: rows under ``auto`` that may be timed (greedy or unseeded)
        get k from :func:`batch_speculation_lengths` over the batch's measured forward cost;
        the others (seeded sampling, other policies) choose on their own, as alone. A row
        whose policy fails gets its error in ``finished`` (and a plain step)."""
        choices: list[Choice] = [PLAIN_STEP] * len(live)
        batch_chosen, fixed_tokens, fixed_expected, fixed_longest = [], 0, 0.0, 0
        for i, (row, room) in enumerate(live):
            if row.policy.follows_batch and row.timed and row.sample.num_speculative_tokens:
                batch_chosen.append(i)
                continue
            try:
                choices[i] = row.sample.choose()
            except Exception as error:
                finished[row.sequence_id] = error
                continue
            k = min(choices[i].k, room - 1)
            fixed_tokens += k + 1
            fixed_longest = max(fixed_longest, k)
            fixed_expected += 1 + sum(survival(row.policy.acceptance()[:k]))
        if batch_chosen:
            ks = batch_speculation_lengths(
                [live[i][0].policy.acceptance() for i in batch_chosen],
                [min(live[i][0].sample.num_speculative_tokens, live[i][1] - 1)
                 for i in batch_chosen],
                self.costs, fixed_tokens, fixed_expected,
                [live[i][0].policy.draft_cost for i in batch_chosen],
                self._shared_draft_cost, fixed_longest)
            for i, k in zip(batch_chosen, ks):
                choices[i] = live[i][0].policy.choice(k)
        return choices


def run_packed(steps: Sequence[Generator[ModelStep, torch.Tensor, T]]) -> list[T | Exception]:
    """Run several rows' work in steps together (each row's cycle of drafting,
    ``SampleDecoding.draft_steps``): the rows waiting on a forward of the same model are
    scored in one packed ``forward`` (``num_logits=1``), one per drafted position, where
    that model is ``sequences_invariant`` (each row's logits then bit for bit its own
    alone; else each runs alone), and each is sent its own logits.

    Args:
        steps: ``[rows]`` generators that yield :class:`~exactspec.proposers.base.ModelStep`
            s (each row's sequence at most once a round).
    Returns:
        ``[rows]`` what each generator returned, or the error that ended it (an error of a
        packed forward ends every row in it).
    """
    outputs: list[T | Exception | None] = [None] * len(steps)
    waiting: dict[int, ModelStep] = {}

    def advance(i: int, logits: torch.Tensor | None) -> None:
        try:
            waiting[i] = steps[i].send(logits)
        except StopIteration as stop:
            outputs[i] = stop.value
        except Exception as error:
            outputs[i] = error

    for i in range(len(steps)):
        advance(i, None)
    while waiting:
        by_model: dict[int, list[tuple[int, ModelStep]]] = {}
        for i, step in waiting.items():
            by_model.setdefault(id(step.backend), []).append((i, step))
        waiting.clear()
        for group in by_model.values():
            backend = group[0][1].backend
            together = len(group) > 1 and backend.sequences_invariant
            for part in [group] if together else [[item] for item in group]:
                try:
                    logits = backend.forward([(step.sequence_id, step.token_ids)
                                              for _, step in part], num_logits=1)
                except Exception as error:
                    for i, _ in part:
                        outputs[i] = error
                        steps[i].close()
                    continue
                for (i, _), row_logits in zip(part, logits):
                    advance(i, row_logits)
    return outputs
