"""Engines under test: anything that can sample the first m tokens of a continuation.

The audit compares an engine's samples with the target's exact probabilities, so any engine
that decodes the same target model can be audited: exactspec itself (with any proposer, or
a broken control), and the peers of :mod:`exactspec.peers` (transformers ``generate()``
with its own speculative modes, llama-cpp-python's ``generate()`` with its prompt-lookup
draft).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol

from exactspec.batching import BatchedGenerator
from exactspec.engine import SpeculativeGenerator
from exactspec.sampling import make_rng
from exactspec.peers import Peer, set_fields
from exactspec.sampling import SamplingParams


class EngineUnderTest(Protocol):
    """An engine the audit samples from.

    Attributes:
        name: how reports call it.
        drafted, accepted: draft tokens proposed and accepted so far, when the engine
            reports them (None otherwise), to show that speculation really happened.
        drafted_per_position, accepted_per_position: ``[k]`` the same per position in
            the drafted block (0-based), or None.
    """

    name: str
    drafted: int | None
    accepted: int | None
    drafted_per_position: list[int] | None
    accepted_per_position: list[int] | None

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        """``num_samples`` independent continuations of ``prompt_ids`` (each at most
        ``params.max_new_tokens`` tokens, ending early at EOS), reproducible for a seed."""
        ...


class ExactspecEngine:
    """exactspec's :class:`~exactspec.engine.SpeculativeGenerator` (shared prefill per
    prompt: the KV cache is rolled back between samples, never re-encoded)."""

    def __init__(self, generator: SpeculativeGenerator, name: str) -> None:
        self.generator, self.name = generator, name
        self.drafted = self.accepted = 0
        self.drafted_per_position = [0] * generator.num_speculative_tokens
        self.accepted_per_position = [0] * generator.num_speculative_tokens

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        results = self.generator.generate_samples(list(prompt_ids), params, n=num_samples)
        _count_drafts(self, results)
        return [tuple(result.token_ids) for result in results]


class BatchedEngine:
    """exactspec's :class:`~exactspec.batching.BatchedGenerator`: the samples of one call are
    decoded as concurrent requests, ``max_batch_size`` at a time, each as an unseeded request
    would be served (its k chosen by the batch-level ``auto`` policy) but drawing from its
    own generator seeded from ``params.seed`` and its index, so a run is reproducible."""

    def __init__(self, batched: BatchedGenerator, name: str) -> None:
        self.batched, self.name = batched, name
        k = batched.generator.num_speculative_tokens
        self.drafted = self.accepted = 0
        self.drafted_per_position, self.accepted_per_position = [0] * k, [0] * k

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
        _count_drafts(self, results)
        return [tuple(result.token_ids) for result in results]


def _count_drafts(engine: ExactspecEngine | BatchedEngine, results) -> None:
    """Add the drafted and accepted counts (in total and per block position) of
    ``results`` (:class:`~exactspec.engine.GenerationResult`) to ``engine``'s."""
    for result in results:
        stats = result.stats
        engine.drafted += stats.drafted_tokens
        engine.accepted += stats.accepted_tokens
        for i, (d, a) in enumerate(zip(stats.drafted_per_position, stats.accepted_per_position)):
            engine.drafted_per_position[i] += d
            engine.accepted_per_position[i] += a


class PeerEngine:
    """Another engine on the same model (a :class:`~exactspec.peers.Peer`: transformers
    ``generate()`` or llama-cpp-python's), sampling.

    Only sampling parameters under which the peer's distribution is by definition the
    target's processed one are audited (``peer.comparable``): llama-cpp-python, for one,
    applies top-k, top-p and min-p before the temperature, so it is audited with the
    temperature only.

    Args:
        peer: the peer.
        name: how reports call it.
    """

    def __init__(self, peer: Peer, name: str) -> None:
        self.peer, self.name = peer, name
        self.drafted = self.accepted = None
        self.drafted_per_position = self.accepted_per_position = None

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        """As :meth:`EngineUnderTest.sample`.

        Raises:
            ValueError: if ``params`` sets a field the peer does not translate, or one
                outside ``peer.comparable``.
        """
        incomparable = [field for field in set_fields(params, self.peer.comparable)
                        if field in self.peer.translates]
        if incomparable:
            defaults = SamplingParams()
            reset = " ".join(f"--{field.replace('_', '-')} {getattr(defaults, field):g}"
                             for field in incomparable)
            raise ValueError(f"{self.peer.label} is audited with "
                             f"{', '.join(self.peer.comparable)} only (it got "
                             f"{', '.join(incomparable)}): {self.peer.incomparable_reason}; "
                             f"audit it with {reset}")
        return self.peer.sample(prompt_ids, params, num_samples)
