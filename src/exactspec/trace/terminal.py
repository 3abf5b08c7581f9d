"""``generate --show``: the output with every token marked by how it was committed.

Colours (rich) on a terminal that has them: accepted drafts green, recovered tokens (after a
rejection) yellow, bonus tokens cyan, plain steps unstyled, and a dim ``▏`` between cycles.
Without colours (a pipe, ``NO_COLOR`` set, a dumb terminal) the same information as markers:
``[accepted]``, ``{recovered}``, ``<bonus>``, plain tokens bare, ``|`` between cycles.
Plain steps (one token per cycle) are not separated from each other; ``∅`` stands for a
token without text (EOS), ``·`` for one holding only part of a character.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rich.console import Console
from rich.text import Text

from exactspec.cycle_trace import CycleTrace, TokenKind
from exactspec.trace.view import NO_TEXT, PARTIAL, at_boundary, shown_pieces

STYLES: dict[TokenKind, str] = {"accepted": "green", "recovered": "bold yellow",
                                "bonus": "cyan", "plain": ""}
MARKERS: dict[TokenKind, tuple[str, str]] = {"accepted": ("[", "]"), "recovered": ("{", "}"),
                                             "bonus": ("<", ">"), "plain": ("", "")}
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
        for _, kind in cycle.committed:
            piece = next(pieces)
            if colour:
                text.append(piece, style=STYLES[kind])
            else:
                opening, closing = MARKERS[kind]
                text.append(f"{opening}{piece}{closing}")
    return text


def legend(colour: bool) -> Text:
    """One line naming each mark."""
    text = Text("legend: ")
    names = {"accepted": "accepted draft", "recovered": "recovered after a rejection",
             "bonus": "bonus token", "plain": "plain step (no drafts)"}
    for kind, name in names.items():
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
    console.print(legend(colour), soft_wrap=True)
