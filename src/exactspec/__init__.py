"""exactspec: exact speculative decoding — faster generation, the target's distribution unchanged.

Quick use::

    from exactspec import SamplingParams, SpeculativeGenerator, PromptLookupProposer, load_model

    target = load_model()  # smollm2-135m-instruct; llama.cpp if installed, else transformers float32
    generator = SpeculativeGenerator(target, PromptLookupProposer(), num_speculative_tokens=8)
    result = generator.generate("Summarise: ...", SamplingParams(max_new_tokens=64), chat=True)
    print(result.text, result.stats.summary())
"""

from exactspec.backends import Backend, LlamaCppBackend, TransformersBackend, UnsupportedModelError
from exactspec.batching import BatchedGenerator
from exactspec.engine import GenerationResult, SpeculativeGenerator
from exactspec.generation_stats import GenerationStats
from exactspec.model_files import DEFAULT_MODEL, ModelNotFoundError
from exactspec.models import load_model
from exactspec.proposers import (DraftModelProposer, EarlyExitProposer, PromptLookupProposer,
                                 Proposal, Proposer, SuffixCorpus, SuffixProposer)
from exactspec.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_MODEL", "Backend", "BatchedGenerator", "DraftModelProposer", "LlamaCppBackend", "EarlyExitProposer", "GenerationResult", "GenerationStats",
    "ModelNotFoundError", "PromptLookupProposer", "Proposal", "Proposer", "SamplingParams",
    "SpeculativeGenerator", "SuffixCorpus", "SuffixProposer", "TransformersBackend", "UnsupportedModelError", "load_model",
]
