"""Proposers draft tokens for the target to verify. See :mod:`exactspec.proposers.base`."""

from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.early_exit import EarlyExitProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.proposers.spec import ProposerSpec, build_proposer, parse_proposer
from exactspec.proposers.suffix import SuffixCorpus, SuffixProposer

__all__ = ["EMPTY_PROPOSAL", "DraftModelProposer", "ProposerSpec", "EarlyExitProposer",
           "PromptLookupProposer", "Proposal", "Proposer", "SuffixCorpus", "SuffixProposer", "build_proposer",
           "parse_proposer"]
