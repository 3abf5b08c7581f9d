"""Runtimes that run the target (and draft) models. See :mod:`exactspec.backends.base`.

The names below are imported on first use (PEP 562): the command line reads the backends'
option values (:mod:`exactspec.load_options`) without loading PyTorch or transformers."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exactspec.backends.base import Backend, Tokenizer, UnsupportedModelError
    from exactspec.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppNotInstalledError
    from exactspec.backends.transformers_backend import HFTokenizer, TransformersBackend

_EXPORTS = {
    "exactspec.backends.base": ("Backend", "Tokenizer", "UnsupportedModelError"),
    "exactspec.backends.llama_cpp_backend": ("LlamaCppBackend", "LlamaCppNotInstalledError"),
    "exactspec.backends.transformers_backend": ("HFTokenizer", "TransformersBackend"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}

__all__ = ["Backend", "HFTokenizer", "LlamaCppBackend", "LlamaCppNotInstalledError",
           "Tokenizer", "TransformersBackend", "UnsupportedModelError"]


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'exactspec.backends' has no attribute {name!r}")
    value = getattr(importlib.import_module(_MODULE_OF[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
