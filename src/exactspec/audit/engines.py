"""Engines under test: anything that can sample the first m tokens of a continuation.

The audit compares an engine's samples with the target's exact probabilities, so any engine
that decodes the same target model can be audited: exactspec itself (with any proposer, or
a broken control), transformers ``generate()`` with its own speculative modes, and
llama-cpp-python's ``generate()`` with its prompt-lookup draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from exactspec.backends.base import Backend
from exactspec.engine import SpeculativeGenerator
from exactspec.sampling import SamplingParams

HF_SUPPORTED_FIELDS = ("temperature", "top_k", "top_p", "min_p", "seed", "max_new_tokens")
"""SamplingParams fields the transformers adapter translates; others are refused."""


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
        for result in results:
            stats = result.stats
            self.drafted += stats.drafted_tokens
            self.accepted += stats.accepted_tokens
            for i, (d, a) in enumerate(zip(stats.drafted_per_position,
                                           stats.accepted_per_position)):
                self.drafted_per_position[i] += d
                self.accepted_per_position[i] += a
        return [tuple(result.token_ids) for result in results]


class TransformersGenerateEngine:
    """transformers ``generate()`` on the target's own model object, ``do_sample=True``.

    Args:
        target: the target's transformers backend.
        name: e.g. ``hf-prompt-lookup:k=4``.
        generate_kwargs: what selects the mode, e.g. ``{"prompt_lookup_num_tokens": 4}``,
            ``{"assistant_model": model}`` or ``{"assistant_early_exit": 16}``.
    """

    def __init__(self, target: Backend, name: str, generate_kwargs: dict) -> None:
        if getattr(target, "model", None) is None:
            raise ValueError(f"engine {name!r} needs the transformers backend")
        self.target, self.name, self.generate_kwargs = target, name, generate_kwargs
        self.drafted = self.accepted = None
        self.drafted_per_position = self.accepted_per_position = None

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        changed = [f for f, value in vars(params).items()
                   if f not in HF_SUPPORTED_FIELDS and value != getattr(SamplingParams(), f)]
        if changed:
            raise ValueError(f"the transformers adapter does not translate {', '.join(changed)}; "
                             f"it supports {', '.join(HF_SUPPORTED_FIELDS)}")
        model = self.target.model
        input_ids = torch.tensor([list(prompt_ids)], device=self.target.device)
        eos = list(self.target.eos_token_ids)
        sampling = {"do_sample": False} if params.greedy else {
            "do_sample": True, "temperature": params.temperature, "top_k": params.top_k,
            "top_p": params.top_p, "min_p": params.min_p or None}
        if params.seed is not None:
            torch.manual_seed(params.seed)
        samples = []
        with torch.inference_mode():
            for _ in range(num_samples):
                output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                        max_new_tokens=params.max_new_tokens,
                                        eos_token_id=eos or None, pad_token_id=eos[0] if eos else 0,
                                        **sampling, **self.generate_kwargs)
                samples.append(tuple(output[0, input_ids.shape[1]:].tolist()))
        return samples


class LlamaCppGenerateEngine:
    """llama-cpp-python's own ``Llama.generate()`` on the target's GGUF file, sampling, with
    its ``LlamaPromptLookupDecoding`` draft (``num_pred_tokens`` = k) or none.

    llama-cpp-python verifies a draft by sampling the target at every drafted position and
    keeping the drafts that equal the samples, which is exact for a deterministic draft.
    Its sampler applies top-k, top-p and min-p *before* the temperature (exactspec,
    transformers and vLLM apply them after), so only temperature sampling is comparable
    with the reference; other warpers are refused.

    Args:
        target: the target's llama.cpp backend.
        name: how reports call it.
        k: drafted tokens per cycle (0: no draft).
    Raises:
        ValueError: if ``target`` is not a llama.cpp backend.
    """

    def __init__(self, target: Backend, name: str, k: int) -> None:
        from exactspec.backends.llama_cpp_backend import LlamaCppBackend

        if not isinstance(target, LlamaCppBackend):
            raise ValueError(f"engine {name!r} needs the llama_cpp backend (--backend llama_cpp)")
        self.llama = target.prompt_lookup_peer(k) if k else target.new_llama()
        self.eos = set(target.eos_token_ids)
        self.name = name
        self.drafted = self.accepted = None
        self.drafted_per_position = self.accepted_per_position = None

    def sample(self, prompt_ids: Sequence[int], params: SamplingParams,
               num_samples: int) -> list[tuple[int, ...]]:
        defaults = SamplingParams()
        changed = [f for f, value in vars(params).items()
                   if f not in ("temperature", "seed", "max_new_tokens")
                   and value != getattr(defaults, f)]
        if changed:
            raise ValueError(
                f"the llama-cpp-python adapter samples with a temperature only (it got "
                f"{', '.join(changed)}): llama-cpp-python applies top-k, top-p and min-p "
                "before the temperature, a different distribution by definition; audit it "
                "with --top-p 1 --top-k 0 --min-p 0")
        from exactspec.backends.llama_cpp_backend import peer_generate

        samples = []
        for i in range(num_samples):
            self.llama.set_seed((params.seed or 0) * 1_000_003 + i)
            samples.append(tuple(peer_generate(self.llama, prompt_ids, params.max_new_tokens,
                                               self.eos, temp=params.temperature)))
        return samples
