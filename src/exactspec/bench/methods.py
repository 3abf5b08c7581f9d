"""Decoding methods the benchmark compares: exactspec's own, and peers on the same model.

A method is a proposer spec (grammar in :mod:`exactspec.proposers.spec`) with ``:k=N`` and
``:policy=P``, and optionally a peer prefix, e.g.::

    plain                        exactspec, plain decoding (the baseline)
    prompt-lookup:k=4[:ngram=2-3][:policy=auto]
    suffix:k=8[:ngram=1-8][:corpus=N]   (a corpus only ever holds other questions' outputs)
    draft:MODEL:k=4, early-exit:L:k=4, head[:PATH]:k=4
    hf-plain, hf-prompt-lookup:k=10, hf-draft:MODEL[:k=N], hf-early-exit:L[:k=N]
                                 transformers ``generate()`` (transformers backend)
    llama-plain, llama-prompt-lookup:k=10
                                 llama-cpp-python's ``Llama.generate()`` (llama_cpp backend)

``k`` defaults to 4 (10 for a peer's prompt lookup), ``policy`` to constant (fixed k).
Peers (see :mod:`exactspec.peers`) run on the same model file, prompts and max_new_tokens
(``hf-*`` on the same model object). Every method decodes with an
:class:`~exactspec.engines.Engine`, exactspec's or a peer's, the one the audit tests.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from exactspec.backends.base import Backend
from exactspec.engines import Engine, ExactspecEngine, Generation
from exactspec.peers import DEFAULT_PROMPT_LOOKUP_K, PEERS, is_peer
from exactspec.proposers.spec import ProposerSpec, parse_proposer
from exactspec.sampling import SamplingParams
from exactspec.speculation import Speculation, SpeculationSettings
from exactspec.speculation_length import POLICIES

__all__ = ["Method", "WaveOutcome", "is_peer", "parse_method", "parse_method_spec"]

DEFAULT_K = 4


class WaveOutcome(NamedTuple):
    """Several requests submitted at once, decoded: their outputs, each one's seconds from
    the start to its last token, and the seconds spent prefilling their prompts (None when
    the engine does not say: peers)."""

    outputs: list[list[int]]
    latencies: list[float]
    prefill_seconds: float | None = None


@dataclass
class Method:
    """A named way to decode: an :class:`~exactspec.engines.Engine` (exactspec with a
    proposer, or a peer) as the benchmark runs it.

    Attributes:
        name: the method spec, e.g. ``prompt-lookup:k=4``.
        kind: ``plain``, ``prompt-lookup``, ``suffix``, ``draft``, ``early-exit``, ``head``,
            one of them with its peer prefix (``hf-draft`` for a transformers draft model),
            or a combination (``suffix+head``).
        k: most tokens drafted per cycle (0: plain decoding).
        engine: what decodes.
        notes: how the method was kept honest, for the report (e.g. what its corpus held).
    """

    name: str
    kind: str
    k: int
    engine: Engine
    notes: str | None = None
    _earlier: dict[int, list[int]] = field(default_factory=dict, init=False, repr=False)
    """Question id → its first output, in run order (what a corpus may hold)."""

    def run(self, prompt_ids: Sequence[int], params: SamplingParams,
            question_id: int | None = None) -> Generation:
        """Decode one question alone. An engine's corpus holds only the outputs of the
        other questions run before (never this one's; none for a warm-up,
        ``question_id`` None) and is cleared after.

        Raises:
            ValueError: as :meth:`Engine.generate <exactspec.engines.Engine.generate>`.
        """
        corpus = self.engine.corpus
        if corpus is not None:  # only other questions' outputs, never this one's
            corpus.clear()
            for other, output in self._earlier.items():
                if other != question_id:
                    corpus.add(output)
        generation = self.engine.generate([prompt_ids], params)[0]
        if corpus is not None:
            corpus.clear()  # the engine added this output: it must not be seen again
            if question_id is not None:
                self._earlier.setdefault(question_id, generation.token_ids)
        return generation

    def wave(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> WaveOutcome:
        """Decode several questions submitted at once (``--concurrency``); an engine's
        corpus is emptied before and after, so it holds only the outputs of the wave's
        other questions that finished earlier. The prefill seconds are the engine's own
        when it reports them for every request (exactspec's stats), else None.

        Raises:
            ValueError: as :meth:`Engine.generate <exactspec.engines.Engine.generate>`.
        """
        corpus = self.engine.corpus
        if corpus is not None:
            corpus.clear()
        generations = self.engine.generate(prompts, params, at_once=True)
        if corpus is not None:
            corpus.clear()
        reported = all(g.stats is not None for g in generations)
        return WaveOutcome([g.token_ids for g in generations], [g.latency for g in generations],
                           sum(g.stats["prefill_seconds"] for g in generations)
                           if reported else None)

    @property
    def is_peer(self) -> bool:
        return is_peer(self.name)


def parse_method_spec(spec: str) -> ProposerSpec:
    """Take a method spec apart and check it, without any model (see module docstring);
    ``k`` and ``policy`` are filled with their defaults.

    Raises:
        ValueError: ``method {spec!r} is invalid: …``, naming the allowed forms or the bad value.
    """
    proposer_spec = parse_proposer(spec, what="method", options=("k", "policy"), peers=PEERS)
    if proposer_spec.policy is not None and proposer_spec.policy not in POLICIES:
        raise ValueError(f"method {spec!r} is invalid: policy {proposer_spec.policy!r} is not one of "
                         f"{', '.join(POLICIES)}")
    default_k = (DEFAULT_PROMPT_LOOKUP_K if proposer_spec.peer and proposer_spec.kind == "prompt-lookup"
                 else DEFAULT_K)
    return dataclasses.replace(proposer_spec, k=proposer_spec.k if proposer_spec.k is not None else default_k,
                               policy=proposer_spec.policy or "constant")


def parse_method(spec: str, target: Backend, load_model: Callable[[str], Backend], *,
                 allow_batch_variance: bool = False) -> Method:
    """Build a :class:`Method` from its spec string (see module docstring);
    ``allow_batch_variance`` as in :class:`~exactspec.generator.SpeculativeGenerator`.

    Raises:
        ValueError: naming the bad spec and the allowed forms, or a peer on the wrong backend.
    """
    proposer_spec = parse_method_spec(spec)
    kind = (f"{proposer_spec.peer}-{proposer_spec.kind}" if proposer_spec.peer
            else "+".join(part.kind for part in proposer_spec.parts))
    k = proposer_spec.k if proposer_spec.drafts else 0
    speculation = Speculation(target, None, allow_batch_variance=allow_batch_variance,
                              load_model=load_model)
    if proposer_spec.peer:
        try:
            engine = speculation.peer(proposer_spec, k, share=True)
        except ValueError as error:
            raise ValueError(f"method {spec!r}: {error}") from None
        return Method(spec, kind, k, engine)
    engine = ExactspecEngine(speculation.with_proposer(
        proposer_spec, SpeculationSettings(k, proposer_spec.policy)).generator(), spec)
    notes = None if engine.corpus is None else (
        "suffix corpus: refilled before every run with the outputs of the questions run "
        "before this one (never its own; the warm-up's is dropped), and cleared after it; "
        "under --concurrency emptied before each wave, so it holds only the outputs of the "
        "wave's other questions that finished earlier")
    return Method(spec, kind, k, engine, notes)
