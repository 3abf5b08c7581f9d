"""exactspec: exact speculative decoding — faster generation, the target's distribution unchanged.

Quick use::

    from exactspec import SamplingParams, SpeculativeGenerator, PromptLookupProposer, load_model

    target = load_model()  # smollm2-135m-instruct; llama.cpp if installed, else transformers float32
    generator = SpeculativeGenerator(target, PromptLookupProposer(), num_speculative_tokens=8)
    result = generator.generate("Summarise: ...", SamplingParams(max_new_tokens=64), chat=True)
    print(result.text, result.stats.summary())

The names below are imported on first use (PEP 562), so that importing a part of the
package (``exactspec.cli`` for ``exactspec --help``) does not load PyTorch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exactspec.backends import (Backend, LlamaCppBackend, TransformersBackend,
                                    UnsupportedModelError)
    from exactspec.batching import BatchedGenerator
    from exactspec.engine import GenerationResult, SpeculativeGenerator
    from exactspec.generation_stats import GenerationStats
    from exactspec.model_files import DEFAULT_MODEL, ModelNotFoundError
    from exactspec.models import load_model
    from exactspec.proposers import (DraftModelProposer, EarlyExitProposer,
                                     PromptLookupProposer, Proposal, Proposer, SuffixCorpus,
                                     SuffixProposer)
    from exactspec.sampling import SamplingParams

__version__ = "0.1.0"

_EXPORTS = {
    "exactspec.backends": ("Backend", "LlamaCppBackend", "TransformersBackend",
                           "UnsupportedModelError"),
    "exactspec.batching": ("BatchedGenerator",),
    "exactspec.engine": ("GenerationResult", "SpeculativeGenerator"),
    "exactspec.generation_stats": ("GenerationStats",),
    "exactspec.model_files": ("DEFAULT_MODEL", "ModelNotFoundError"),
    "exactspec.models": ("load_model",),
    "exactspec.proposers": ("DraftModelProposer", "EarlyExitProposer", "PromptLookupProposer",
                            "Proposal", "Proposer", "SuffixCorpus", "SuffixProposer"),
    "exactspec.sampling": ("SamplingParams",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["Backend", "BatchedGenerator", "DEFAULT_MODEL", "DraftModelProposer",
           "EarlyExitProposer", "GenerationResult", "GenerationStats",
           "LlamaCppBackend", "ModelNotFoundError", "PromptLookupProposer", "Proposal",
           "Proposer", "SamplingParams", "SpeculativeGenerator", "SuffixCorpus",
           "SuffixProposer", "TransformersBackend", "UnsupportedModelError",
           "load_model"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'exactspec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
