"""exactspec: exact speculative decoding — faster generation, the target's distribution unchanged.

Quick use::

    from exactspec import ModelSpec, SamplingParams, SpeculationSpec

    spec = SpeculationSpec(ModelSpec(), "prompt-lookup", num_speculative_tokens=8)
    generator = spec.load().generator()  # smollm2-135m-instruct, its best backend here
    result = generator.generate("Summarise: ...", SamplingParams(max_new_tokens=64), chat=True)
    print(result.text, result.stats.summary())

The parts (``SpeculativeGenerator(target, PromptLookupProposer(), 8)`` and the rest):
docs/api.md.

The names below are imported on first use (PEP 562, through ``lazy_loader``), so that
importing a part of the package (``exactspec.cli`` for ``exactspec --help``) does not load
PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:
    from exactspec.backends import (Backend, LlamaCppBackend, TransformersBackend,
                                    UnsupportedModelError)
    from exactspec.batching import BatchedGenerator
    from exactspec.constraints import Constraint
    from exactspec.generator import GenerationResult, SpeculativeGenerator
    from exactspec.generation_stats import GenerationStats
    from exactspec.model_files import DEFAULT_MODEL, ModelNotFoundError
    from exactspec.models import ModelSpec, load_model
    from exactspec.proposers import (DraftModelProposer, EarlyExitProposer, FallbackProposer,
                                     PromptLookupProposer, Proposal, Proposer, SuffixCorpus,
                                     SuffixProposer)
    from exactspec.sampling import SamplingParams
    from exactspec.speculation import Speculation, SpeculationSettings, SpeculationSpec

__version__ = "0.1.0"

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "backends": ("Backend", "LlamaCppBackend", "TransformersBackend", "UnsupportedModelError"),
    "batching": ("BatchedGenerator",),
    "constraints": ("Constraint",),
    "generator": ("GenerationResult", "SpeculativeGenerator"),
    "generation_stats": ("GenerationStats",),
    "model_files": ("DEFAULT_MODEL", "ModelNotFoundError"),
    "models": ("ModelSpec", "load_model"),
    "proposers": ("DraftModelProposer", "EarlyExitProposer", "FallbackProposer",
                  "PromptLookupProposer", "Proposal", "Proposer", "SuffixCorpus",
                  "SuffixProposer"),
    "sampling": ("SamplingParams",),
    "speculation": ("Speculation", "SpeculationSettings", "SpeculationSpec"),
})
