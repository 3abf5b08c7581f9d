"""Result files and printed JSON for people.

Nothing half-written is ever left: each file is written under a temporary name in its own
folder and renamed into place (``os.replace``, atomic on POSIX and Windows), so an error or
Ctrl-C leaves either the whole new file or none. JSON meant to be read (``generate
--json``, ``audit.json``, the bench's ``results.json``) keeps each list or object of plain
values, such as a list of token ids, on one line."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def replaced_atomically(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; on success it replaces
    ``path``, on any exception (Ctrl-C included) it is removed and ``path`` is untouched.
    The temporary name keeps the suffix, for writers that infer the format from it."""
    path = Path(path)
    partial = path.with_name(f".{path.stem}.partial-{os.getpid()}{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` as a whole or not at all; returns ``path``."""
    with replaced_atomically(path) as partial:
        partial.write_text(text, encoding="utf-8")
    return Path(path)


def readable_json(value: object, indent: int = 0) -> str:
    """``value`` as JSON, indented by nesting, except that a list or object whose members
    are all plain values (numbers, strings, booleans, null) is written on one line.
    Values JSON cannot represent are written as ``str(value)``."""
    if isinstance(value, (list, tuple, dict)) and value:
        members = value.values() if isinstance(value, dict) else value
        if all(not isinstance(m, (list, tuple, dict)) for m in members):
            return json.dumps(value, ensure_ascii=False, default=str)
        pad = " " * (indent + 2)
        if isinstance(value, dict):
            lines = [f"{pad}{json.dumps(str(k), ensure_ascii=False)}: "
                     f"{readable_json(v, indent + 2)}" for k, v in value.items()]
            return "{\n" + ",\n".join(lines) + "\n" + " " * indent + "}"
        lines = [pad + readable_json(m, indent + 2) for m in value]
        return "[\n" + ",\n".join(lines) + "\n" + " " * indent + "]"
    return json.dumps(value, ensure_ascii=False, default=str)
