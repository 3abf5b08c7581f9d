"""The exactness audit: does speculative decoding reproduce the target's distribution on a
real model? See :mod:`exactspec.audit.runner` for the procedure. Any
:class:`~exactspec.engines.Engine` can be audited: exactspec (:class:`ExactspecEngine`, or
:class:`BatchedEngine` for batched decoding, with any proposer or a broken control) and the
peers of :mod:`exactspec.peers`."""

from exactspec.audit.broken import BROKEN_VERIFIERS, BrokenGenerator
from exactspec.audit.reference import next_token_probs
from exactspec.audit.report import write_audit_report
from exactspec.audit.runner import (AuditResult, AuditSetup, audit_distribution, check_greedy,
                                    fit_prompt, run_greedy_checks, verdict, verdict_line)
from exactspec.engines import BatchedEngine, Engine, ExactspecEngine

AUDIT_PROMPTS = (
    "red green blue red green blue red green blue red green",
    "The cat sat on the mat. The dog sat on the mat. The cat sat on the",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
)
"""Default prompts: repetitive enough that prompt lookup drafts from the first token."""

__all__ = ["AUDIT_PROMPTS", "AuditResult", "AuditSetup", "BROKEN_VERIFIERS", "BrokenGenerator",
           "BatchedEngine", "Engine", "ExactspecEngine", "audit_distribution",
           "check_greedy", "fit_prompt", "next_token_probs", "run_greedy_checks", "verdict", "verdict_line",
           "write_audit_report"]
