"""Proposers draft tokens for the target to verify. See :mod:`exactspec.proposers.base`."""

from exactspec.proposers.base import EMPTY_PROPOSAL, Proposal, Proposer
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["EMPTY_PROPOSAL", "DraftModelProposer", "PromptLookupProposer", "Proposal", "Proposer"]
