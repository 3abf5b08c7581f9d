"""Proposers draft tokens for the target to verify. See :mod:`exactspec.proposers.base`.

The names below are imported on first use (PEP 562): the command line's parser reads the
proposer spec grammar (:mod:`exactspec.proposers.spec`) without loading PyTorch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer
    from exactspec.proposers.build import build_proposer
    from exactspec.proposers.draft_model import DraftModelProposer
    from exactspec.proposers.early_exit import EarlyExitProposer
    from exactspec.proposers.prompt_lookup import PromptLookupProposer
    from exactspec.proposers.spec import ProposerSpec, parse_proposer
    from exactspec.proposers.suffix import SuffixCorpus, SuffixProposer

_EXPORTS = {
    "exactspec.proposers.base": ("EMPTY_PROPOSAL", "Proposal", "Proposer"),
    "exactspec.proposers.build": ("build_proposer",),
    "exactspec.proposers.draft_model": ("DraftModelProposer",),
    "exactspec.proposers.early_exit": ("EarlyExitProposer",),
    "exactspec.proposers.prompt_lookup": ("PromptLookupProposer",),
    "exactspec.proposers.spec": ("ProposerSpec", "parse_proposer"),
    "exactspec.proposers.suffix": ("SuffixCorpus", "SuffixProposer"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["DraftModelProposer", "EMPTY_PROPOSAL", "EarlyExitProposer",
           "PromptLookupProposer", "Proposal", "Proposer", "ProposerSpec",
           "SuffixCorpus", "SuffixProposer", "build_proposer", "parse_proposer"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'exactspec.proposers' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
