"""Engines: exactspec and its peers behind one protocol, which the benchmark times and the
audit samples.

An *engine* is anything that decodes the target model for requests: exactspec's own
(:class:`~exactspec.generator.SpeculativeGenerator`, one sequence at a time, and
:class:`~exactspec.batching.BatchedGenerator`, many at once) or a peer's, another engine on
the same model (transformers ``generate()``, llama-cpp-python's ``Llama.generate()``: see
:mod:`exactspec.peers`). :class:`Engine` is what ``bench`` and ``audit`` need of one, and
each engine implements it once: :class:`ExactspecEngine` and :class:`BatchedEngine` here,
the peers in :mod:`exactspec.peers`, an engine behind an OpenAI-compatible HTTP API in
:class:`exactspec.audit.endpoint.Endpoint` (whose prompts may also be text, sent as is,
and whose tokens are texts where the API returns no ids). Requests served one after
another all go through :func:`one_after_another`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from exactspec.batching import BatchedGenerator
from exactspec.generation_stats import GenerationStats
from exactspec.generator import GenerationResult, SpeculativeGenerator
from exactspec.proposers.base import Corpus
from exactspec.sampling import SamplingParams, make_rng

__all__ = ["BatchedEngine", "Engine", "ExactspecEngine", "Generation", "one_after_another"]


@dataclass
class Generation:
    """One request decoded by an engine.

    Attributes:
        token_ids: ``[num_tokens]`` the continuation (at most ``max_new_tokens``, ending at
            the first EOS).
        seconds: wall seconds the engine spent on this request (exactspec: its stats'
            ``total_seconds``, prefill included; a peer: its decoding call).
        latency: wall seconds from the start of the :meth:`Engine.generate` call to this
            request's last token (equal to ``seconds`` for the first request, or for all
            of them when they are decoded at once).
        stats: exactspec's :meth:`GenerationStats.to_dict
            <exactspec.generation_stats.GenerationStats.to_dict>` (None: a peer, which does not say).
    """

    token_ids: list[int]
    seconds: float
    latency: float
    stats: dict | None = None


class Engine(Protocol):
    """An engine decoding the target model (see module docstring).

    Attributes:
        name: how reports and messages call it (callers may rename it).
        corpus: what it remembers across requests and drafts from (exactspec's suffix
            corpus), for a caller to clear or fill; None: nothing.
        draft_stats: the drafting figures of everything it decoded so far (drafted and
            accepted tokens, in total and per position of the drafted block: a
            :class:`~exactspec.generation_stats.GenerationStats` summed with ``add``), or
            None where the engine does not report them.
    """

    name: str
    corpus: Corpus | None
    draft_stats: GenerationStats | None

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 at_once: bool = False) -> list[Generation]:
        """One continuation of each prompt, each as that request alone would get it with
        ``params`` (same seed: same tokens), timed.

        Args:
            prompts: ``[num_requests]`` token-id lists.
            params: the sampling parameters of every request.
            at_once: submit the requests together (the benchmark's ``--concurrency``),
                decoded as a batch where the engine can; False: one after another.
        Returns:
            ``[num_requests]`` :class:`Generation`, in order.
        Raises:
            ValueError: for parameters the engine cannot honour, naming them.
        """
        ...

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        """``num_samples`` independent continuations of ``prompt_ids`` (each at most
        ``params.max_new_tokens`` tokens, ending early at EOS), drawn from the target's
        processed distribution as exactspec defines it, reproducible for ``params.seed``.

        Raises:
            ValueError: for parameters the engine cannot honour, or with which its
                distribution is by definition another one, naming them.
        """
        ...


def one_after_another(generate_one: Callable[[Sequence[int]], Generation],
                      prompts: Sequence[Sequence[int]]) -> list[Generation]:
    """Requests served one at a time by ``generate_one`` (prompt → :class:`Generation`),
    each one's ``latency`` set to the seconds from the start to its end."""
    start, generations = time.perf_counter(), []
    for prompt_ids in prompts:
        generation = generate_one(prompt_ids)
        generations.append(dataclasses.replace(generation,
                                               latency=time.perf_counter() - start))
    return generations


class ExactspecEngine:
    """exactspec's :class:`~exactspec.generator.SpeculativeGenerator`: :meth:`sample` shares the
    prompt's prefill (the KV cache is rolled back between samples, never re-encoded);
    :meth:`generate` with ``at_once`` batches the requests with a
    :class:`~exactspec.batching.BatchedGenerator` as wide as the call (one per width,
    kept), or serves them one after another when the proposer is not ``batchable``.

    Args:
        generator: the one-sequence engine (its target, proposer, k and policy).
        name: how reports call it.
    """

    def __init__(self, generator: SpeculativeGenerator, name: str) -> None:
        self.generator, self.name = generator, name
        proposer = generator.proposer
        self.corpus = proposer.corpus if proposer is not None else None
        self.draft_stats = GenerationStats(num_speculative_tokens=generator.num_speculative_tokens)
        self._batched: dict[int, BatchedGenerator] = {}  # by width

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams, *,
                 at_once: bool = False) -> list[Generation]:
        proposer = self.generator.proposer
        if not at_once or (proposer is not None and not proposer.batchable):
            return one_after_another(
                lambda ids: self._generation(self.generator.generate(list(ids), params)),
                prompts)
        if len(prompts) not in self._batched:
            self._batched[len(prompts)] = BatchedGenerator(self.generator, len(prompts))
        results = self._batched[len(prompts)].generate([list(ids) for ids in prompts], params)
        return [self._generation(result) for result in results]

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        results = self.generator.generate_samples(list(prompt_ids), params, n=num_samples)
        self._count_drafts(results)
        return [tuple(result.token_ids) for result in results]

    def _generation(self, result: GenerationResult) -> Generation:
        """``result`` as a :class:`Generation` (its latency: its own seconds), counted."""
        self._count_drafts([result])
        seconds = result.stats.total_seconds
        return Generation(result.token_ids, seconds, seconds, result.stats.to_dict())

    def _count_drafts(self, results: Sequence[GenerationResult]) -> None:
        """Add the figures of ``results`` to :attr:`draft_stats`."""
        for result in results:
            self.draft_stats.add(result.stats)


class BatchedEngine(ExactspecEngine):
    """exactspec's :class:`~exactspec.batching.BatchedGenerator` as ``exactspec serve`` runs
    it: :meth:`sample` decodes the samples of one call as concurrent requests,
    ``max_batch_size`` at a time, each as an unseeded request would be served (its k chosen
    by the batch-level ``auto`` policy) but drawing from its own generator seeded from
    ``params.seed`` and its index, so a run is reproducible. :meth:`generate` is
    :class:`ExactspecEngine`'s, on the batch's one-sequence generator.

    Args:
        batched: the batched generator.
        name: how reports call it.
    """

    def __init__(self, batched: BatchedGenerator, name: str) -> None:
        super().__init__(batched.generator, name)
        self.batched = batched

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        unseeded = dataclasses.replace(params, seed=None)
        device = self.batched.target.device
        ids = [self.batched.submit(list(prompt_ids), unseeded,
                                   rng=make_rng((params.seed or 0) * 1_000_003 + i, device))
               for i in range(num_samples)]
        outputs = {}
        while not all(i in outputs for i in ids):
            outputs.update(self.batched.step())
        results = []
        for i in ids:
            if isinstance(outputs[i], Exception):
                raise outputs[i]
            results += outputs[i]
        self._count_drafts(results)
        return [tuple(result.token_ids) for result in results]
