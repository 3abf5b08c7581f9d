"""Decoding methods the benchmark compares: exactspec's own, and peers on the same model.

A method is written ``KIND[:ARG][:key=value...]``:
    plain                        exactspec, plain decoding (the baseline)
    prompt-lookup:k=4[:ngram=2-3]  exactspec with prompt lookup
    ...:policy=auto              any exactspec method with a speculation-length policy
                                 (auto, heuristic, confidence); default constant (fixed k)
    draft:MODEL:k=4              exactspec with a draft model (name, folder or .gguf)
    early-exit:L:k=4             exactspec with the target's first L layers as the draft
    hf-plain                     transformers ``generate()``, greedy/sampling, no speculation
    hf-prompt-lookup:k=10        transformers ``generate(prompt_lookup_num_tokens=k)``
    hf-assistant:MODEL[:k=N]     transformers ``generate(assistant_model=MODEL)``
    hf-early-exit:L[:k=N]        transformers ``generate(assistant_early_exit=L)``
    llama-plain                  llama-cpp-python's own ``Llama.generate()``, no speculation
    llama-prompt-lookup:k=10     ``Llama(draft_model=LlamaPromptLookupDecoding(
                                 num_pred_tokens=k))``, its prompt lookup (n-grams ≤ 2)
Peers (``hf-*`` on the transformers backend, ``llama-*`` on the llama_cpp backend) run on
the same model file, prompts and max_new_tokens (``hf-*`` on the same model object).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from exactspec.backends.base import Backend
from exactspec.engine import SpeculativeGenerator
from exactspec.proposers import DraftModelProposer, EarlyExitProposer, PromptLookupProposer
from exactspec.sampling import SamplingParams

KINDS = ("plain", "prompt-lookup", "draft", "early-exit", "hf-plain", "hf-prompt-lookup",
         "hf-assistant", "hf-early-exit", "llama-plain", "llama-prompt-lookup")
WITH_ARGUMENT = ("draft", "early-exit", "hf-assistant", "hf-early-exit")


@dataclass
class Outcome:
    """One generation: tokens, wall seconds, and exactspec's stats (None for peers)."""

    token_ids: list[int]
    seconds: float
    stats: dict | None


@dataclass
class Method:
    """A named way to decode; ``run(prompt_ids, params)`` → :class:`Outcome`."""

    name: str
    kind: str
    k: int
    run: Callable[[list[int], SamplingParams], Outcome]

    @property
    def is_peer(self) -> bool:
        return is_peer(self.name)


def is_peer(method_name: str) -> bool:
    """Whether a method is another engine's (``hf-*``, ``llama-*``) rather than exactspec's."""
    return method_name.startswith(("hf-", "llama-"))


@dataclass(frozen=True)
class MethodSpec:
    """A method spec string taken apart (see module docstring); ``model`` is the MODEL of
    ``draft:`` and ``hf-assistant:``, ``layers`` the L of the early-exit kinds."""

    spec: str
    kind: str
    k: int
    ngram: tuple[int, int]
    layers: int
    policy: str
    model: str | None


ALLOWED = ("plain, prompt-lookup:k=4[:ngram=2-3][:policy=auto], draft:MODEL:k=4, "
           "early-exit:L:k=4, hf-plain, hf-prompt-lookup:k=10, hf-assistant:MODEL, "
           "hf-early-exit:L, llama-plain, llama-prompt-lookup:k=10")


def parse_method_spec(spec: str) -> MethodSpec:
    """Take a method spec apart and check it, without any model (see module docstring).

    Raises:
        ValueError: naming the bad spec and the allowed forms.
    """
    from exactspec.speculation_length import POLICIES

    kind, *parts = spec.split(":")
    options = dict(part.split("=", 1) for part in parts if "=" in part)
    positional = [part for part in parts if "=" not in part]
    if kind not in KINDS or (kind in WITH_ARGUMENT) != bool(positional) \
            or len(positional) > 1 or set(options) - {"k", "ngram", "policy"}:
        raise ValueError(f"method {spec!r} is invalid: use one of {ALLOWED}")
    try:
        k = int(options.get("k", 10 if kind in ("hf-prompt-lookup", "llama-prompt-lookup") else 4))
        low, high = (int(n) for n in options.get("ngram", "2-3").split("-"))
        layers = int(positional[0]) if kind in ("early-exit", "hf-early-exit") else 0
    except ValueError:
        raise ValueError(f"method {spec!r} is invalid: k, L and ngram (MIN-MAX) take "
                         "integers") from None
    if kind in ("early-exit", "hf-early-exit") and layers < 1:
        raise ValueError(f"method {spec!r} is invalid: L = {layers} must be ≥ 1")
    policy = options.get("policy", "constant")
    if policy not in POLICIES:
        raise ValueError(f"method {spec!r} is invalid: policy {policy!r} is not one of "
                         f"{', '.join(POLICIES)}")
    model = positional[0] if kind in ("draft", "hf-assistant") else None
    return MethodSpec(spec, kind, k, (low, high), layers, policy, model)


def parse_method(spec: str, target: Backend, load_model: Callable[[str], Backend], *,
                 allow_batch_variance: bool = False) -> Method:
    """Build a :class:`Method` from its spec string (see module docstring);
    ``allow_batch_variance`` as in :class:`~exactspec.engine.SpeculativeGenerator`.

    Raises:
        ValueError: naming the bad spec and the allowed forms.
    """
    parsed = parse_method_spec(spec)
    kind, k, (low, high), layers, policy = (parsed.kind, parsed.k, parsed.ngram, parsed.layers,
                                            parsed.policy)
    if kind == "plain":
        return _ours(spec, kind, 0, SpeculativeGenerator(target, None))
    if kind == "prompt-lookup":
        proposer = PromptLookupProposer(low, high)
    elif kind == "draft":
        proposer = DraftModelProposer(load_model(parsed.model), target)
    elif kind == "early-exit":
        proposer = EarlyExitProposer(target, layers)
    if kind in ("prompt-lookup", "draft", "early-exit"):
        return _ours(spec, kind, k, SpeculativeGenerator(
            target, proposer, k, policy, allow_batch_variance=allow_batch_variance))
    if kind.startswith("llama-"):
        return _llama_method(spec, kind, k, target)
    model = getattr(target, "model", None)
    if model is None:
        raise ValueError(f"method {spec!r} needs the transformers backend (--backend transformers)")
    extra: dict = {}
    if kind == "hf-prompt-lookup":
        extra = {"prompt_lookup_num_tokens": k}
    elif kind == "hf-assistant":
        assistant = load_model(parsed.model).model
        assistant.generation_config.num_assistant_tokens = k
        extra = {"assistant_model": assistant}
    elif kind == "hf-early-exit":
        extra = {"assistant_early_exit": layers, "num_assistant_tokens": k}
    return Method(spec, kind, k if kind != "hf-plain" else 0,
                  lambda prompt_ids, params: _hf_generate(target, prompt_ids, params, extra))


def _ours(name: str, kind: str, k: int, generator: SpeculativeGenerator) -> Method:
    def run(prompt_ids: list[int], params: SamplingParams) -> Outcome:
        result = generator.generate(prompt_ids, params)
        return Outcome(result.token_ids, result.stats.total_seconds, result.stats.to_dict())
    return Method(name, kind, k, run)


def _hf_generate(target: Backend, prompt_ids: list[int], params: SamplingParams,
                 extra: dict) -> Outcome:
    """transformers ``generate()`` on the target's own model object."""
    model = target.model
    input_ids = torch.tensor([prompt_ids], device=target.device)
    eos = list(target.eos_token_ids) or None
    sampling = {"do_sample": False} if params.greedy else {
        "do_sample": True, "temperature": params.temperature, "top_k": params.top_k or None,
        "top_p": params.top_p}
    if params.seed is not None:
        torch.manual_seed(params.seed)
    start = time.perf_counter()
    with torch.inference_mode():
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=params.max_new_tokens, eos_token_id=eos,
                                pad_token_id=eos[0] if eos else 0, **sampling, **extra)
    seconds = time.perf_counter() - start
    return Outcome(output[0, len(prompt_ids):].tolist(), seconds, None)


def _llama_method(spec: str, kind: str, k: int, target: Backend) -> Method:
    """A llama-cpp-python peer: its own generate on the target's model (``llama-plain``) or
    on a second instance of the same file with its prompt-lookup draft."""
    from exactspec.backends.llama_cpp_backend import LlamaCppBackend, peer_generate

    if not isinstance(target, LlamaCppBackend):
        raise ValueError(f"method {spec!r} needs the llama_cpp backend (--backend llama_cpp)")
    llama = target.llama if kind == "llama-plain" else target.prompt_lookup_peer(k)
    eos = set(target.eos_token_ids)

    def run(prompt_ids: list[int], params: SamplingParams) -> Outcome:
        sampling = {} if params.greedy else {"temp": params.temperature, "top_k": params.top_k,
                                             "top_p": params.top_p, "min_p": params.min_p}
        if params.seed is not None:
            llama.set_seed(params.seed)
        start = time.perf_counter()
        token_ids = peer_generate(llama, prompt_ids, params.max_new_tokens, eos, **sampling)
        return Outcome(token_ids, time.perf_counter() - start, None)
    return Method(spec, kind, k if kind != "llama-plain" else 0, run)
