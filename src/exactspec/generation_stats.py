"""Generation statistics: the figures that explain the speed of speculative decoding.

Definitions follow the glossary of docs/design.md:
    acceptance rate          accepted drafted tokens / drafted tokens (0..1).
    mean acceptance length   committed tokens / cycles (1.0 for plain decoding, ≤ k+1).
    per-position acceptance  P(draft position i accepted | position i was drafted).
    TTFT                     time to first token (seconds, prefill included).
    TPOT                     time per output token after the first (seconds).
A cycle cut short by a stop (EOS or a stop string) counts only the tokens it emitted: its
accepted count is capped at the emitted tokens, so nothing after a stop is counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields


@dataclass
class GenerationStats:
    """Counts and timings of one generation. Times in seconds, counts in tokens.

    Attributes:
        num_speculative_tokens: the most tokens drafted per cycle.
        policy: the speculation-length policy that chose k each cycle ("none" for plain).
        num_prompt_tokens: prompt length (tokens).
        num_generated_tokens: tokens emitted (EOS included when it ended generation).
        cycles: draft + verify cycles run (plain decoding: one per token).
        drafted_tokens: tokens proposed by the proposer.
        accepted_tokens: drafted tokens accepted and emitted.
        drafted_per_position: ``[k]`` how often draft position i (0-based) was drafted.
        accepted_per_position: ``[k]`` how often draft position i was accepted.
        chosen_k_histogram: ``[k+1]`` entry k = cycles for which the policy chose k drafts
            (a proposer may then propose fewer, e.g. prompt lookup without a match).
        committed_per_cycle: tokens committed by each cycle, in order.
        prefill_seconds: time to fill the target's cache with the prompt.
        ttft_seconds: time to first token (prefill and first cycle).
        total_seconds: wall time of the whole generation.
        draft_seconds: time spent in the proposer.
        verify_seconds: time spent in the target forward pass and verification.
        target_forward_seconds: the part of ``verify_seconds`` spent inside the target's
            forward passes (the model itself; the rest is host-side work).
        tree_nodes: drafted nodes of token trees (:mod:`exactspec.trees`), all scored by
            the target; for a tree, the drafted positions above are its depths (a cycle
            accepts at most one node per depth), so acceptance rate and per-position
            acceptance are per depth.
    """

    num_speculative_tokens: int = 0
    policy: str = "none"
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    cycles: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)
    chosen_k_histogram: list[int] = field(default_factory=list)
    committed_per_cycle: list[int] = field(default_factory=list)
    prefill_seconds: float = 0.0
    ttft_seconds: float = 0.0
    total_seconds: float = 0.0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    target_forward_seconds: float = 0.0
    tree_nodes: int = 0

    def __post_init__(self) -> None:
        k = self.num_speculative_tokens
        self.drafted_per_position = self.drafted_per_position or [0] * k
        self.accepted_per_position = self.accepted_per_position or [0] * k
        self.chosen_k_histogram = self.chosen_k_histogram or [0] * (k + 1)

    def record_cycle(self, num_drafted: int, num_accepted: int, num_emitted: int,
                     chosen_k: int | None = None, *, draft_seconds: float = 0.0,
                     verify_seconds: float = 0.0, target_forward_seconds: float = 0.0,
                     num_tree_nodes: int = 0) -> None:
        """Add one cycle: ``num_drafted`` proposed (a tree's depth), ``num_accepted``
        accepted by verification, ``num_emitted`` tokens emitted (≤ num_accepted + 1; fewer
        when a stop cut the cycle), ``chosen_k`` the policy's k (default: num_drafted), the
        cycle's seconds (see the attributes of the same names), and ``num_tree_nodes`` the
        nodes of its token tree (0 for a chain).
        """
        self.tree_nodes += num_tree_nodes
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        self.target_forward_seconds += target_forward_seconds
        accepted = min(num_accepted, num_emitted)
        self.chosen_k_histogram[num_drafted if chosen_k is None else chosen_k] += 1
        self.cycles += 1
        self.drafted_tokens += num_drafted
        self.accepted_tokens += accepted
        self.num_generated_tokens += num_emitted
        self.committed_per_cycle.append(num_emitted)
        for i in range(num_drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def add(self, other: GenerationStats) -> None:
        """Add ``other``'s figures to these (a request's samples, a bench group, an engine's
        running counts): counts, per-position counts and histograms summed position by
        position (the longer k wins; a shorter list counts 0 beyond its end), seconds
        summed, ``committed_per_cycle`` extended. The one place exactspec sums these counts
        (:meth:`merged`, :meth:`since` and every caller go through it)."""
        self._accumulate(other, 1)

    def copy(self) -> GenerationStats:
        """An independent copy (its lists copied: a C copy of the ints, unlike
        ``copy.deepcopy``, which visits each one)."""
        return dataclasses.replace(self, **{f.name: list(getattr(self, f.name))
                                            for f in fields(self) if f.type.startswith("list")})

    def since(self, earlier: GenerationStats) -> GenerationStats:
        """The figures added after ``earlier`` (a :meth:`copy` of these taken before), as a
        new :class:`GenerationStats`."""
        difference = self.copy()
        difference._accumulate(earlier, -1)
        return difference

    @classmethod
    def merged(cls, stats: Iterable[GenerationStats]) -> GenerationStats:
        """The figures of several generations together (:meth:`add`); ``policy`` the first
        one's."""
        stats = list(stats)
        total = cls(policy=stats[0].policy if stats else "none")
        for s in stats:
            total.add(s)
        return total

    def _accumulate(self, other: GenerationStats, sign: int) -> None:
        k = max(self.num_speculative_tokens, other.num_speculative_tokens)
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if f.name == "num_speculative_tokens":
                self.num_speculative_tokens = k
            elif f.name == "policy":
                continue
            elif f.name == "committed_per_cycle":
                if sign > 0:
                    mine.extend(theirs)
                else:  # ``other`` is an earlier copy: its cycles are the first ones
                    del mine[:len(theirs)]
            elif isinstance(mine, list):
                size = k + 1 if f.name == "chosen_k_histogram" else k
                mine.extend([0] * (size - len(mine)))
                for i, n in enumerate(theirs):
                    mine[i] += sign * n
            else:
                setattr(self, f.name, mine + sign * theirs)

    @classmethod
    def from_dict(cls, figures: dict) -> GenerationStats:
        """The stats :meth:`to_dict` wrote (its derived figures are left out)."""
        return cls(**{f.name: figures[f.name] for f in fields(cls) if f.name in figures})

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / drafted tokens, in [0, 1]; None when nothing was drafted."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Committed tokens per cycle, in [1, k+1]; None before the first cycle."""
        return self.num_generated_tokens / self.cycles if self.cycles else None

    @property
    def per_position_acceptance(self) -> list[float | None]:
        """``[k]``: P(position i accepted | drafted); None where never drafted."""
        return [a / d if d else None
                for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def committed_histogram(self) -> list[int]:
        """``[k+2]``: entry n = number of cycles that committed n tokens."""
        histogram = [0] * (self.num_speculative_tokens + 2)
        for n in self.committed_per_cycle:
            histogram[n] += 1
        return histogram

    @property
    def tpot_seconds(self) -> float | None:
        """Time per output token after the first (seconds); None with < 2 tokens."""
        if self.num_generated_tokens < 2:
            return None
        return (self.total_seconds - self.ttft_seconds) / (self.num_generated_tokens - 1)

    @property
    def tokens_per_second(self) -> float | None:
        """Generated tokens / total time, prefill included (tokens per second)."""
        return self.num_generated_tokens / self.total_seconds if self.total_seconds else None

    @property
    def overhead_seconds(self) -> float:
        """Decoding time outside the target's forward passes (seconds): drafting, logits
        processing, verification, bookkeeping. With prompt lookup this is all host-side
        (Python) work; with a draft model it includes the draft's forward passes."""
        return max(0.0, self.total_seconds - self.prefill_seconds - self.target_forward_seconds)

    @property
    def overhead_share(self) -> float | None:
        """``overhead_seconds`` / decoding time (prefill excluded), in [0, 1]."""
        decoding = self.total_seconds - self.prefill_seconds
        return self.overhead_seconds / decoding if decoding > 0 else None

    def to_dict(self) -> dict:
        """Every field and derived figure, JSON-serialisable."""
        derived = ("acceptance_rate", "mean_acceptance_length", "per_position_acceptance",
                   "committed_histogram", "tpot_seconds", "tokens_per_second",
                   "overhead_seconds", "overhead_share")
        return asdict(self) | {name: getattr(self, name) for name in derived}

    def summary(self) -> str:
        """One line for people: tokens, tokens/s, acceptance rate, mean acceptance length."""
        tokens = self.num_generated_tokens
        parts = [f"{tokens} token{'' if tokens == 1 else 's'} in {self.total_seconds:.2f} s",
                 f"{self.tokens_per_second or 0:.1f} tokens/s"]
        if self.num_speculative_tokens == 0:
            parts.append("plain decoding")
        else:
            rate = self.acceptance_rate
            parts.append("acceptance rate " + ("n/a" if rate is None else f"{rate:.1%}"))
            parts.append(f"mean acceptance length {self.mean_acceptance_length or 0:.2f}"
                         f" (k≤{self.num_speculative_tokens}, {self.policy})")
        parts.append(f"TTFT {self.ttft_seconds * 1000:.0f} ms" if tokens else "TTFT n/a")
        return " · ".join(parts)
