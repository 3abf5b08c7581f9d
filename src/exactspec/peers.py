"""Peers: other engines decoding the same model, which the benchmark times and the audit
tests beside exactspec.

- ``hf``: transformers ``generate()`` on the target's own model object
  (:class:`TransformersPeer`), plain or with its own speculation: ``prompt_lookup_num_tokens``,
  ``assistant_early_exit`` or ``assistant_model``.
- ``llama``: llama-cpp-python's own ``Llama.generate()`` on the target's GGUF file
  (:class:`LlamaCppPeer`), plain or with its ``LlamaPromptLookupDecoding`` draft.

A peer is named by a drafter spec with its prefix (``hf-prompt-lookup:k=10``; the grammar is
in :mod:`exactspec.proposers.spec`) and made by :func:`make_peer`. Both search n-grams of
at most 2 tokens, their own default: a spec's ``ngram=`` is not passed on.

Each peer translates the :class:`~exactspec.sampling.SamplingParams` fields it lists in
``translates`` and refuses a call that sets any other field; ``comparable`` lists the
fields with which its sampling distribution is by definition the one exactspec samples
from (the audit refuses the others).
"""

from __future__ import annotations

import time

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from exactspec.backends.base import Backend
from exactspec.proposers.spec import DrafterSpec
from exactspec.sampling import SamplingParams

PEERS = {"hf": ("none", "prompt-lookup", "early-exit", "draft"), "llama": ("none", "prompt-lookup")}
"""Peer prefix → the drafter kinds it runs (the ``peers`` of
:func:`~exactspec.proposers.spec.parse_drafter`)."""
DEFAULT_PROMPT_LOOKUP_K = 10
"""A peer's prompt-lookup tokens per draft when the spec gives no ``k=`` (both engines' own
default)."""


def is_peer(name: str) -> bool:
    """Whether a method or spec name is a peer's (``hf-*``, ``llama-*``) rather than exactspec's."""
    return name.startswith(tuple(f"{peer}-" for peer in PEERS))


def set_fields(params: SamplingParams, allowed: Sequence[str]) -> list[str]:
    """The fields of ``params`` outside ``allowed`` that differ from their defaults."""
    defaults = SamplingParams()
    return [field for field, value in vars(params).items()
            if field not in allowed and value != getattr(defaults, field)]


class Peer(Protocol):
    """Another engine on the target's model.

    Attributes:
        label: how messages call it, e.g. ``transformers generate()``.
        translates: the SamplingParams fields it honours; a call setting others is refused.
        comparable: the fields with which it samples from exactly the distribution exactspec
            does (see ``incomparable_reason`` for why not the others).
    """

    label: str
    translates: tuple[str, ...]
    comparable: tuple[str, ...]
    incomparable_reason: str

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        """``num_samples`` independent continuations, reproducible for ``params.seed``.

        Raises:
            ValueError: if ``params`` sets a field outside ``translates``.
        """
        ...

    def sample_wave(self, prompts: Sequence[Sequence[int]],
                    params: SamplingParams) -> tuple[list[list[int]], list[float]]:
        """One continuation of each prompt, all submitted at once (the benchmark's
        ``--concurrency``): the outputs, and each one's seconds from the start to its last
        token.

        Raises:
            ValueError: as :meth:`sample`.
        """
        ...


def one_after_another(decode: Callable[[Sequence[int]], Sequence[int]],
                      prompts: Sequence[Sequence[int]]) -> tuple[list[list[int]], list[float]]:
    """A wave (:meth:`Peer.sample_wave`) served one request at a time by ``decode`` (prompt
    → output): the outputs and each one's seconds from the start to its end."""
    start, outputs, latencies = time.perf_counter(), [], []
    for prompt_ids in prompts:
        outputs.append(list(decode(prompt_ids)))
        latencies.append(time.perf_counter() - start)
    return outputs, latencies


def _refuse_untranslated(peer: Peer, params: SamplingParams) -> None:
    untranslated = set_fields(params, peer.translates)
    if untranslated:
        raise ValueError(f"{peer.label} does not translate {', '.join(untranslated)}; it "
                         f"supports {', '.join(peer.translates)}")


class TransformersPeer:
    """transformers ``generate()`` on the target's own model object.

    Args:
        target: the target's transformers backend.
        generate_kwargs: what selects the mode (see :func:`transformers_generate_kwargs`),
            e.g. ``{"prompt_lookup_num_tokens": 4}``; none: plain decoding.
    Raises:
        ValueError: if ``target`` is not a transformers backend.
    """

    label = "transformers generate()"
    translates = comparable = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")
    incomparable_reason = ""

    def __init__(self, target: Backend, generate_kwargs: dict | None = None) -> None:
        from exactspec.backends.transformers_backend import TransformersBackend

        if not isinstance(target, TransformersBackend):
            raise ValueError(f"{self.label} needs the transformers backend (--backend transformers)")
        self.target, self.generate_kwargs = target, dict(generate_kwargs or {})

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        _refuse_untranslated(self, params)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        return [tuple(self._generate(prompt_ids, params)) for _ in range(num_samples)]

    def sample_wave(self, prompts: Sequence[Sequence[int]],
                    params: SamplingParams) -> tuple[list[list[int]], list[float]]:
        """Plain ``generate()`` decodes the prompts as one left-padded batch; its assisted
        modes refuse batches, so they serve one request at a time."""
        if self.generate_kwargs:
            return one_after_another(lambda ids: self.sample(ids, params, 1)[0], prompts)
        _refuse_untranslated(self, params)
        if params.seed is not None:
            torch.manual_seed(params.seed)
        start = time.perf_counter()
        outputs = self._generate_padded(prompts, params)
        return outputs, [time.perf_counter() - start] * len(prompts)

    def _generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return self._generate_padded([prompt_ids], params)[0]

    def _generate_padded(self, prompts: Sequence[Sequence[int]],
                         params: SamplingParams) -> list[list[int]]:
        """``generate()`` on the prompts as one batch, left-padded; each output cut after
        its first EOS."""
        width = max(len(p) for p in prompts)
        eos = list(self.target.eos_token_ids)
        pad = eos[0] if eos else 0
        input_ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts],
                                 device=self.target.device)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts],
                                      device=self.target.device)
        sampling = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "min_p": params.min_p or None}
        with torch.inference_mode():
            output = self.target.model.generate(
                input_ids, attention_mask=attention_mask,
                max_new_tokens=params.max_new_tokens, eos_token_id=eos or None,
                pad_token_id=pad, **sampling, **self.generate_kwargs)
        outputs = []
        for row in output[:, width:].tolist():
            end = next((i + 1 for i, token in enumerate(row) if token in eos), len(row))
            outputs.append(row[:end])
        return outputs


def transformers_generate_kwargs(drafter: DrafterSpec, k: int,
                                 load_model: Callable[[str], Backend]) -> dict:
    """transformers ``generate()`` keyword arguments for the same drafter as ``drafter``,
    drafting ``k`` tokens per cycle; ``load_model`` loads a draft model by name or path.

    Raises:
        ValueError: if the draft model does not load on the transformers backend.
    """
    from exactspec.backends.transformers_backend import TransformersBackend

    if drafter.kind == "prompt-lookup":
        return {"prompt_lookup_num_tokens": k}
    if drafter.kind == "early-exit":
        return {"assistant_early_exit": drafter.layers, "num_assistant_tokens": k}
    if drafter.kind == "draft":
        draft = load_model(drafter.model)
        if not isinstance(draft, TransformersBackend):
            raise ValueError(f"{TransformersPeer.label} needs the draft model {drafter.model!r} "
                             "on the transformers backend (--backend transformers)")
        # the assistant reads its draft length from its own generation config
        draft.model.generation_config.num_assistant_tokens = k
        return {"assistant_model": draft.model, "num_assistant_tokens": k}
    return {}


class LlamaCppPeer:
    """llama-cpp-python's own ``Llama.generate()`` on the target's GGUF file, with its
    ``LlamaPromptLookupDecoding`` draft (``num_pred_tokens`` = k) or none.

    llama-cpp-python verifies a draft by sampling the target at every drafted position and
    keeping the drafts that equal the samples, which is exact for a deterministic draft.

    Args:
        target: the target's llama.cpp backend.
        k: drafted tokens per cycle (0: no draft).
        share: with k = 0, generate with the target's own ``Llama`` (its cache is
            overwritten) instead of a second instance of the same file.
    Raises:
        ValueError: if ``target`` is not a llama.cpp backend.
    """

    label = "llama-cpp-python generate()"
    translates = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")
    comparable = ("temperature", "seed", "max_new_tokens")
    incomparable_reason = ("llama-cpp-python applies top-k, top-p and min-p before the "
                           "temperature (exactspec, transformers and vLLM apply them after), a "
                           "different distribution by definition")

    def __init__(self, target: Backend, k: int = 0, *, share: bool = False) -> None:
        from exactspec.backends.llama_cpp_backend import LlamaCppBackend

        if not isinstance(target, LlamaCppBackend):
            raise ValueError(f"{self.label} needs the llama_cpp backend (--backend llama_cpp)")
        if k:
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            # logits_all=True as well: with a draft model alone, llama-cpp-python 0.3.36 sizes
            # its logits buffer for n_batch (512) positions and fails on longer contexts.
            self.llama = target.new_llama(
                draft_model=LlamaPromptLookupDecoding(num_pred_tokens=k), logits_all=True)
        else:
            self.llama = target.llama if share else target.new_llama()
        self.eos = set(target.eos_token_ids)

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        _refuse_untranslated(self, params)
        samples = []
        for i in range(num_samples):
            self.llama.set_seed((params.seed or 0) * 1_000_003 + i)
            samples.append(tuple(self._generate(prompt_ids, params)))
        return samples

    def sample_wave(self, prompts: Sequence[Sequence[int]],
                    params: SamplingParams) -> tuple[list[list[int]], list[float]]:
        """One request at a time (a ``Llama`` holds one sequence)."""
        return one_after_another(lambda ids: self.sample(ids, params, 1)[0], prompts)

    def _generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """From an empty cache, stopped after an EOS token or ``max_new_tokens`` tokens; no
        repetition penalty."""
        sampling = {"temp": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
        if not params.greedy:
            sampling = {"temp": params.temperature, "top_k": params.top_k,
                        "top_p": params.top_p, "min_p": params.min_p}
        self.llama.reset()
        token_ids: list[int] = []
        for token in self.llama.generate(list(prompt_ids), **sampling, repeat_penalty=1.0):
            token_ids.append(token)
            if token in self.eos or len(token_ids) >= params.max_new_tokens:
                break
        return token_ids


def make_peer(drafter: DrafterSpec, target: Backend, load_model: Callable[[str], Backend],
              k: int, *, share: bool = False) -> Peer:
    """The peer ``drafter.peer`` running ``drafter`` with ``k`` tokens per draft on
    ``target``; ``load_model`` loads a draft model; ``share`` as in :class:`LlamaCppPeer`.

    Raises:
        ValueError: if the target's backend is not the peer's, or the peer cannot run the
            drafter.
    """
    check_peer_runs(drafter)
    if drafter.peer == "hf":
        peer = TransformersPeer(target)  # refuses another backend before loading a draft
        peer.generate_kwargs = transformers_generate_kwargs(drafter, k, load_model)
        return peer
    return LlamaCppPeer(target, k if drafter.drafts else 0, share=share)


def check_peer_runs(drafter: DrafterSpec) -> None:
    """Check, without any model, that ``drafter.peer`` can run ``drafter``.

    Raises:
        ValueError: if it names no peer, or one that cannot run its kind of drafter.
    """
    if drafter.peer not in PEERS:
        raise ValueError(f"{drafter.spec!r} names no peer: prefix it with "
                         f"{' or '.join(f'{peer}-' for peer in PEERS)}")
    if drafter.kind not in PEERS[drafter.peer]:
        label = {"hf": TransformersPeer, "llama": LlamaCppPeer}[drafter.peer].label
        raise ValueError(f"{label} runs only {' or '.join(PEERS[drafter.peer])}, not "
                         f"{drafter.spec!r}")
