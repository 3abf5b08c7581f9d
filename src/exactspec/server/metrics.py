"""The server's Prometheus metrics (``GET /metrics``), named like vLLM's with the
``exactspec:`` prefix so that dashboards built for vLLM need only the prefix changed.

Speculative counters follow vLLM v1's ``spec_decode_*`` metrics: a *draft* is one cycle
that drafted at least one token; ``num_accepted_tokens_per_pos`` counts acceptances at
each draft position (label ``position``, 0-based). Acceptance rate = accepted / draft
tokens; mean acceptance length = 1 + accepted / drafts (over drafting cycles).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from exactspec.engine import GenerationResult

TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
"""Seconds; wide, because requests wait in one queue on a small machine."""
TPOT_BUCKETS = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)
"""Seconds per output token."""


class ServerMetrics:
    """Every metric of one server, in its own registry (several servers can live in one
    process, e.g. in tests). Thread-safe (prometheus-client's metrics are)."""

    def __init__(self, model: str) -> None:
        self.registry = CollectorRegistry()
        r, p = self.registry, "exactspec:"
        self.requests = Counter(p + "request_success", "Finished requests by finish reason",
                                ["finished_reason"], registry=r)
        self.aborted = Counter(p + "request_aborted", "Requests cancelled (client gone)",
                               registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens", "Prompt tokens processed", registry=r)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram(p + "time_to_first_token_seconds",
                              "Time to first token, from the request's arrival (seconds)",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram(p + "time_per_output_token_seconds",
                              "Time per output token after the first, per choice (seconds)",
                              buckets=TPOT_BUCKETS, registry=r)
        self.e2e = Histogram(p + "e2e_request_latency_seconds",
                             "Request latency from arrival to its last token (seconds)",
                             buckets=TTFT_BUCKETS, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests queued", registry=r)
        self.running = Gauge(p + "num_requests_running", "Requests being generated", registry=r)
        self.drafts = Counter(p + "spec_decode_num_drafts", "Cycles that drafted ≥ 1 token",
                              registry=r)
        self.draft_tokens = Counter(p + "spec_decode_num_draft_tokens", "Tokens drafted",
                                    registry=r)
        self.accepted_tokens = Counter(p + "spec_decode_num_accepted_tokens",
                                       "Drafted tokens accepted", registry=r)
        self.accepted_per_position = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted at each draft position (0-based)", ["position"],
            registry=r)
        Gauge(p + "model_info", "The served model", ["model"], registry=r).labels(model).set(1)

    def record(self, result: GenerationResult, prompt_tokens: int) -> None:
        """Count one finished choice (``prompt_tokens``: its prompt's length, 0 when an
        earlier choice of the same prompt counted it)."""
        stats = result.stats
        self.requests.labels(result.finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(stats.num_generated_tokens)
        if stats.tpot_seconds is not None:
            self.tpot.observe(stats.tpot_seconds)
        # position 0 is drafted once per cycle that drafted anything
        self.drafts.inc(stats.drafted_per_position[0] if stats.drafted_per_position else 0)
        self.draft_tokens.inc(stats.drafted_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        for position, accepted in enumerate(stats.accepted_per_position):
            if accepted:
                self.accepted_per_position.labels(str(position)).inc(accepted)
