"""One set-up from a spec: a target, a proposer with its draft models, k and the policy,
checked before anything loads, loaded once, and made into what each tool runs.

Every tool maps its flags to a :class:`SpeculationSpec` and asks it for the rest::

    spec = SpeculationSpec(ModelSpec("qwen2.5-coder-1.5b-instruct"),
                           "draft:qwen2.5-coder-0.5b-instruct", num_speculative_tokens=5)
    spec.check()                    # every refusal a user can get, in a moment, no weights
    speculation = spec.load()       # the target, then the proposer and its draft model
    generator = speculation.generator()          # a SpeculativeGenerator
    batched = speculation.batched_generator(4)   # a BatchedGenerator of 4 rows

``exactspec generate`` uses :meth:`Speculation.generator`, ``serve`` one generator per
request's settings (:meth:`Speculation.generator` with :class:`SpeculationSettings`), the
audit (:mod:`exactspec.audit.pipeline`) the engine, its broken control and batching, and
``bench`` one :class:`Speculation` per method on the same target
(:meth:`Speculation.with_proposer`) and the peers (:meth:`Speculation.peer`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from exactspec.backends.base import Backend
from exactspec.batching import BatchedGenerator
from exactspec.generator import SpeculativeGenerator
from exactspec.load_options import DEFAULT_MAX_BATCH_SIZE
from exactspec.model_files import (check_model_path, context_length, layer_count,
                                   resolve_model_path)
from exactspec.models import ModelSpec, choose_backend
from exactspec.proposers.base import Proposer
from exactspec.proposers.build import build_proposer
from exactspec.proposers.spec import ProposerSpec, parse_proposer
from exactspec.request import Prompt, prompt_tokens
from exactspec.speculation_length import DEFAULT_K, DEFAULT_POLICY, POLICIES


class InvalidValueError(ValueError):
    """A value of the spec outside its range (a command line's usage error, exit status 2)."""


@dataclass(frozen=True)
class SpeculationSettings:
    """What a generation runs with: ``num_speculative_tokens`` (the most drafted per cycle,
    0 = plain decoding) and the speculation-length ``policy``
    (:data:`~exactspec.speculation_length.POLICIES`)."""

    num_speculative_tokens: int = DEFAULT_K
    policy: str = DEFAULT_POLICY


@dataclass(frozen=True)
class SpeculationSpec:
    """What a tool speculates with, before anything is loaded (picklable: a Ray worker loads
    from it).

    Attributes:
        model: the target; draft models load with its options.
        proposer: a proposer spec (:mod:`exactspec.proposers.spec`), text or parsed.
        num_speculative_tokens: the most tokens drafted per cycle (≥ 0; 0: plain decoding).
        policy: how many to draft each cycle (:data:`~exactspec.speculation_length.POLICIES`).
        allow_batch_variance: as :class:`~exactspec.generator.SpeculativeGenerator`'s.
        max_batch_size: rows decoded together by :meth:`Speculation.batched_generator`
            (None: one sequence at a time).
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    proposer: ProposerSpec | str = "prompt-lookup"
    num_speculative_tokens: int = DEFAULT_K
    policy: str = DEFAULT_POLICY
    allow_batch_variance: bool = False
    max_batch_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.proposer, str):
            object.__setattr__(self, "proposer", parse_proposer(self.proposer))

    @property
    def settings(self) -> SpeculationSettings:
        """k and the policy (k 0 for ``plain``)."""
        return SpeculationSettings(self.num_speculative_tokens if self.proposer.drafts else 0,
                                   self.policy)

    def check(self, *, model_flag: str = "model", proposer_flag: str | None = None) -> str:
        """Every refusal a user can get before any weight is read, in a moment: the target
        and each draft model exist and look like models
        (:func:`~exactspec.model_files.check_model_path`), the model options and the
        proposer's needs fit the target (:func:`~exactspec.models.choose_backend`), the
        context holds ``max_model_len``, early exit's L is below the target's layer count,
        a draft head file exists, k ≥ 0 and the policy is known. Messages name the target
        ``model_flag`` and the proposer ``proposer_flag`` (default ``proposer SPEC``), as
        a command line names its flags.

        Returns:
            the target's backend (``native``, ``transformers`` or ``llama_cpp``).
        Raises:
            ModelNotFoundError: a model that cannot be found (how to get it said).
            InvalidValueError: k < 0, early exit's L out of range, an unknown policy.
            ValueError: the rest, naming the flag and the bad value.
        """
        proposer, model = self.proposer, self.model
        flag = proposer_flag or f"proposer {proposer.spec}"
        if self.num_speculative_tokens < 0:
            raise InvalidValueError(f"num_speculative_tokens {self.num_speculative_tokens} is "
                                    "invalid: it must be ≥ 0 (0 = plain decoding)")
        if self.policy not in POLICIES:
            raise InvalidValueError(f"policy {self.policy!r} is invalid: choose one of "
                                    f"{', '.join(POLICIES)}")
        drafts = {flag: part.model for part in proposer.parts if part.model}
        for named, name in {model_flag: model.name_or_path, **drafts}.items():
            try:
                path = check_model_path(name)
            except (FileNotFoundError, ValueError) as error:
                raise type(error)(f"{named}: {error}") from None
            if named == model_flag:
                backend = choose_backend(path, model.backend, device=model.device,
                                         dtype=model.dtype, kernels=model.kernels,
                                         proposer=proposer)
                limit = context_length(path) if model.max_model_len else None
                if limit is not None and model.max_model_len > limit:
                    raise ValueError(f"--max-model-len {model.max_model_len} is invalid: the "
                                     f"model's context holds {limit} tokens")
        for part in proposer.parts:
            if part.kind == "early-exit":
                check_early_exit(flag if flag == "--early-exit" else f"{flag}: L =",
                                 part.layers,
                                 layer_count(resolve_model_path(model.name_or_path)))
        check_head_files(proposer, flag)
        return backend

    def load(self) -> Speculation:
        """The target, then the proposer with its draft models (each loaded once, with the
        target's options).

        Raises:
            ModelNotFoundError, UnsupportedModelError, LlamaCppNotInstalledError,
            ValueError: as loading the models and building the proposer do.
        """
        target = self.model.load(proposer=self.proposer)
        load_model = functools.cache(self.model.load)  # a draft named twice loads once
        return Speculation(target, build_proposer(self.proposer, target, load_model),
                           self.settings, allow_batch_variance=self.allow_batch_variance,
                           max_batch_size=self.max_batch_size, proposer_spec=self.proposer,
                           load_model=load_model)


def check_early_exit(flag: str, layers: int, num_layers: int | None) -> None:
    """That 1 ≤ ``layers`` < ``num_layers``, the target's layer count (None: unknown, then
    only ≥ 1 is checked); ``flag`` names it.

    Raises:
        InvalidValueError: naming ``flag``, the value and the range.
    """
    if num_layers is not None and not 1 <= layers < num_layers:
        raise InvalidValueError(f"{flag} {layers} is invalid: it must be in [1, "
                                f"{num_layers - 1}] (the target has {num_layers} layers)")
    if layers < 1:
        raise InvalidValueError(f"{flag} {layers} is invalid: it must be ≥ 1")


def check_head_files(proposer: ProposerSpec, flag: str) -> None:
    """That each draft head file ``proposer`` names exists (``flag`` names it).

    Raises:
        ValueError: naming the flag and the missing file.
    """
    for part in proposer.parts:
        if part.head is not None and not Path(part.head).expanduser().is_file():
            raise ValueError(f"{flag}: draft head {part.head!r} does not exist")


class Speculation:
    """A loaded set-up: the target, the proposer (None: plain decoding) and the default
    settings, and the generators made from them.

    Args:
        target: the target's backend.
        proposer: the proposer drafting for it (None: plain decoding).
        settings: the default k and policy.
        allow_batch_variance: as :class:`~exactspec.generator.SpeculativeGenerator`'s.
        max_batch_size: :meth:`batched_generator`'s default rows (None:
            :data:`~exactspec.load_options.DEFAULT_MAX_BATCH_SIZE`).
        proposer_spec: the spec ``proposer`` was built from (None: not from a spec).
        load_model: loads another model with the target's options (draft models of
            :meth:`with_proposer` and :meth:`peer`; None: the target only).
    """

    def __init__(self, target: Backend, proposer: Proposer | None,
                 settings: SpeculationSettings = SpeculationSettings(), *,
                 allow_batch_variance: bool = False, max_batch_size: int | None = None,
                 proposer_spec: ProposerSpec | None = None,
                 load_model: Callable[..., Backend] | None = None) -> None:
        self.target, self.proposer, self.settings = target, proposer, settings
        self.allow_batch_variance, self.max_batch_size = allow_batch_variance, max_batch_size
        self.proposer_spec, self.load_model = proposer_spec, load_model

    @property
    def chat_template(self) -> bool:
        """Whether the target's tokenizer has a chat template."""
        try:
            self.target.tokenizer.apply_chat_template("")
        except ValueError:
            return False
        return True

    def generator(self, settings: SpeculationSettings | None = None, *,
                  factory: Callable[..., SpeculativeGenerator] = SpeculativeGenerator
                  ) -> SpeculativeGenerator:
        """A generator of ``settings`` (default: this set-up's): plain decoding where k is
        0 or there is no proposer, else ``factory`` (a
        :class:`~exactspec.generator.SpeculativeGenerator`, or the audit's broken one),
        called as that class is.

        Raises:
            ValueError, UnsupportedModelError: as
                :class:`~exactspec.generator.SpeculativeGenerator` raises them (a policy
                the proposer cannot run, a target that is not batch-invariant).
        """
        settings = settings or self.settings
        plain = settings.num_speculative_tokens == 0 or self.proposer is None
        return (SpeculativeGenerator if plain else factory)(
            self.target, None if plain else self.proposer, settings.num_speculative_tokens,
            settings.policy, allow_batch_variance=self.allow_batch_variance)

    def batched_generator(self, max_batch_size: int | None = None,
                          generator: SpeculativeGenerator | None = None) -> BatchedGenerator:
        """A :class:`~exactspec.batching.BatchedGenerator` of ``max_batch_size`` rows
        (default: this set-up's, else
        :data:`~exactspec.load_options.DEFAULT_MAX_BATCH_SIZE`) around ``generator``
        (default: :meth:`generator`)."""
        return BatchedGenerator(generator or self.generator(),
                                max_batch_size or self.max_batch_size or DEFAULT_MAX_BATCH_SIZE)

    def with_proposer(self, proposer_spec: ProposerSpec,
                      settings: SpeculationSettings | None = None) -> Speculation:
        """The same target with another proposer (its draft models loaded by
        ``load_model``), e.g. one bench method each.

        Raises:
            as :func:`~exactspec.proposers.build.build_proposer`.
        """
        return Speculation(self.target,
                           build_proposer(proposer_spec, self.target, self.load_model),
                           settings or self.settings,
                           allow_batch_variance=self.allow_batch_variance,
                           max_batch_size=self.max_batch_size, proposer_spec=proposer_spec,
                           load_model=self.load_model)

    def peer(self, proposer_spec: ProposerSpec, k: int | None = None, *, share: bool = False):
        """Another engine (``proposer_spec.peer``: transformers or llama.cpp) running
        ``proposer_spec`` on this target with ``k`` tokens a draft (default: this set-up's);
        see :func:`~exactspec.peers.make_peer`."""
        from exactspec.peers import make_peer

        k = self.settings.num_speculative_tokens if k is None else k
        return make_peer(proposer_spec, self.target, self.load_model, k, share=share)

    def prompt_ids(self, prompt: Prompt, chat: bool) -> list[int]:
        """``prompt`` as the target's token ids (through its chat template where ``chat``),
        checked (:func:`~exactspec.request.prompt_tokens`)."""
        return prompt_tokens(self.target, prompt, chat)

