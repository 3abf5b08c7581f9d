"""``generate --trace FILE.html``: one self-contained page (no network: styles, script and
charts inline) showing each cycle's drafts with p, q, min(1, p/q), the uniform drawn and the
verdict, the residual's top tokens after a rejection, tokens committed per cycle and
acceptance by position (matplotlib charts as inline SVG), and the summary figures; the same
data as JSON beside it (``FILE.json``).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path

import jinja2

from exactspec.cycle_trace import TokenKind
from exactspec.extras import require
from exactspec.files import readable_json, write_text_atomically
from exactspec.generator import GenerationResult
from exactspec.trace.view import NO_TEXT, at_boundary, shown_pieces

require("plots", "the trace page (generate --trace)")

COLOURS: dict[TokenKind, str] = {"accepted": "#2e7d32", "recovered": "#e6a700",
                                 "bonus": "#1565c0", "plain": "#9e9e9e"}


def write_trace(path: str | Path, results: Sequence[GenerationResult],
                decode: Callable[[list[int]], str], config: dict) -> tuple[Path, Path]:
    """Write the page to ``path`` and the trace as JSON beside it (same name, ``.json``).

    Args:
        results: generations made with ``trace=True`` (one per sample).
        decode: the tokenizer's decode (token ids → text).
        config: what to show as the run's configuration (model, method, sampling, ...).
    Returns:
        (page path, JSON path).
    Raises:
        ValueError: if a result carries no trace.
        OSError: if the files cannot be written (e.g. the folder does not exist).
    """
    if any(result.trace is None for result in results):
        raise ValueError("write_trace needs results generated with trace=True")
    page, data = Path(path), Path(path).with_suffix(".json")
    samples = [sample_view(result, decode) for result in results]
    shown = {key: (", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, dict)
                   else {True: "yes", False: "no"}.get(value, value) if isinstance(value, bool)
                   else value) for key, value in config.items()}
    html = _template().render(config=shown, samples=samples, colours=COLOURS)
    write_text_atomically(page, html)
    write_text_atomically(data, readable_json({"config": config, "samples": [
        {"text": r.text, "token_ids": r.token_ids, "stats": r.stats.to_dict(),
         "cycles": [c.to_dict() for c in r.trace]} for r in results]}))
    return page, data


def sample_view(result: GenerationResult, decode: Callable[[list[int]], str]) -> dict:
    """What the template shows of one sample: token pieces with their kind and cycle, each
    cycle with token texts, and the charts."""
    token_ids = [token for cycle in result.trace for token, _ in cycle.committed]
    pieces = iter(shown_pieces(token_ids, decode))
    text = lambda token: visible(decode([token])) or f"{NO_TEXT}#{token}"
    tokens, cycles = [], []
    for number, cycle in enumerate(result.trace):
        committed = [(next(pieces), kind) for _, kind in cycle.committed]
        tokens += [(piece, kind, cycle.index, at_boundary(result.trace, number) and not i)
                   for i, (piece, kind) in enumerate(committed)]
        committed = [(visible(piece), kind) for piece, kind in committed]
        cycles.append({
            "index": cycle.index, "position": cycle.position, "chosen_k": cycle.chosen_k,
            "greedy": cycle.greedy, "committed": committed,
            "rejected": any(d.verdict in ("rejected", "forbidden") for d in cycle.drafts),
            "drafts": [d.__dict__ | {"text": text(d.token_id),
                                     "target_text": None if d.target_token_id is None
                                     else text(d.target_token_id)} for d in cycle.drafts],
            "final_top": [(text(t), p) for t, p in cycle.final_top]})
    stats = result.stats
    return {"tokens": tokens, "cycles": cycles, "stats": stats,
            "committed_chart": _committed_chart(result),
            "position_chart": _position_chart(stats.per_position_acceptance,
                                              stats.drafted_per_position)}


def visible(text: str) -> str:
    """Spaces and line breaks made visible, for tokens shown alone (``␣``, ``↵``, ``⇥``)."""
    return text.replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥")


def _committed_chart(result: GenerationResult) -> str:
    """Tokens committed per cycle, stacked by kind, as inline SVG."""
    from matplotlib.ticker import MaxNLocator

    figure, axes = _figure()
    bottoms = [0] * len(result.trace)
    for kind in COLOURS:
        heights = [sum(1 for _, k in cycle.committed if k == kind) for cycle in result.trace]
        axes.bar(range(len(heights)), heights, bottom=bottoms, color=COLOURS[kind], label=kind,
                 width=0.85)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    axes.set_xlabel("cycle")
    axes.set_ylabel("tokens committed")
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.yaxis.set_major_locator(MaxNLocator(integer=True))
    figure.legend(loc="outside upper center", fontsize=8, ncols=4, frameon=False)
    return _svg(figure)


def _position_chart(rates: Sequence[float | None], drafted: Sequence[int]) -> str:
    """P(accepted | drafted) per draft position, with how often each was drafted."""
    figure, axes = _figure()
    positions = range(1, len(rates) + 1)
    axes.bar(positions, [r or 0 for r in rates], color=COLOURS["accepted"], width=0.7)
    for position, rate, count in zip(positions, rates, drafted):
        axes.annotate(f"n={count}", (position, rate or 0), ha="center", va="bottom", fontsize=8)
    axes.set_ylim(0, 1.1)
    axes.set_xticks(list(positions))
    axes.set_xlabel("draft position")
    axes.set_ylabel("acceptance rate")
    return _svg(figure)


def _figure():
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 2.6), layout="constrained")
    return figure, figure.subplots()


def _svg(figure) -> str:
    buffer = io.StringIO()
    figure.savefig(buffer, format="svg")
    svg = buffer.getvalue()
    return svg[svg.index("<svg"):]  # drop the XML prolog and DOCTYPE (they reach the network)


def _template() -> jinja2.Template:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("exactspec.trace", "."), autoescape=True,
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    return environment.get_template("page.html.j2")
