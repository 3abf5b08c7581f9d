"""The audit's outputs, the same for every audit (:class:`~exactspec.audit.result.AuditResult`):
``audit.json`` (every number), ``report.md`` (the verdict, the tables and how to read
them), one PNG per prompt (the first token's likeliest values: the engine's frequencies
against the exact probabilities, or A's against B's) and, where the samples are given,
``samples.json``."""

from __future__ import annotations

import json
from pathlib import Path

from exactspec.audit.endpoint import TOKEN_SOURCES
from exactspec.audit.reference import PromptTest
from exactspec.audit.result import (AuditResult, Describe, DistributionTest, GreedyCheck,
                                    describe_impossible, describer, number)
from exactspec.audit.two_sample import PromptComparison
from exactspec.files import readable_json, replaced_atomically, write_text_atomically

TOP_OUTCOMES = 12
"""First-token bins shown per prompt plot."""


def write_report(result: AuditResult, output: str | Path, describe: Describe | None = None,
                 samples: dict | None = None) -> list[Path]:
    """Write the audit's files into ``output`` (created if needed), each whole or not at
    all (:mod:`exactspec.files`): ``audit.json``, ``report.md``, a plot per prompt of the
    distribution test and ``samples.json``.

    Args:
        describe: tokens → how the report shows them
            (:func:`~exactspec.audit.result.describer`; None: ``result.describe``, else
            by id).
        samples: engine name → ``[prompt][sample]`` the samples drawn (tokens,
            :data:`~exactspec.audit.endpoint.END` where one stopped early), kept for
            re-analysis (None: ``result.samples``; none: not written).
    Returns:
        the paths written, ``audit.json`` and ``report.md`` first.
    """
    describe = describe or result.describe or describer()
    samples = samples if samples is not None else result.samples
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    files = [output / "audit.json", output / "report.md"]
    write_text_atomically(files[0], readable_json(result.to_dict()))
    if samples:
        files.append(output / "samples.json")
        write_text_atomically(files[-1], json.dumps(samples))
    test = result.distribution
    for prompt in test.prompts if test is not None else []:
        path = output / f"prompt-{prompt.prompt_index}.png"
        files.append(_plot_two_sample(prompt, test, describe, path)
                     if isinstance(prompt, PromptComparison)
                     else _plot(prompt, test.engine, describe, path))
    write_text_atomically(files[1], markdown(result, describe))
    return files


def markdown(result: AuditResult, describe: Describe) -> str:
    """The report as markdown text."""
    over = "" if result.mode == "local" else f" ({result.mode}, over HTTP)"
    lines = [f"# exactspec audit{over}: **{result.verdict}**", ""]
    lines += [f"- {reason}" for reason in result.reasons]
    lines += ["", "## Configuration", ""]
    lines += [f"- {key}: {value}" for key, value in result.config.items() if key != "prompts"]
    if result.token_source:
        lines.append(f"- tokens read from: {TOKEN_SOURCES[result.token_source]}")
    if result.samples_asked:
        lines.append(f"- samples drawn: {result.samples_drawn} of {result.samples_asked}"
                     + (" (interrupted)" if result.interrupted else ""))
    lines += _greedy(result, describe)
    if result.model_check is not None:
        check = result.model_check
        lines += ["", "## Is the local model the served one?", "",
                  f"First greedy token equal on {check.first_tokens_equal} of "
                  f"{check.num_prompts} prompts; largest difference of a greedy token's "
                  f"log-probability before any divergence: "
                  f"{number(check.max_logprob_difference)} nats: "
                  f"{'**passed**' if check.passed else '**failed**'}."]
    for title, test in (("Distribution test", result.distribution),
                        ("Power check", result.control)):
        if test is not None:
            against = "" if test.reference is None else f" against {test.reference}"
            lines += ["", f"## {title}: {test.engine}{against}", ""] + _drafting(test)
            lines += (_engine_test(test, describe) if test.reference is None
                      else _two_sample_table(test))
    if result.power is not None:
        power = result.power
        lines += ["", "## The two tests' power on the control", "",
                  f"On {power.subsamples} random halves of prompt 0's control and B samples "
                  f"({power.size_a} and {power.size_b}), at level {power.alpha}: the "
                  f"per-position conditional tests (Holm) caught the control in "
                  f"{power.conditional:.0%} of them, the Hamming-kernel MMD test in "
                  f"{power.mmd:.0%}. The verdict uses both, in one Holm family: the "
                  "conditional tests catch deviations of the conditionals after some prefixes "
                  "that leave the marginals alone, say which token deviates and state the "
                  "deviation each position rules out; the MMD test, which compares each "
                  "position's marginal distribution, all positions at once, catches a "
                  "deviation spread over every position in one direction (such as this "
                  "control's) with fewer samples (exactspec.audit.two_sample)."]
    if result.distribution is not None:
        test = result.distribution
        lines += ["", "**Power.** A sampler whose next-token distribution at token j differs "
                  "from " + ("the target's" if test.reference is None else "B's")
                  + " by a mean total variation of at least the row's *detectable TV* (mean "
                  "over the prefixes tested on their own, weighted by how often each is "
                  "reached, on the bins tested) is caught with probability ≥ 0.8, in the least "
                  "favourable direction" + (f" (at Holm's first-step level {test.level:.2g})."
                                            if test.level else "."), "", _how_to_read(test)]
    if result.failures:
        lines += ["", f"## Failed requests ({len(result.failures)}, never counted as samples)",
                  ""] + [f"- {f}" for f in result.failures[:50]]
    lines += ["", "Prompts:", ""]
    lines += [f"{i}. {prompt!r}" for i, prompt in enumerate(result.config.get("prompts", []))]
    lines.append("")
    if result.distribution is not None:
        lines += [f"![prompt {p.prompt_index}](prompt-{p.prompt_index}.png)"
                  for p in result.distribution.prompts]
    return "\n".join(lines) + "\n"


def _how_to_read(test: DistributionTest) -> str:
    """What each row of the distribution test's table tests and states."""
    if test.reference is None:
        return ("Each row tests one token position: at every prefix the samples reached, the "
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
                "probability 0 under the target fails the audit whatever the p-values.")
    return ("Each row tests one token position: at every prefix both engines reached, A's "
                "next tokens against B's (2 × K table, bins from the pooled counts, G "
                "statistic summed over the prefixes), p-value by permuting the A/B labels "
                "within each prefix (exact at any count). *mean TV*: between A's and B's "
                "observed conditionals (weighted by n_eff), > 0 at finite samples even for "
                "equal engines; *TV estimate*: bias-corrected by the bootstrap, with its 95 % "
                "basic bootstrap interval, which describes the estimate's spread, not a test: "
                "TV cannot fall below 0, where the bootstrap covers badly, so the interval can "
                "exclude 0 for equal engines. Whether A deviates is the p-value's to say.")


def _greedy(result: AuditResult, describe: Describe) -> list[str]:
    """The greedy identity section: against plain decoding (a list of divergences), or A
    against B or the local model over HTTP (a table with both sides' logprobs)."""
    if not result.greedy:
        return ["", "## Greedy identity", "", "(not run)"]
    same = sum(c.identical for c in result.greedy)
    if isinstance(result.greedy[0], GreedyCheck):
        lines = ["", "## Greedy identity", "",
                 f"{same} of {len(result.greedy)} prompts token-for-token identical to plain "
                 "decoding."]
        return lines + [f"- prompt {c.prompt_index}: first divergence at token {c.position}: "
                        f"plain {c.plain_token} (logit {c.plain_logit}) vs engine "
                        f"{c.engine_token} (logit {c.engine_logit})"
                        for c in result.greedy if not c.identical]
    other = "the local model" if result.mode == "reference" else "B"
    lines = ["", f"## Greedy identity: A against {other}", "",
             f"{same} of {len(result.greedy)} prompts token-for-token identical.", ""]
    diverged = [c for c in result.greedy if not c.identical]
    if diverged:
        lines += [f"| prompt | tokens A / {other} | first divergence | A's token (logprob) "
                  f"| {other}'s token (logprob) | A's logprob of {other}'s token "
                  f"| {other}'s logprob of A's token |", "|---" * 7 + "|"]
        show = lambda t: "–" if t is None else describe([t])
        for c in diverged:
            if c.error:
                lines.append(f"| {c.prompt_index} | request failed: {c.error} ||||||")
                continue
            lines.append(f"| {c.prompt_index} | {c.num_tokens_a} / {c.num_tokens_b} "
                         f"| {c.position} | {show(c.token_a)} ({number(c.logprob_a)}) "
                         f"| {show(c.token_b)} ({number(c.logprob_b)}) "
                         f"| {number(c.a_logprob_of_b)} | {number(c.b_logprob_of_a)} |")
    return lines


def _drafting(test: DistributionTest) -> list[str]:
    """How much the engine drafted while sampling, in total and per block position."""
    if test.drafted is None:
        return ["The engine does not report how much it drafted.", ""]
    rate = test.accepted / test.drafted if test.drafted else float("nan")
    lines = [f"While sampling, drafted tokens: {test.drafted}, accepted: {test.accepted} "
             f"(acceptance rate {rate:.3f})."]
    if test.drafted_per_position:
        lines += ["", "| block position | " + " | ".join(
            str(i + 1) for i in range(len(test.drafted_per_position))) + " |",
            "|---" * (len(test.drafted_per_position) + 1) + "|",
            "| drafted | " + " | ".join(map(str, test.drafted_per_position)) + " |",
            "| accepted | " + " | ".join(map(str, test.accepted_per_position)) + " |"]
    return lines + [""]


def _engine_test(test: DistributionTest, describe: Describe) -> list[str]:
    """The impossible continuations and the table of a test against exact probabilities,
    and how to read it."""
    lines = []
    for p in test.prompts:
        for impossible in p.impossible:
            lines.append(f"- **impossible continuation**, prompt {p.prompt_index}, "
                         f"{impossible.count} of {p.num_samples} samples: "
                         f"{describe_impossible(impossible, describe)}")
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


def _label(first, i: int, describe: Describe) -> str:
    token = first.tokens[i]
    if token is None:
        return "(all others)"
    text = describe([token])[:28]
    return text + " and the rest" if first.merged and i == len(first.tokens) - 1 else text


def _plot(test: PromptTest, engine: str, describe: Describe, path: Path) -> Path:
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
               label=f"{engine} ({n} samples)")
        labels = [_label(first, i, describe) for i in shown]
        ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    ax.set_ylabel("probability")
    ax.set_title(f"prompt {test.prompt_index}, first token: p-value {position.p_value:.3g}, "
                 f"TV = {position.tv:.3f}")
    return _save(fig, path)


def _two_sample_table(test: DistributionTest) -> list[str]:
    """The table of a test against a second engine's samples, its MMD tests, and how to
    read them."""
    lines = ["| prompt | token | samples A | samples B | prefixes tested | n_eff | dof | G "
              "| p-value (permutations) | rejected (Holm) | mean TV | TV estimate [95 % CI] "
              "| detectable TV |",
              "|---" * 13 + "|"]
    for prompt in test.prompts:
        for p in prompt.positions:
            if not p.dof:  # no prefix with two bins reached by both: nothing tested
                lines.append(f"| {prompt.prompt_index} | {p.position} | {p.num_a} | {p.num_b} "
                             "| 0 | – | 0 | – | – | – | – | – | – |")
                continue
            lines.append(
                f"| {prompt.prompt_index} | {p.position} | {p.num_a} | {p.num_b} | {p.num_tables} "
                f"| {p.effective_samples:.0f} | {p.dof} | {p.statistic:.1f} "
                f"| {p.p_value:.3g} ({p.draws}) | {'**yes**' if p.rejected else 'no'} "
                f"| {p.tv:.3f} | {p.tv_estimate:.3f} [{p.tv_interval[0]:.3f}, "
                f"{p.tv_interval[1]:.3f}] | {p.detectable_tv:.3f} |")
    lines += ["", "Hamming-kernel MMD test on the same samples (in the same Holm family): "
              + "; ".join(f"prompt {p.prompt_index}: MMD² {p.mmd.statistic:.2e}, p-value "
                          f"{p.mmd.p_value:.3g} ({p.mmd.permutations} permutations), rejected: "
                          f"{'**yes**' if p.mmd.rejected else 'no'}" for p in test.prompts)
              + "."]
    return lines


def _plot_two_sample(prompt: PromptComparison, test: DistributionTest, describe: Describe,
                     path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(9, 4.5))
    table = prompt.first
    if table is not None:
        shown = list(range(min(TOP_OUTCOMES, len(table.bins))))
        x = np.arange(len(shown))
        for offset, counts, name in ((-0.2, table.counts_a, test.engine),
                                     (0.2, table.counts_b, test.reference)):
            ax.bar(x + offset, [counts[i] / counts.sum() for i in shown], width=0.4,
                   label=f"{name[:50]} ({counts.sum()} samples)")
        labels = ["(all others)" if table.bins[i] is None else describe([table.bins[i]])[:28]
                  for i in shown]
        ax.set_xticks(x, labels, rotation=40, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    first = prompt.positions[0]
    ax.set_ylabel("frequency")
    ax.set_title(f"prompt {prompt.prompt_index}, first token: p-value {first.p_value:.3g}, "
                 f"TV = {first.tv:.3f}")
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    """Write a figure's PNG whole or not at all, and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    with replaced_atomically(path) as partial:
        fig.savefig(partial, dpi=90)
    plt.close(fig)
    return path
