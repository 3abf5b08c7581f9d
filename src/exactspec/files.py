"""Writing result files so that nothing half-written is ever left: each file is written
under a temporary name in its own folder and renamed into place (``os.replace``, atomic on
POSIX and Windows), so an error or Ctrl-C leaves either the whole new file or none."""

from __future__ import annotations

import contextlib
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
