"""The values :func:`~exactspec.models.load_model`'s options take, and the batch size
:class:`~exactspec.batching.BatchedGenerator` defaults to, known without importing a
runtime: the command line lists them in ``--help`` before anything loads PyTorch."""

from __future__ import annotations

import os

BACKENDS = ("auto", "native", "transformers", "llama_cpp")
"""Runtimes :func:`~exactspec.models.load_model` knows; ``auto`` picks one per model (see
:func:`~exactspec.models.choose_backend`)."""
KERNELS = ("batch-invariant", "fast")
"""Kernel choices of the transformers backend (``batch-invariant`` is the default; see
:mod:`exactspec.backends.batch_invariant`)."""

ACTIVATIONS = ("int8", "float32")
"""The native backend's input arithmetic over Q4_0, Q4_1 and Q8_0 weights (``int8``, the
default, or ``float32``; see :class:`~exactspec.backends.native_backend.GGUFModel`)."""

DEFAULT_MAX_BATCH_SIZE = 8
"""Rows :class:`~exactspec.batching.BatchedGenerator` decodes together when none is given."""


def default_threads() -> int:
    """Half the CPU cores this process may use, at least 1 (llama-cpp-python's own default,
    over the cores this process may use): the llama.cpp backend's threads when none are
    given. Not all of them: llama.cpp's threads wait for each other many times per token,
    so when another process takes a core one of them waits for it, and decoding collapses
    (figures: docs/backends.md, "Choosing --threads")."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // 2)
