"""Proposers draft tokens for the target to verify. See :mod:`exactspec.proposers.base`."""

from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.early_exit import EarlyExitProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer
from exactspec.proposers.spec import PROPOSER_SPECS, parse_proposer

__all__ = ["EMPTY_PROPOSAL", "PROPOSER_SPECS", "DraftModelProposer", "EarlyExitProposer",
           "PromptLookupProposer", "Proposal", "Proposer", "parse_proposer"]
