"""exactspec's proposer for a proposer spec (:mod:`exactspec.proposers.spec`, the grammar of
``--proposer`` and ``bench --method``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from exactspec.backends.base import Backend
from exactspec.proposers.base import Proposer
from exactspec.proposers.draft_model import DEFAULT_DRAFT_WEIGHTS, DraftModelProposer
from exactspec.proposers.early_exit import EarlyExitProposer
from exactspec.proposers.fallback import FallbackProposer
from exactspec.proposers.forced import ForcedTokenProposer
from exactspec.proposers.head import HeadProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.proposers.spec import ProposerSpec
from exactspec.proposers.suffix import SuffixCorpus, SuffixProposer


def build_proposer(proposer_spec: ProposerSpec, target: Backend,
                   load_model: Callable[..., Backend]) -> Proposer | None:
    """exactspec's proposer for ``proposer`` on ``target`` (None for ``plain``); ``load_model``
    loads a draft model by name or path, ``load_model(name, weight_type=T)`` with its weights
    converted to the GGUF type T (``draft:…:weights=``).

    Raises:
        ValueError: if ``proposer`` names a peer (it is not exactspec's), or L ≥ the target's
            layer count.
        UnsupportedModelError: for early exit or a draft head on a backend other than
            transformers, no head shipped for the target, or a draft model whose tokenizer
            differs from the target's.
        FileNotFoundError: for a head file that does not exist.
    """
    if proposer_spec.peer:
        raise ValueError(f"{proposer_spec.spec!r} is run by a peer (see exactspec.peers), not exactspec")
    if proposer_spec.fallback is not None:
        matcher = dataclasses.replace(proposer_spec, fallback=None)
        return FallbackProposer(build_proposer(matcher, target, load_model),
                                build_proposer(proposer_spec.fallback, target, load_model))
    if proposer_spec.kind == "forced":
        return ForcedTokenProposer()
    if proposer_spec.kind == "prompt-lookup":
        return PromptLookupProposer(*proposer_spec.ngram)
    if proposer_spec.kind == "suffix":
        return SuffixProposer(*proposer_spec.ngram, corpus=proposer_spec.corpus and SuffixCorpus(
            proposer_spec.corpus, *proposer_spec.ngram))
    if proposer_spec.kind == "early-exit":
        return EarlyExitProposer(target, proposer_spec.layers)
    if proposer_spec.kind == "draft":
        return DraftModelProposer(load_draft(proposer_spec, load_model), target,
                                  draft_vocabulary=proposer_spec.vocab)
    if proposer_spec.kind == "head":
        return HeadProposer(target, proposer_spec.head, tree_nodes=proposer_spec.tree,
                            weights=proposer_spec.weights or "q4_0")
    return None


def load_draft(proposer_spec: ProposerSpec, load_model: Callable[..., Backend]) -> Backend:
    """The draft model of ``draft:MODEL[:weights=W]``: with ``weights=W`` its weights
    converted to W (``file``: as ``load_model`` gives them); without, converted to
    :data:`~exactspec.proposers.draft_model.DEFAULT_DRAFT_WEIGHTS` where it runs on the
    native backend with weights of more than 6 bits (Q8_0, F16, BF16, F32: loaded, then
    loaded again converted), else as given."""
    name, weights = proposer_spec.model, proposer_spec.weights
    if weights is not None:
        return (load_model(name) if weights == "file"
                else load_model(name, weight_type=weights.upper()))
    draft = load_model(name)
    if getattr(getattr(draft, "model", None), "bits_per_weight", 0) > 6:
        del draft  # its memory before the converted copy's
        return load_model(name, weight_type=DEFAULT_DRAFT_WEIGHTS.upper())
    return draft
