"""Runtimes that run the target (and draft) models. See :mod:`exactspec.backends.base`.

The names below are imported on first use (PEP 562, through ``lazy_loader``): the command
line reads the backends' option values (:mod:`exactspec.load_options`) without loading
PyTorch or transformers."""

from __future__ import annotations

from typing import TYPE_CHECKING

import lazy_loader

if TYPE_CHECKING:
    from exactspec.backends.base import Backend, Tokenizer, UnsupportedModelError
    from exactspec.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppNotInstalledError
    from exactspec.backends.transformers_backend import HFTokenizer, TransformersBackend

__getattr__, __dir__, __all__ = lazy_loader.attach(__name__, submod_attrs={
    "base": ("Backend", "Tokenizer", "UnsupportedModelError"),
    "llama_cpp_backend": ("LlamaCppBackend", "LlamaCppNotInstalledError"),
    "transformers_backend": ("HFTokenizer", "TransformersBackend"),
})
