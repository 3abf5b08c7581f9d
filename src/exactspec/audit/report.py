"""The audit's outputs: ``audit.json`` (every number), ``report.md`` (the tables and the
verdict) and one PNG per prompt (empirical vs exact probability of the first token's
likeliest values)."""

from __future__ import annotations

from pathlib import Path

from exactspec.audit.runner import AuditResult, EngineTest, PromptTest, describe_impossible
from exactspec.files import readable_json, replaced_atomically, write_text_atomically

TOP_OUTCOMES = 12
"""First-token bins shown per prompt plot."""


def write_audit_report(result: AuditResult, output: str | Path, decode) -> list[Path]:
    """Write the audit's files into ``output`` (created if needed), each whole or not at
    all (:mod:`exactspec.files`).

    Args:
        decode: token ids → text, to label outcomes.
    Returns:
        the paths written.
    """
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    files = [output / "audit.json", output / "report.md"]
    write_text_atomically(files[0], readable_json(result.to_dict()))
    for test in result.distribution.prompts:
        files.append(_plot(test, result, decode, output / f"prompt-{test.prompt_index}.png"))
    write_text_atomically(files[1], markdown(result, decode))
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
        if test is not None:
            lines += ["", f"## {title}: {test.engine}", ""] + _engine_test(test, decode)
    level = result.distribution.level
    lines += ["", "**Power.** A sampler whose next-token distribution at token j differs from "
              "the target's by a mean total variation of at least the row's *detectable TV* "
              "(mean over the prefixes tested on their own, weighted by how often each is "
              "reached, on the bins tested) is caught with probability ≥ 0.8, in the least "
              "favourable direction" + (f" (at Holm's first-step level {level:.2g})." if level
                                        else "."), ""]
    lines += ["Each row tests one token position: at every prefix the samples reached, the "
              "next tokens drawn against the target's exact conditional distribution "
              "(chi-square; tokens expected ≥ 5 times have their own bin, rarer ones are "
              "pooled), summed over the prefixes; the samples at prefixes reached too rarely "
              "to have 2 bins (*remainder*) are tested together by their randomized "
              "probability integral transform (uniform under the target); Holm's correction "
              "over all rows. *forced*: share of the samples at prefixes after which the "
              "target allows a single token (only checked for impossible tokens). *pooled*: "
              "expected share of the samples in pooled bins. *mean TV* (over the prefixes "
              "tested on their own): the observed distance, which is > 0 at finite samples "
              "even for a correct sampler (about sqrt(dof / samples) / 2). A sampled token of "
              "probability 0 under the target fails the audit whatever the p-values.", ""]
    lines += ["Prompts:", ""]
    lines += [f"{i}. {prompt!r}" for i, prompt in enumerate(config.get("prompts", []))]
    lines.append("")
    lines += [f"![prompt {p.prompt_index}](prompt-{p.prompt_index}.png)"
              for p in result.distribution.prompts]
    return "\n".join(lines) + "\n"


def _engine_test(test: EngineTest, decode) -> list[str]:
    """The drafting counts, the impossible continuations and the table of one engine."""
    lines = []
    if test.drafted is not None:
        rate = test.accepted / test.drafted if test.drafted else float("nan")
        lines.append(f"While sampling, drafted tokens: {test.drafted}, accepted: {test.accepted} "
                     f"(acceptance rate {rate:.3f}).")
        if test.drafted_per_position:
            lines += ["", "| block position | " + " | ".join(
                str(i + 1) for i in range(len(test.drafted_per_position))) + " |",
                "|---" * (len(test.drafted_per_position) + 1) + "|",
                "| drafted | " + " | ".join(map(str, test.drafted_per_position)) + " |",
                "| accepted | " + " | ".join(map(str, test.accepted_per_position)) + " |"]
        lines.append("")
    for p in test.prompts:
        for impossible in p.impossible:
            lines.append(f"- **impossible continuation**, prompt {p.prompt_index}, "
                         f"{impossible.count} of {p.num_samples} samples: "
                         f"{describe_impossible(impossible, decode)}")
    if any(p.impossible for p in test.prompts):
        lines.append("")
    lines += ["| prompt | token | samples | prefixes tested | remainder | forced | pooled | dof "
              "| X² | p-value | rejected (Holm) | mean TV | detectable TV |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in test.prompts:
        for f in p.positions:
            share = lambda count: f"{count / f.num_samples:.1%}" if f.num_samples else "–"
            detectable = "–" if f.detectable_tv == float("inf") else f"{f.detectable_tv:.3f}"
            lines.append(
                f"| {p.prompt_index} | {f.position} | {f.num_samples} | {f.num_nodes} "
                f"| {share(f.remainder_samples)} | {share(f.forced_samples)} "
                f"| {f.pooled_share:.1%} | {f.dof} | {f.statistic:.1f} | {f.p_value:.3g} "
                f"| {'**yes**' if f.rejected else 'no'} | {f.tv:.3f} | {detectable} |")
    return lines


def _label(first, i: int, decode) -> str:
    token = first.tokens[i]
    if token is None:
        return "(all others)"
    text = repr(decode([token]))[:28]
    return text + " and the rest" if first.merged and i == len(first.tokens) - 1 else text


def _plot(test: PromptTest, result: AuditResult, decode, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4.5))
    first, position = test.first, test.positions[0]
    if first is not None:
        n = first.num_samples
        last = len(first.exact) - 1
        shown = list(range(min(TOP_OUTCOMES, len(first.exact))))
        if shown[-1] != last:  # always show the pooled bin
            shown[-1] = last
        x = np.arange(len(shown))
        ax.bar(x - 0.2, [first.exact[i] for i in shown], width=0.4,
               label="exact (target's processed probabilities)")
        ax.bar(x + 0.2, [first.counts[i] / n for i in shown], width=0.4,
               label=f"{result.distribution.engine} ({n} samples)")
        labels = [_label(first, i, decode) for i in shown]
        ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    ax.set_ylabel("probability")
    ax.set_title(f"prompt {test.prompt_index}, first token: p-value {position.p_value:.3g}, "
                 f"TV = {position.tv:.3f}")
    fig.tight_layout()
    with replaced_atomically(path) as partial:
        fig.savefig(partial, dpi=90)
    plt.close(fig)
    return path
