"""The exactness audit: does speculative decoding reproduce the target's distribution on a
real model, or on an engine behind an OpenAI-compatible API? :func:`run` takes an
:class:`AuditSpec` and returns one :class:`AuditResult` whatever the engine and the
reference (the target's exact probabilities, or a second engine's samples), with one
verdict (:func:`verdict`); :func:`write_report` writes it out. The procedures:
:mod:`exactspec.audit.runner` (local), :mod:`exactspec.audit.remote` (over HTTP). Any
:class:`~exactspec.engines.Engine` can be audited: exactspec (:class:`ExactspecEngine`, or
:class:`BatchedEngine` for batched decoding, with any proposer or a broken control), the
peers of :mod:`exactspec.peers`, and :class:`~exactspec.audit.endpoint.Endpoint`.

The names below are imported on first use (PEP 562, through ``lazy_loader``), so that
``exactspec audit --help`` reads :data:`~exactspec.audit.modes.MODES` without loading
PyTorch or SciPy."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

from exactspec.audit.modes import MODES

if TYPE_CHECKING:
    from exactspec.audit.broken import BROKEN_VERIFIERS, BrokenGenerator
    from exactspec.audit.pipeline import AuditSpec, EndpointSpec, run
    from exactspec.audit.reference import (ExactReference, PromptTest, Reference,
                                           SampledReference, fit_prompt, next_token_probs)
    from exactspec.audit.report import write_report
    from exactspec.audit.result import (AuditResult, DistributionTest, GreedyCheck, describer,
                                        verdict, verdict_line)
    from exactspec.audit.runner import (AuditSetup, audit_distribution, check_greedy,
                                        run_greedy_checks)
    from exactspec.engines import BatchedEngine, Engine, ExactspecEngine

AUDIT_PROMPTS = (
    "red green blue red green blue red green blue red green",
    "The cat sat on the mat. The dog sat on the mat. The cat sat on the",
    "Paris is the capital of France. Berlin is the capital of Germany. Rome is the capital of",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a",
    "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3,",
)
"""Default prompts: repetitive enough that prompt lookup drafts from the first token."""


_getattr, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "broken": ("BROKEN_VERIFIERS", "BrokenGenerator"),
    "pipeline": ("AuditSpec", "EndpointSpec", "run"),
    "reference": ("ExactReference", "PromptTest", "Reference", "SampledReference",
                  "fit_prompt", "next_token_probs"),
    "report": ("write_report",),
    "result": ("AuditResult", "DistributionTest", "GreedyCheck", "describer", "verdict",
               "verdict_line"),
    "runner": ("AuditSetup", "audit_distribution", "check_greedy", "run_greedy_checks"),
})
ENGINES = ("BatchedEngine", "Engine", "ExactspecEngine")
"""What is audited, re-exported from :mod:`exactspec.engines`."""
__all__ = sorted([*__all__, *ENGINES, "AUDIT_PROMPTS", "MODES"])


def __getattr__(name: str):
    if name in ENGINES:
        from exactspec import engines

        return getattr(engines, name)
    return _getattr(name)
