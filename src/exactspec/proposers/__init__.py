"""Proposers draft tokens for the target to verify. See :mod:`exactspec.proposers.base`.

The names below are imported on first use (PEP 562, through ``lazy_loader``): the command
line's parser reads the proposer spec grammar (:mod:`exactspec.proposers.spec`) without loading PyTorch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:
    from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer
    from exactspec.proposers.build import build_proposer
    from exactspec.proposers.draft_model import DraftModelProposer
    from exactspec.proposers.early_exit import EarlyExitProposer
    from exactspec.proposers.fallback import FallbackProposer
    from exactspec.proposers.forced import ForcedTokenProposer
    from exactspec.proposers.prompt_lookup import PromptLookupProposer
    from exactspec.proposers.spec import ProposerSpec, parse_proposer
    from exactspec.proposers.suffix import SuffixCorpus, SuffixProposer

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "base": ("EMPTY_PROPOSAL", "Proposal", "Proposer"),
    "build": ("build_proposer",),
    "draft_model": ("DraftModelProposer",),
    "early_exit": ("EarlyExitProposer",),
    "fallback": ("FallbackProposer",),
    "forced": ("ForcedTokenProposer",),
    "prompt_lookup": ("PromptLookupProposer",),
    "spec": ("ProposerSpec", "parse_proposer"),
    "suffix": ("SuffixCorpus", "SuffixProposer"),
})
