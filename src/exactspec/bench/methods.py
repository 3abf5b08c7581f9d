"""Decoding methods the benchmark compares: exactspec's own, and peers on the same model.

A method is a drafter spec (grammar in :mod:`exactspec.proposers.spec`) with ``:k=N`` and
``:policy=P``, and optionally a peer prefix, e.g.::

    plain                        exactspec, plain decoding (the baseline)
    prompt-lookup:k=4[:ngram=2-3][:policy=auto]
    suffix:k=8[:ngram=1-8][:corpus=N]   (a corpus only ever holds other questions' outputs)
    draft:MODEL:k=4, early-exit:L:k=4
    hf-plain, hf-prompt-lookup:k=10, hf-assistant:MODEL[:k=N], hf-early-exit:L[:k=N]
                                 transformers ``generate()`` (transformers backend)
    llama-plain, llama-prompt-lookup:k=10
                                 llama-cpp-python's ``Llama.generate()`` (llama_cpp backend)

``k`` defaults to 4 (10 for a peer's prompt lookup), ``policy`` to constant (fixed k).
Peers (see :mod:`exactspec.peers`) run on the same model file, prompts and max_new_tokens
(``hf-*`` on the same model object).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from exactspec.backends.base import Backend
from exactspec.batching import BatchedGenerator
from exactspec.engine import SpeculativeGenerator
from exactspec.peers import (DEFAULT_PROMPT_LOOKUP_K, PEERS, is_peer, make_peer,
                             one_after_another)
from exactspec.proposers.spec import DrafterSpec, build_proposer, parse_drafter
from exactspec.proposers.suffix import SuffixProposer
from exactspec.sampling import SamplingParams

__all__ = ["Method", "Outcome", "is_peer", "parse_method", "parse_method_spec"]

DEFAULT_K = 4


@dataclass
class Outcome:
    """One generation: tokens, wall seconds, and exactspec's stats (None for peers)."""

    token_ids: list[int]
    seconds: float
    stats: dict | None


class WaveOutcome(NamedTuple):
    """Several requests submitted at once, decoded: their outputs, each one's seconds from
    the start to its last token, and the seconds spent prefilling their prompts (None when
    the engine does not say: peers)."""

    outputs: list[list[int]]
    latencies: list[float]
    prefill_seconds: float | None = None


Wave = Callable[[list[list[int]], SamplingParams], WaveOutcome]
"""Decode several prompts submitted at once."""


@dataclass
class Method:
    """A named way to decode; ``run(prompt_ids, params, question_id)`` → :class:`Outcome`
    (``question_id`` None for a warm-up); ``run_wave(prompts, params)`` decodes several
    requests submitted at once (:data:`Wave`; batched for exactspec and ``hf-plain``, one
    after another for the other peers). ``kind`` is ``plain``, ``prompt-lookup``,
    ``suffix``, ``draft``, ``early-exit``, or one of them with its peer prefix
    (``hf-assistant`` for a transformers draft model). ``notes``: how the method was kept
    honest, for the report (e.g. what its corpus held)."""

    name: str
    kind: str
    k: int
    run: Callable[[list[int], SamplingParams, int | None], Outcome]
    run_wave: Wave | None = None  # None: one ``run`` after another
    notes: str | None = None

    def wave(self, prompts: list[list[int]], params: SamplingParams) -> WaveOutcome:
        """:data:`Wave`: ``run_wave``, or each prompt's ``run`` one after another."""
        if self.run_wave is not None:
            return self.run_wave(prompts, params)
        return one_run_after_another(self.run, prompts, params)

    @property
    def is_peer(self) -> bool:
        return is_peer(self.name)


def one_run_after_another(run: Callable[..., Outcome], prompts: list[list[int]],
                          params: SamplingParams) -> WaveOutcome:
    """A wave served by ``run`` one request at a time; the prefill seconds are the runs'
    own when every run reports them (exactspec's stats), else None."""
    outcomes: list[Outcome] = []

    def decode(ids):
        outcomes.append(run(list(ids), params))
        return outcomes[-1].token_ids
    outputs, latencies = one_after_another(decode, prompts)
    reported = all(o.stats is not None for o in outcomes)
    return WaveOutcome(outputs, latencies, sum(o.stats["prefill_seconds"] for o in outcomes)
                       if reported else None)


def parse_method_spec(spec: str) -> DrafterSpec:
    """Take a method spec apart and check it, without any model (see module docstring);
    ``k`` and ``policy`` are filled with their defaults.

    Raises:
        ValueError: ``method {spec!r} is invalid: …``, naming the allowed forms or the bad value.
    """
    import dataclasses

    drafter = parse_drafter(spec, what="method", options=("k", "policy"), peers=PEERS)
    default_k = (DEFAULT_PROMPT_LOOKUP_K if drafter.peer and drafter.kind == "prompt-lookup"
                 else DEFAULT_K)
    return dataclasses.replace(drafter, k=drafter.k if drafter.k is not None else default_k,
                               policy=drafter.policy or "constant")


def parse_method(spec: str, target: Backend, load_model: Callable[[str], Backend], *,
                 allow_batch_variance: bool = False) -> Method:
    """Build a :class:`Method` from its spec string (see module docstring);
    ``allow_batch_variance`` as in :class:`~exactspec.engine.SpeculativeGenerator`.

    Raises:
        ValueError: naming the bad spec and the allowed forms, or a peer on the wrong backend.
    """
    drafter = parse_method_spec(spec)
    kind = {"none": "plain", "draft": "assistant" if drafter.peer == "hf" else "draft"}.get(
        drafter.kind, drafter.kind)
    kind = f"{drafter.peer}-{kind}" if drafter.peer else kind
    k = drafter.k if drafter.drafts else 0
    if drafter.peer:
        try:
            peer = make_peer(drafter, target, load_model, k, share=True)
        except ValueError as error:
            raise ValueError(f"method {spec!r}: {error}") from None

        def run_peer(prompt_ids: list[int], params: SamplingParams,
                     question_id: int | None = None) -> Outcome:
            start = time.perf_counter()
            token_ids = list(peer.sample(prompt_ids, params, 1)[0])
            return Outcome(token_ids, time.perf_counter() - start, None)

        return Method(spec, kind, k, run_peer,
                      lambda prompts, params: WaveOutcome(*peer.sample_wave(prompts, params)))
    proposer = build_proposer(drafter, target, load_model)
    generator = SpeculativeGenerator(target, proposer, k, drafter.policy,
                                     allow_batch_variance=allow_batch_variance)
    corpus = proposer.corpus if isinstance(proposer, SuffixProposer) else None
    earlier: dict[int, list[int]] = {}  # question id → its first output, in run order

    def run(prompt_ids: list[int], params: SamplingParams,
            question_id: int | None = None) -> Outcome:
        if corpus is not None:  # only other questions' outputs, never this one's
            corpus.clear()
            for other, output in earlier.items():
                if other != question_id:
                    corpus.add(output)
        result = generator.generate(prompt_ids, params)
        if corpus is not None:
            corpus.clear()  # the engine added this output: it must not be seen again
            if question_id is not None:
                earlier.setdefault(question_id, result.token_ids)
        return Outcome(result.token_ids, result.stats.total_seconds, result.stats.to_dict())

    batched: dict[int, BatchedGenerator] = {}  # by wave size

    def run_wave(prompts: list[list[int]], params: SamplingParams) -> WaveOutcome:
        if proposer is not None and not proposer.batchable:  # one draft cache: one by one
            return one_run_after_another(run, prompts, params)
        if len(prompts) not in batched:
            batched[len(prompts)] = BatchedGenerator(generator, len(prompts))
        if corpus is not None:  # only the wave's other questions, finished before
            corpus.clear()
        results = batched[len(prompts)].generate(prompts, params)
        if corpus is not None:
            corpus.clear()
        return WaveOutcome([r.token_ids for r in results],
                           [r.stats.total_seconds for r in results],
                           sum(r.stats.prefill_seconds for r in results))
    notes = None if corpus is None else (
        "suffix corpus: refilled before every run with the outputs of the questions run "
        "before this one (never its own; the warm-up's is dropped), and cleared after it; "
        "under --concurrency emptied before each wave, so it holds only the outputs of the "
        "wave's other questions that finished earlier")
    return Method(spec, kind, k, run, run_wave, notes)
