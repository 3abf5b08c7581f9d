"""The audit's outputs: ``audit.json`` (every number), ``report.md`` (the tables and the
verdict) and one PNG per prompt (empirical vs exact probability of the likeliest outcomes)."""

from __future__ import annotations

import json
from pathlib import Path

from exactspec.audit.runner import AuditResult, PromptTest

TOP_OUTCOMES = 12
"""Bins shown per prompt plot."""


def write_audit_report(result: AuditResult, output: str | Path, decode) -> list[Path]:
    """Write the audit's files into ``output`` (created if needed).

    Args:
        decode: token ids → text, to label outcomes.
    Returns:
        the paths written.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    files = [output / "audit.json", output / "report.md"]
    files[0].write_text(json.dumps(result.to_dict(), indent=2, default=str))
    for test in result.distribution.prompts:
        files.append(_plot(test, result, decode, output / f"prompt-{test.prompt_index}.png"))
    files[1].write_text(markdown(result, decode))
    return files


def markdown(result: AuditResult, decode) -> str:
    """The report as markdown text."""
    config = result.config
    lines = [f"# exactspec audit: **{result.verdict}**", ""]
    lines += [f"- {reason}" for reason in result.reasons]
    lines += ["", "## Configuration", ""]
    lines += [f"- {key}: {value}" for key, value in config.items()]
    lines += ["", "## Greedy identity", ""]
    if not result.greedy:
        lines.append("(not run)")
    else:
        same = sum(c.identical for c in result.greedy)
        lines.append(f"{same} of {len(result.greedy)} prompts token-for-token identical to plain "
                     "decoding.")
        for c in result.greedy:
            if not c.identical:
                lines.append(
                    f"- prompt {c.prompt_index}: first divergence at token {c.position}: plain "
                    f"{c.plain_token} (logit {c.plain_logit}) vs engine {c.engine_token} "
                    f"(logit {c.engine_logit})")
    for title, test in (("Distribution test", result.distribution),
                        ("Power check", result.control)):
        if test is None:
            continue
        lines += ["", f"## {title}: {test.engine}", ""]
        if test.drafted is not None:
            rate = test.accepted / test.drafted if test.drafted else float("nan")
            lines.append(f"While sampling, drafted tokens: {test.drafted}, accepted: "
                         f"{test.accepted} (acceptance rate {rate:.3f}).")
            if test.drafted_per_position:
                lines += ["", "| block position | " + " | ".join(
                    str(i + 1) for i in range(len(test.drafted_per_position))) + " |",
                    "|---" * (len(test.drafted_per_position) + 1) + "|",
                    "| drafted | " + " | ".join(map(str, test.drafted_per_position)) + " |",
                    "| accepted | " + " | ".join(map(str, test.accepted_per_position)) + " |"]
            lines.append("")
        lines += ["| prompt | samples | bins | G | p-value | rejected (Holm) | TV [95 % CI] "
                  "| detectable TV |", "|---|---|---|---|---|---|---|---|"]
        for p in test.prompts:
            f = p.fit
            lines.append(f"| {p.prompt_index} | {f.num_samples} | {f.num_bins} | {f.statistic:.1f} "
                         f"| {f.p_value:.3g} | {'**yes**' if p.rejected else 'no'} | {f.tv:.3f} "
                         f"[{f.tv_ci[0]:.3f}, {f.tv_ci[1]:.3f}] | {p.detectable_tv:.3f} |")
    lines += ["", "Prompts:", ""]
    lines += [f"{i}. {prompt!r}" for i, prompt in enumerate(config.get("prompts", []))]
    lines += ["", "TV is measured over the pooled bins; a correct sampler shows a small TV at "
              "finite samples. The detectable TV is the smallest deviation (moved between the two "
              "likeliest outcomes, the hardest direction) that the test catches with power 0.8.",
              ""]
    lines += [f"![prompt {p.prompt_index}](prompt-{p.prompt_index}.png)"
              for p in result.distribution.prompts]
    return "\n".join(lines) + "\n"


def _label(bin_outcomes: list[tuple[int, ...]], decode) -> str:
    if not bin_outcomes or bin_outcomes[0] == ():
        return "(all others)"
    text = repr(decode(list(bin_outcomes[0])))
    more = len(bin_outcomes) - 1
    return text[:28] + (f" +{more} pooled" if more else "")


def _plot(test: PromptTest, result: AuditResult, decode, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    shown = list(range(min(TOP_OUTCOMES, len(test.exact))))
    n = max(1, test.fit.num_samples)
    exact = np.array([test.exact[i] for i in shown])
    empirical = np.array([test.counts[i] / n for i in shown])
    x = np.arange(len(shown))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.bar(x - 0.2, exact, width=0.4, label="exact (target's processed probabilities)")
    ax.bar(x + 0.2, empirical, width=0.4, label=f"{result.distribution.engine} ({n} samples)")
    ax.set_xticks(x, [_label(test.outcomes[i], decode) for i in shown], rotation=40, ha="right",
                  fontsize=8)
    ax.set_ylabel("probability")
    ax.set_title(f"prompt {test.prompt_index}: p = {test.fit.p_value:.3g}, "
                 f"TV = {test.fit.tv:.3f}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
