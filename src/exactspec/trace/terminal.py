"""``generate --show``: the output with every token marked by how it was committed.

Colours (rich) on a terminal that has them: accepted drafts green, recovered tokens (after a
rejection) yellow, red where the rejected draft was one the request's constraint forbids
(verdict ``forbidden``), bonus tokens cyan, plain steps unstyled, and a dim ``▏`` between
cycles. Without colours (a pipe, ``NO_COLOR`` set, a dumb terminal) the same information as
markers: ``[accepted]``, ``{recovered}``, ``{!recovered}`` after a forbidden draft,
``<bonus>``, plain tokens bare, ``|`` between cycles.
Plain steps (one token per cycle) are not separated from each other; ``∅`` stands for a
token without text (EOS), ``·`` for one holding only part of a character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.text import Text

from exactspec.cycle_trace import CycleTrace, TokenKind
from exactspec.trace.view import NO_TEXT, PARTIAL, at_boundary, shown_pieces

FORBIDDEN = "forbidden"
"""How a recovered token is shown when the draft it replaced was forbidden by the request's
constraint (its own kind is ``recovered``)."""
STYLES: dict[TokenKind | str, str] = {"accepted": "green", "recovered": "bold yellow",
                                      FORBIDDEN: "bold red", "bonus": "cyan", "plain": ""}
MARKERS: dict[TokenKind | str, tuple[str, str]] = {
    "accepted": ("[", "]"), "recovered": ("{", "}"), FORBIDDEN: ("{!", "}"),
    "bonus": ("<", ">"), "plain": ("", "")}
NAMES: dict[TokenKind | str, str] = {
    "accepted": "accepted draft", "recovered": "recovered after a rejection",
    FORBIDDEN: "recovered after a draft the constraint forbids", "bonus": "bonus token",
    "plain": "plain step (no drafts)"}
CYCLE_MARK = {True: "▏", False: "|"}
"""The cycle boundary with and without colours."""


def marked_text(trace: Sequence[CycleTrace], decode: Callable[[list[int]], str],
                colour: bool) -> Text:
    """The generated text as a rich :class:`~rich.text.Text`, each token styled (``colour``)
    or bracketed by its kind, a mark at each boundary of a cycle that drafted."""
    token_ids = [token for cycle in trace for token, _ in cycle.committed]
    pieces = iter(shown_pieces(token_ids, decode))
    text = Text()
    for number, cycle in enumerate(trace):
        if at_boundary(trace, number):
            text.append(CYCLE_MARK[colour], style="dim" if colour else "")
        forbidden = any(draft.verdict == FORBIDDEN for draft in cycle.drafts)
        for _, kind in cycle.committed:
            kind = FORBIDDEN if forbidden and kind == "recovered" else kind
            piece = next(pieces)
            if colour:
                text.append(piece, style=STYLES[kind])
            else:
                opening, closing = MARKERS[kind]
                text.append(f"{opening}{piece}{closing}")
    return text


def legend(colour: bool, forbidden: bool = False) -> Text:
    """One line naming each mark (the forbidden-draft mark only with ``forbidden``)."""
    text = Text("legend: ")
    for kind, name in NAMES.items():
        if kind == FORBIDDEN and not forbidden:
            continue
        if colour:
            text.append(name, style=STYLES[kind] or "default")
        else:
            opening, closing = MARKERS[kind]
            text.append(f"{opening}{name}{closing}")
        text.append("  ")
    text.append(f"{CYCLE_MARK[colour]} cycle boundary", style="dim" if colour else "")
    text.append(f"  {NO_TEXT} a token without text (EOS)  {PARTIAL} part of a character")
    return text


def show(console: Console, trace: Sequence[CycleTrace],
         decode: Callable[[list[int]], str]) -> None:
    """Print the marked output and the legend on ``console`` (colours if it has them)."""
    colour = console.color_system is not None and not console.no_color
    console.print(marked_text(trace, decode, colour), soft_wrap=True)
    forbidden = any(d.verdict == FORBIDDEN for cycle in trace for d in cycle.drafts)
    console.print(legend(colour, forbidden), soft_wrap=True)
