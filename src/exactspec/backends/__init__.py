"""Runtimes that run the target (and draft) models. See :mod:`exactspec.backends.base`."""

from exactspec.backends.base import Backend, Tokenizer, UnsupportedModelError
from exactspec.backends.llama_cpp_backend import LlamaCppBackend, LlamaCppNotInstalledError
from exactspec.backends.transformers_backend import HFTokenizer, TransformersBackend

__all__ = ["Backend", "HFTokenizer", "LlamaCppBackend", "LlamaCppNotInstalledError", "Tokenizer",
           "TransformersBackend", "UnsupportedModelError"]
