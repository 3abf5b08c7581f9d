"""The speculative decoding loop for one sequence: draft → verify → commit → rollback.

Source: Leviathan et al. 2022 (arXiv 2211.17192), Algorithm 1, one cycle per iteration of
the loop in :meth:`SpeculativeGenerator._decode`. The target's KV cache always holds every
token of the context except the last one, so each cycle scores ``[last, d_1 .. d_k]`` in
one forward pass: row i of the logits is the target's distribution for position i + 1,
and row k gives the bonus token. After verification the cache is cut back to the context
minus its new last token. With k = 0 (or no proposer) the same loop is plain decoding.

The engine is the one owner of the committed length: ``SampleDecoding.tokens`` (prompt +
committed) is the only record of a sample; proposers and backends follow it. Per sequence
there is one state, :class:`SequenceState` (prefill, the request's samples, its proposer
and policy, the cache's rollback), holding the sample being decoded, a
:class:`SampleDecoding` (one sample's half of each cycle); decoding one sequence (here, a
batch of one) and many in one packed forward (:mod:`exactspec.batching`) drive the same
states and differ only in the forward.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Generator, Hashable
from dataclasses import asdict, dataclass
from typing import Literal

import torch

from exactspec.backends.base import Backend, UnsupportedModelError, forward_one, new_sequence_id
from exactspec.cycle_trace import CycleTrace, trace_cycle
from exactspec.logits_pipeline import LogitsPipeline
from exactspec.generation_stats import GenerationStats
from exactspec.proposers.base import (EMPTY_PROPOSAL, ModelStep, Proposer, proposal_steps,
                                      run_alone)
from exactspec.proposers.forced import ForcedTokenProposer
from exactspec.request import Prompt, Request, prepare_request
from exactspec.sampling import SamplingParams
from exactspec.speculation_length import (DEFAULT_POLICY, Choice, SpeculationLengthPolicy,
                                          make_policy)
from exactspec.threads import torch_threads
from exactspec.text import StopChecker
from exactspec.verification import TokenLogprob, rejection_sample, verify, verify_tree

FinishReason = Literal["stop", "length"]
OnCommit = Callable[[int, list[int]], None]
"""Called after each cycle with (sample index, the tokens that cycle emitted)."""
PLAIN_STEP = Choice(0)
"""The cycle of plain decoding (no proposer, or num_speculative_tokens = 0)."""


@dataclass
class GenerationResult:
    """The output of one generation.

    Attributes:
        text: ``decode(token_ids)``, special tokens left out. When a stop string ended
            generation the text ends with it (``stop_reason`` names it).
        token_ids: ``[num_generated_tokens]`` generated ids, ending with the EOS or the
            token that completed a stop string when one ended generation.
        finish_reason: ``"stop"`` (EOS or stop string) or ``"length"`` (max_new_tokens or
            the model's context limit).
        stop_reason: the EOS id or the stop string that ended generation, else None.
        logprobs: ``[num_generated_tokens]`` one :class:`TokenLogprob` per token (accepted,
            recovered and bonus alike), when ``SamplingParams.logprobs`` is set; else None.
        prompt_token_ids: the prompt as the model saw it (chat template applied).
        stats: counts and timings, see :class:`~exactspec.generation_stats.GenerationStats`.
        trace: one :class:`~exactspec.cycle_trace.CycleTrace` per cycle when generation
            was asked for a trace (``trace=True``); else None.
        stop_offset: where the stop string that ended generation begins in ``text``
            (characters; ``text[:stop_offset]`` is the text before it), else None.
    """

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stop_reason: int | str | None
    prompt_token_ids: list[int]
    stats: GenerationStats
    logprobs: list[TokenLogprob] | None = None
    trace: list[CycleTrace] | None = None
    stop_offset: int | None = None

    @property
    def usage(self) -> dict[str, int]:
        """OpenAI-style token counts: prompt_tokens, completion_tokens, total_tokens."""
        return {"prompt_tokens": len(self.prompt_token_ids),
                "completion_tokens": len(self.token_ids),
                "total_tokens": len(self.prompt_token_ids) + len(self.token_ids)}

    def to_dict(self) -> dict:
        """Every field, with ``stats`` expanded to all its figures (JSON-serialisable)."""
        logprobs = None if self.logprobs is None else [
            {"token_id": lp.token_id, "logprob": lp.logprob,
             "top_logprobs": [{"token_id": t, "logprob": v} for t, v in lp.top]}
            for lp in self.logprobs]
        return asdict(self) | {"stats": self.stats.to_dict(), "logprobs": logprobs,
                               "usage": self.usage,
                               "trace": None if self.trace is None else [
                                   cycle.to_dict() for cycle in self.trace]}


class SampleDecoding:
    """One sample being decoded, and the half of each cycle that belongs to one sequence.

    A cycle is choose → draft → target forward → verify → commit → rollback → observe
    (docs/design.md, "One direction of data flow"). This class does every step but the
    target forward and the rollback of the target's cache, which belong to whoever drives
    it: :class:`SpeculativeGenerator` for one sequence, one forward per cycle;
    :class:`~exactspec.batching.BatchedGenerator` for many, one packed forward per cycle.
    ``tokens`` (prompt + committed) is the one record of the sequence.

    Args:
        generator: the engine whose target, stochastic verifier (``rejection_sampler``) and
            num_speculative_tokens the sample uses.
        prompt_token_ids: ``[prompt_len]`` the prompt as the model sees it.
        pipeline: the sample's logits processing (its :class:`SamplingParams`).
        rng: its random source.
        proposer, policy: its proposer (None: plain decoding) and speculation-length policy.
        observe_seconds: give the policy the cycle's seconds (a forward timed for this
            sequence alone; False in a batch, where a forward's time is the batch's).
        start: ``time.perf_counter()`` when the request started (TTFT, total seconds).
        prefill_seconds: recorded in the stats (0 for a sample after the first).
        emit: called with the tokens each cycle emitted (streaming), or None.
        trace: a list to record every cycle in (:class:`CycleTrace`), or None.
    """

    def __init__(self, generator: SpeculativeGenerator, prompt_token_ids: list[int],
                 pipeline: LogitsPipeline, rng: torch.Generator, proposer: Proposer | None,
                 policy: SpeculationLengthPolicy, *, observe_seconds: bool, start: float,
                 prefill_seconds: float = 0.0, emit: Callable[[list[int]], None] | None = None,
                 trace: list[CycleTrace] | None = None) -> None:
        params = pipeline.params
        target = generator.target
        self.generator, self.pipeline, self.rng = generator, pipeline, rng
        self.proposer, self.policy, self.observe_seconds = proposer, policy, observe_seconds
        self.start, self.emit, self.trace = start, emit, trace
        self.tokens = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.tokens)
        self.num_speculative_tokens = generator.num_speculative_tokens
        self.stats = GenerationStats(num_speculative_tokens=self.num_speculative_tokens,
                                     policy=policy.name if self.num_speculative_tokens else "none",
                                     num_prompt_tokens=self.num_prompt_tokens,
                                     prefill_seconds=prefill_seconds)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos
                                                 else set(target.eos_token_ids))
        self.stopper = StopChecker(target.tokenizer, stop_ids, params.stop, params.min_new_tokens)
        self.context_limit = target.max_context_length or float("inf")
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.finish_reason: FinishReason | None = None
        self.proposal = self.peek = EMPTY_PROPOSAL
        self.chosen_k, self.num_forced, self.draft_seconds = 0, 0, 0.0

    def room(self) -> int:
        """Tokens the sample may still generate (max_new_tokens, the context limit); at 0
        the sample has finished (``finish_reason`` ``"length"``)."""
        generated = len(self.tokens) - self.num_prompt_tokens
        room = int(min(self.pipeline.params.max_new_tokens - generated,
                       self.context_limit - len(self.tokens)))
        if room <= 0:
            self.finish_reason = "length"
        return max(room, 0)

    def choose(self) -> Choice:
        """The policy's choice for the next cycle (a plain step without a proposer)."""
        return self.policy.choose() if self.num_speculative_tokens else PLAIN_STEP

    def draft(self, choice: Choice, room: int) -> list[int]:
        """Draft the constraint's forced tokens, if any, and ``choice.k`` tokens after them
        (together at most num_speculative_tokens, and ``room`` − 1 near the end), or peek
        on a plain step. Returns ``[k+1]`` the block the target scores:
        ``[last, d_1 .. d_k]``."""
        return run_alone(self.draft_steps(choice, room, in_steps=False))

    def draft_steps(self, choice: Choice, room: int, in_steps: bool = True
                    ) -> Generator[ModelStep, torch.Tensor, list[int]]:
        """:meth:`draft`, yielding the forwards of a proposer that ``drafts_in_steps``
        (:meth:`Proposer.propose_steps <exactspec.proposers.base.Proposer.propose_steps>`)
        for the caller to run: a batch packs its rows' (``draft_seconds`` is then the
        packed drafting's). ``in_steps`` False: the proposer's ``propose``, no step
        yielded (one sequence)."""
        self.chosen_k = min(choice.k, room - 1)
        t0 = time.perf_counter()
        most = min(self.num_speculative_tokens, room - 1)
        self.num_forced = 0 if self.proposer is None else min(
            self.proposer.num_forced(self.tokens, self.pipeline), most)
        k = min(self.num_forced + self.chosen_k, most)
        self.proposal = self.peek = EMPTY_PROPOSAL
        if k:
            args = (self.tokens, k, self.pipeline, self.rng, self.policy.min_confidence)
            self.proposal = ((yield from proposal_steps(self.proposer, *args)) if in_steps
                             else self.proposer.propose(*args))
        elif choice.peek:
            self.peek = self.proposer.propose(self.tokens, 1, self.pipeline, self.rng)  # never verified
        self.draft_seconds = time.perf_counter() - t0
        return [self.tokens[-1], *self.proposal.token_ids]

    def tree_parents(self) -> list[int] | None:
        """The parents of :meth:`draft`'s block as ``Backend.forward_tree`` takes them (row
        0 the last committed token) when the proposal is a token tree, else None."""
        parents = self.proposal.parents
        return None if parents is None else [-1, *(parent + 1 for parent in parents)]

    def verify_and_commit(self, logits: torch.Tensor, forward_seconds: float) -> list[int]:
        """Verify the drafts against ``logits`` (``[len(block), vocab]``, the target's scores
        of the block :meth:`draft` returned: a chain's, or a tree's from
        ``Backend.forward_tree``), commit up to the first stop, record the cycle, and let the
        proposer and the policy observe it; sets ``finish_reason`` on a stop.

        Returns:
            the rows of the block the target's cache keeps (``Backend.retain``): the last
            committed token's and the accepted drafts'.
        """
        proposal, generated = self.proposal, len(self.tokens) - self.num_prompt_tokens
        t0 = time.perf_counter()
        if proposal.parents is None:
            verified = verify(self.tokens, proposal.token_ids, proposal.probs, logits,
                              self.pipeline, self.rng, self.generator.rejection_sampler)
            kept, path_tokens = list(range(verified.num_accepted + 1)), proposal.token_ids
        else:
            verified = verify_tree(self.tokens, proposal.token_ids, proposal.parents, logits,
                                   self.pipeline, self.rng, self.generator.rejection_sampler)
            kept, path_tokens = [0, *verified.path], verified.committed[:-1]
        verify_seconds = forward_seconds + time.perf_counter() - t0
        committed, num_accepted = verified.committed, verified.num_accepted
        num_emitted = self._commit(committed, verified.logprobs)
        if self.trace is not None:  # a tree's trace shows the path it accepted
            self.trace.append(trace_cycle(
                self.stats.cycles, generated, self.chosen_k, path_tokens, proposal.probs,
                verified.processed, verified.target_probs, verified.uniforms,
                committed[:num_emitted], num_accepted, self.draft_seconds, verify_seconds))
        if self.num_speculative_tokens:
            self.proposer.observe(num_accepted)
            # the policy learns from its own drafts only, not from forced tokens (certain)
            timed = self.observe_seconds and not self.num_forced
            self.policy.observe(proposal.depth - self.num_forced,
                                max(0, num_accepted - self.num_forced),
                                self.draft_seconds if timed else None,
                                verify_seconds if timed else None)
            if self.peek.token_ids:
                self.policy.observe_peek(committed[0] == self.peek.token_ids[0])
        self.stats.record_cycle(proposal.depth, num_accepted, num_emitted, self.chosen_k,
                                draft_seconds=self.draft_seconds, verify_seconds=verify_seconds,
                                target_forward_seconds=forward_seconds,
                                num_tree_nodes=len(proposal) if proposal.parents else 0)
        if self.stats.cycles == 1:
            self.stats.ttft_seconds = time.perf_counter() - self.start
        if self.emit is not None and num_emitted:
            self.emit(self.tokens[len(self.tokens) - num_emitted:])
        return kept

    def _commit(self, committed: list[int], committed_logprobs: list[TokenLogprob] | None) -> int:
        """Append ``committed`` to ``tokens`` (and their logprobs) up to the first stop;
        returns the number emitted."""
        for num_emitted, token in enumerate(committed, start=1):
            self.tokens.append(token)
            if self.logprobs is not None:
                self.logprobs.append(committed_logprobs[num_emitted - 1])
            if self.stopper.is_stop(self.tokens, self.num_prompt_tokens):
                self.finish_reason = "stop"
                return num_emitted
        return len(committed)

    def result(self) -> GenerationResult:
        """The finished sample's :class:`GenerationResult` (tells the proposer it ended)."""
        self.stats.total_seconds = time.perf_counter() - self.start
        if self.proposer is not None:
            self.proposer.end_sequence(self.tokens, self.num_prompt_tokens)
        output = self.tokens[self.num_prompt_tokens:]
        return GenerationResult(
            text=self.generator.target.tokenizer.decode(output), token_ids=output,
            finish_reason=self.finish_reason, stop_reason=self.stopper.stop_reason,
            prompt_token_ids=self.tokens[:self.num_prompt_tokens], stats=self.stats,
            logprobs=self.logprobs, trace=self.trace, stop_offset=self.stopper.stop_offset)


class SequenceState:
    """One request in one sequence of the target, from its prompt's prefill to its last
    sample: the one state both drivers keep per sequence (as llama.cpp's
    ``common/speculative.cpp`` keeps one per sequence).

    It prefills the prompt (all at once or in chunks: the cache's bits are the same,
    ``Backend.prefill``), then decodes the request's ``n`` samples one after another on its
    one ``rng`` (as many independent continuations; the cache is rolled back to the prompt
    between them), each a :class:`SampleDecoding`; after every cycle it keeps the rows the
    target's cache retains (``Backend.retain``). It owns the request's proposer and policy
    (a batch gives each row copies of its own). What it does not do is the target forward:
    :class:`SpeculativeGenerator` runs one per cycle for one sequence (a batch of one),
    :class:`~exactspec.batching.BatchedGenerator` one packed forward for all its rows.

    Args:
        generator: the engine whose target, stochastic verifier and num_speculative_tokens
            the request uses.
        request: the prepared request (:func:`~exactspec.request.prepare_request`).
        sequence_id: the target's sequence to decode in (empty, or not yet created); the
            caller releases it.
        proposer, policy: the request's proposer (None: plain decoding; under a constraint
            it drafts after the constraint's forced tokens,
            :class:`~exactspec.proposers.forced.ForcedTokenProposer`) and policy.
        alone: the sequence has every forward to itself, so a request that may be timed
            (greedy or unseeded) lets its policy observe seconds; in a batch a forward's time
            is the batch's and the policy uses its prior cost model only.
        rng: the request's random source (default ``request.rng``).
        on_commit: called with (sample index, tokens) after every cycle that emitted tokens.
        scope: whose earlier outputs a learning proposer may use (``Proposer.reset``).
        trace: record every cycle of every sample (``GenerationResult.trace``).
        start: ``time.perf_counter()`` when the request started (default ``request.start``).
    """

    def __init__(self, generator: SpeculativeGenerator, request: Request, sequence_id: int,
                 proposer: Proposer | None, policy: SpeculationLengthPolicy, *, alone: bool,
                 rng: torch.Generator | None = None, on_commit: OnCommit | None = None,
                 scope: Hashable = None, trace: bool = False, start: float | None = None) -> None:
        self.generator, self.target, self.sequence_id = generator, generator.target, sequence_id
        self.prompt_token_ids, self.pipeline = request.prompt_token_ids, request.pipeline
        self.rng = request.rng if rng is None else rng
        self.num_samples, self.timed = request.n, request.timed
        if (proposer is not None and request.params.constraint is not None
                and not isinstance(proposer, ForcedTokenProposer)):
            proposer = ForcedTokenProposer(proposer)  # the constraint's forced tokens first
        self.proposer, self.policy = proposer, policy
        self.observe_seconds = alone and request.timed
        policy.reset(self.observe_seconds)
        self.on_commit, self.scope, self.trace = on_commit, scope, trace
        self.start = request.start if start is None else start
        self.num_prefilled = 0  # prompt tokens in the cache so far
        self.prefill_seconds = 0.0
        self.prefill_seconds_per_token: float | None = None  # the last chunk's
        self.sample: SampleDecoding | None = None  # None while prefilling and once done
        self.results: list[GenerationResult] = []

    @property
    def prefilled(self) -> bool:
        """Whether the prompt is in the cache (all but its last token) and decoding began."""
        return self.sample is not None or self.done

    @property
    def done(self) -> bool:
        """Whether every sample is finished (``results`` holds them)."""
        return len(self.results) == self.num_samples

    @property
    def num_tokens_to_prefill(self) -> int:
        """Prompt tokens not yet in the cache (the cache holds all but the last one)."""
        return len(self.prompt_token_ids) - 1 - self.num_prefilled

    def prefill(self, num_tokens: int | None = None) -> float:
        """Add the next ``num_tokens`` tokens of the prompt to the target's cache (None: all
        that are left; 0 creates the sequence only). Once the prompt is in, the proposer
        starts following the sequence and the first sample begins.

        Returns:
            the seconds it took.
        """
        left = self.num_tokens_to_prefill
        size = left if num_tokens is None else min(num_tokens, left)
        t0 = time.perf_counter()
        self.target.prefill(self.sequence_id,
                            self.prompt_token_ids[self.num_prefilled:self.num_prefilled + size])
        seconds = time.perf_counter() - t0
        self.num_prefilled += size
        self.prefill_seconds += seconds
        if size:
            self.prefill_seconds_per_token = seconds / size
        if not self.num_tokens_to_prefill:
            if self.proposer is not None:
                self.proposer.reset(reproducible=not self.timed, scope=self.scope)
                self.proposer.follow(self.sequence_id)
            self._start_sample()
        return seconds

    def room(self) -> int:
        """Tokens the sample being decoded may still generate; a sample with none left is
        finished here (and the next one begins). 0 once every sample is done."""
        while self.sample is not None:
            if room := self.sample.room():
                return room
            self._end_sample()
        return 0

    def verify_and_commit(self, logits: torch.Tensor, forward_seconds: float) -> None:
        """Verify and commit the sample's cycle (:meth:`SampleDecoding.verify_and_commit`:
        ``logits`` ``[len(block), vocab]``, the target's scores of the drafted block),
        keep the accepted rows in the target's cache, and finish the sample on a stop."""
        kept = self.sample.verify_and_commit(logits, forward_seconds)
        self.target.retain(self.sequence_id, logits.shape[0], kept)
        if self.sample.finish_reason is not None:
            self._end_sample()

    def _start_sample(self) -> None:
        """Begin the next sample (the first one's stats include the prefill)."""
        emit = (None if self.on_commit is None
                else functools.partial(self.on_commit, len(self.results)))
        self.sample = SampleDecoding(
            self.generator, self.prompt_token_ids, self.pipeline, self.rng, self.proposer,
            self.policy, observe_seconds=self.observe_seconds, start=self.start,
            prefill_seconds=self.prefill_seconds, emit=emit, trace=[] if self.trace else None)
        self.prefill_seconds = 0.0

    def _end_sample(self) -> None:
        """Record the finished sample; roll the cache back to the prompt and begin the next
        one, unless it was the last."""
        self.results.append(self.sample.result())
        self.sample = None
        if not self.done:
            self.target.rollback(self.sequence_id, self.target.num_cached_tokens(self.sequence_id)
                                 - (len(self.prompt_token_ids) - 1))
            self.start = time.perf_counter()
            self._start_sample()


class SpeculativeGenerator:
    """Exact speculative decoding of one sequence at a time.

    Args:
        target: the target model's backend.
        proposer: what drafts tokens; None means plain decoding (k = 0).
        num_speculative_tokens: the most tokens drafted per cycle (≥ 0; 0 = plain
            decoding). Clamped per cycle so that neither max_new_tokens nor the context
            limit is exceeded.
        policy: how k is chosen each cycle, a name from
            :data:`~exactspec.speculation_length.POLICIES` (``auto``, the default, picks the
            k that maximises expected tokens per second from measured costs and acceptance)
            or a policy object. It never changes the output distribution.
        allow_batch_variance: speculate even on a target that is not batch-invariant (its
            ``batch_invariant`` is False: a token scored in a block gets logits that differ
            by rounding from plain decoding's). The distribution is then exact only up to
            that rounding, and greedy output may differ from plain decoding at near-ties.
    Raises:
        ValueError: if num_speculative_tokens is not an integer ≥ 0, the policy is
            unknown, or ``confidence`` is asked for a proposer without probabilities.
        UnsupportedModelError: with a proposer, if the target is not batch-invariant and
            ``allow_batch_variance`` is False, or the proposer drafts token trees and the
            target does not score them (``Backend.scores_trees``).
    """

    rejection_sampler = staticmethod(rejection_sample)
    """The stochastic verifier (the audit's broken controls replace it)."""

    def __init__(self, target: Backend, proposer: Proposer | None = None,
                 num_speculative_tokens: int = 4,
                 policy: str | SpeculationLengthPolicy = DEFAULT_POLICY, *,
                 allow_batch_variance: bool = False) -> None:
        if (not isinstance(num_speculative_tokens, int) or isinstance(num_speculative_tokens, bool)
                or num_speculative_tokens < 0):
            raise ValueError(f"num_speculative_tokens = {num_speculative_tokens!r} is invalid: "
                             "it must be an integer ≥ 0 (0 = plain decoding)")
        if proposer is not None and not target.batch_invariant and not allow_batch_variance:
            raise UnsupportedModelError(
                f"this backend ({target.description}) scores a block of tokens differently "
                "from one token at a time (its kernels are not batch-invariant), so verifying "
                "drafts would not reproduce plain decoding; speculation is refused. "
                + target.batch_variance_fix + " (allow_batch_variance=True, "
                "--allow-batch-variance, speculates anyway, exact only up to rounding.)")
        if proposer is not None and proposer.drafts_trees and not target.scores_trees:
            raise UnsupportedModelError(
                f"{type(proposer).__name__} drafts token trees, which this backend "
                f"({target.description}) does not score; use the native (a GGUF file) or "
                "transformers backend, or draft a chain")
        self.target = target
        self._sequence = new_sequence_id()  # the target's sequence this engine decodes in
        self.proposer = proposer
        self.allow_batch_variance = allow_batch_variance
        self.num_speculative_tokens = num_speculative_tokens if proposer is not None else 0
        self.policy = (make_policy(policy, self.num_speculative_tokens,
                                   proposer is not None and proposer.drafts_for_free,
                                   proposer is not None and proposer.estimates_acceptance)
                       if isinstance(policy, str) else policy)
        if (self.policy.min_confidence and proposer is not None
                and not proposer.supports_min_confidence):
            raise ValueError(f"the {self.policy.name} policy needs a proposer with probabilities "
                             f"of its own (a draft model); {type(proposer).__name__} has none: "
                             "use the auto or heuristic policy")

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                 chat: bool = False, trace: bool = False) -> GenerationResult:
        """Generate a continuation of ``prompt`` whose tokens follow the target's processed
        distribution exactly (token for token equal to plain decoding when greedy).

        Args:
            prompt: text, ``[prompt_len]`` token ids (used as they are), or chat messages
                (``{"role", "content"}`` dicts, through the chat template).
            params: sampling parameters (default: greedy, 128 new tokens).
            chat: wrap a text prompt in the model's chat template as one user turn.
            trace: record every cycle's drafts, p, q, uniforms and verdicts in
                ``result.trace`` (costs host work per cycle; off, nothing is recorded).
        Returns:
            :class:`GenerationResult`.
        Raises:
            RequestError: (a ValueError naming the field) for an empty prompt, token ids
                outside the vocabulary, a prompt that fills the context (no room for a
                token), ``chat`` with token ids, or sampling parameters naming token ids
                outside the vocabulary (:func:`~exactspec.request.prepare_request`).
        """
        return self.generate_samples(prompt, params, n=1, chat=chat, trace=trace)[0]

    def generate_samples(self, prompt: Prompt, params: SamplingParams | None = None,
                         *, n: int = 1, chat: bool = False, trace: bool = False,
                         on_commit: OnCommit | None = None,
                         scope: Hashable = None) -> list[GenerationResult]:
        """``n`` independent continuations of one prompt, each exact, sharing the prompt's
        prefill (the KV cache is rolled back to the prompt between samples). With a seed,
        the list is reproducible; greedy samples are all equal.

        Args and errors as :meth:`generate`; ``n`` must be an integer ≥ 1. ``on_commit``
        (for streaming) is called after every cycle that emitted tokens with the sample's
        index (0-based) and those tokens, in order; an exception it raises (e.g. to cancel)
        ends generation and propagates, and the generator stays usable. ``scope``: whose
        earlier generations a proposer that learns across requests may draft from and add
        this one's output to (:meth:`Proposer.reset <exactspec.proposers.base.Proposer.reset>`;
        None: the default scope).
        Returns:
            ``[n]`` :class:`GenerationResult`; the first one's stats include the prefill.
        """
        request = prepare_request(self.target, prompt, params, n=n, chat=chat)
        state = SequenceState(self, request, self._sequence, self.proposer, self.policy,
                              alone=True, on_commit=on_commit, scope=scope, trace=trace)
        self.target.release(self._sequence)
        try:
            with torch_threads(1):  # host-side work; the backend chooses its own (threads.py)
                state.prefill()
                self._decode(state)
        finally:
            self.target.release(self._sequence)
        return state.results

    def _decode(self, state: SequenceState) -> None:
        """The speculative loop, one forward per cycle: choose → draft → forward → verify,
        commit, observe, roll back (``state`` does all but the forward), until every sample
        of the request is done."""
        while room := state.room():
            sample = state.sample
            block = sample.draft(sample.choose(), room)
            t0 = time.perf_counter()
            parents = sample.tree_parents()
            logits = (forward_one(self.target, self._sequence, block) if parents is None
                      else self.target.forward_tree(self._sequence, block, parents))
            state.verify_and_commit(logits, time.perf_counter() - t0)
