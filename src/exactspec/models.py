"""Loading a model: which backend runs it (:func:`choose_backend`) and :func:`load_model`.

Finding and checking the files is :mod:`exactspec.model_files`' (below the backends); this
module sits above them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from exactspec.backends import native
from exactspec.backends.base import Backend
from exactspec.backends.llama_cpp_backend import LlamaCppBackend, llama_cpp_available
from exactspec.backends.native_backend import ARCHITECTURES, NativeBackend, converted
from exactspec.backends.transformers_backend import TransformersBackend, resolve_device
from exactspec.load_options import BACKENDS
from exactspec.model_files import (DEFAULT_MODEL, check_model_path, gguf_architecture,
                                   gguf_tensor_types)
from exactspec.proposers.spec import BACKENDS_NEEDED, ProposerSpec


def choose_backend(path: Path, backend: str = "auto", *, device: str = "auto",
                   dtype: str | None = None, kernels: str | None = None,
                   proposer: ProposerSpec | None = None) -> str:
    """The runtime for the model at ``path``: ``backend`` itself unless it is ``auto``.

    ``auto`` picks the native backend for a ``.gguf`` file of an architecture it runs on a
    CPU-only machine where exactspec's kernels build and neither a torch dtype nor torch
    kernels were asked for: it decodes fastest there and verifies almost for free
    (docs/backends.md). A GGUF file it cannot run goes to llama.cpp where llama-cpp-python
    is installed. Everything else (model folders, a GPU, an explicit dtype) gets
    transformers. A ``proposer`` that drafts from the target's own layers or hidden
    features runs on some backends only (:data:`~exactspec.proposers.spec.BACKENDS_NEEDED`:
    early exit on transformers, a draft head on native or transformers): ``auto`` then
    falls back to transformers where its choice is not one of them, and another backend is
    refused.

    Raises:
        ValueError: for an unknown backend, or a combination llama.cpp or the native
            backend cannot run (a model folder, a dtype, kernels, a GPU device, a proposer
            needing transformers).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is invalid: choose one of {', '.join(BACKENDS)}")
    needed = [BACKENDS_NEEDED[part.kind] for part in (proposer.parts if proposer else ())
              if part.kind in BACKENDS_NEEDED]
    allowed, why = needed[0] if needed else (BACKENDS, "")
    if backend not in ("auto", *allowed):
        raise ValueError(f"the proposer {proposer.spec} {why}, which needs the "
                         f"{' or '.join(allowed)} backend, not {backend}: choose "
                         f"{' or '.join(allowed)} (or auto)")
    if backend == "auto":
        cpu_only = device == "cpu" or (device == "auto" and resolve_device("auto").type == "cpu")
        fits = path.suffix == ".gguf" and cpu_only and dtype is None and kernels is None
        if fits and _native_runs(path):
            backend = "native"
        else:
            backend = "llama_cpp" if fits and llama_cpp_available() else "transformers"
        return backend if backend in allowed else "transformers"
    if backend in ("llama_cpp", "native"):
        if dtype is not None:
            raise ValueError(f"dtype {dtype!r} applies to the transformers backend only: "
                             f"the {backend} backend runs the GGUF file's own (quantised) weights")
        if kernels is not None:
            raise ValueError(f"kernels {kernels!r} applies to the transformers backend only: "
                             f"the {backend} backend's batch invariance comes from its kernels")
        if device not in ("auto", "cpu"):
            raise ValueError(f"device {device!r} is not supported by the {backend} backend "
                             "(it runs on the CPU): use --device cpu")
        if backend == "native" and path.suffix != ".gguf":
            raise ValueError(f"the native backend loads .gguf files, not {str(path)!r}; use "
                             "--backend transformers for a model folder")
    return backend


def _native_runs(path: Path) -> bool:
    """Whether the native backend runs this GGUF file here: its architecture is one the
    backend knows, it reads every tensor type in it, and the kernels build (a header read,
    no weights)."""
    return (gguf_architecture(path) in ARCHITECTURES
            and set(gguf_tensor_types(path)) <= set(native.WEIGHT_TYPES)
            and native.load() is not None)


def load_model(name_or_path: str = DEFAULT_MODEL, *, backend: str = "auto",
               device: str = "auto", dtype: str | None = None,
               threads: int | None = None, kernels: str | None = None,
               max_model_len: int | None = None, weight_type: str | None = None,
               activations: str | None = None,
               proposer: ProposerSpec | None = None) -> Backend:
    """Load a model on the native, the transformers or the llama.cpp backend.

    Args:
        name_or_path: an embedded model name (default ``smollm2-135m-instruct``), a local
            Hugging Face model folder, or a ``.gguf`` file.
        backend: ``auto`` (default, see :func:`choose_backend`), ``native`` (GGUF files
            on exactspec's own kernels), ``transformers`` or ``llama_cpp`` (needs the
            optional extra: ``pip install 'exactspec[llama-cpp]'``).
        device: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: transformers only: ``float32`` (the default), ``bfloat16`` or ``float16``.
        kernels: transformers only: ``batch-invariant`` (the default) or ``fast``, see
            :mod:`~exactspec.backends.batch_invariant`. The backend's ``batch_invariant``
            says whether greedy output is bit-identical to plain decoding on this choice,
            dtype and device.
        threads: CPU threads. llama.cpp: its threads (default: half the cores this process
            may use; all of them are faster on an idle machine but collapse when another
            process takes a core, see docs/backends.md). transformers: the most a forward uses
            (default: PyTorch's count); each forward runs with one or this many, whichever
            is measured faster (:class:`~exactspec.threads.ThreadChooser`).
        max_model_len: most tokens (prompt + generated) a sequence may hold (default: the
            model's context; llama.cpp at most its ``DEFAULT_CONTEXT_LENGTH``). On llama.cpp
            it is also the KV cache allocated per sequence, so batched decoding's memory
            grows with ``max_model_len`` × its batch size.
        weight_type: native and llama.cpp: the GGUF file's weights converted to ``F32`` (the same
            weights), ``BF16``, ``F16``, ``Q8_0`` or ``Q4_0`` (rounded), see
            :func:`~exactspec.backends.native_backend.converted`; None: as the file has them.
        activations: native only: ``int8`` (the default) or ``float32`` inputs to the
            products over Q4_0, Q4_1 and Q8_0 weights (see
            :class:`~exactspec.backends.native_backend.GGUFModel`); None: the default.
        proposer: the proposer that will draft for this target, where its needs choose the
            backend (see :func:`choose_backend`); None: no such needs.
    Returns:
        a :class:`~exactspec.backends.base.Backend`.
    Raises:
        ModelNotFoundError: if the model cannot be found (the message says how to get it),
            or a folder lacks a config, weights or a tokenizer (see :func:`check_model_path`).
        ValueError: for a file that is not GGUF, a bad backend, device or dtype, a
            ``max_model_len`` < 1 or above the model's context, or options the backend
            cannot use.
        LlamaCppNotInstalledError: for ``llama_cpp`` without llama-cpp-python (the message
            gives the install command).
        UnsupportedModelError: if the model's KV cache cannot be rolled back.
    """
    path = check_model_path(name_or_path)
    chosen = choose_backend(path, backend, device=device, dtype=dtype, kernels=kernels,
                            proposer=proposer)
    if chosen == "native":
        return NativeBackend.load(path if weight_type is None else converted(path, weight_type),
                                  threads=threads, max_model_len=max_model_len,
                                  activations=activations or "int8")
    if activations is not None:
        raise ValueError(f"activations = {activations!r} (--activations) applies to the native "
                         f"backend only, and this model runs on {chosen}")
    if chosen == "llama_cpp":
        return LlamaCppBackend.load(path, threads=threads, context_length=max_model_len,
                                    weight_type=weight_type)
    if weight_type is not None:
        raise ValueError(f"weight type {weight_type!r} (--weight-type) applies to GGUF "
                         "backends only (native, llama_cpp), and this model runs on transformers (--dtype chooses "
                         "its weights' type)")

    return TransformersBackend.load(path, device=device, dtype=dtype or "float32",
                                    kernels=kernels or "batch-invariant",
                                    max_model_len=max_model_len, threads=threads)


@dataclass(frozen=True)
class ModelSpec:
    """:func:`load_model`'s arguments, to load the model later or elsewhere (picklable: a
    Ray worker loads from it). The attributes are :func:`load_model`'s."""

    name_or_path: str = DEFAULT_MODEL
    backend: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    threads: int | None = None
    kernels: str | None = None
    max_model_len: int | None = None
    weight_type: str | None = None
    activations: str | None = None

    def load(self, name_or_path: str | None = None, *, proposer: ProposerSpec | None = None,
             weight_type: str | None = None) -> Backend:
        """The model, or ``name_or_path`` with the same options (a draft model), its weights
        converted to ``weight_type`` where given (else :attr:`weight_type`); ``proposer`` as
        :func:`load_model`'s. Raises what :func:`load_model` raises."""
        return load_model(name_or_path or self.name_or_path, backend=self.backend,
                          device=self.device, dtype=self.dtype, threads=self.threads,
                          kernels=self.kernels, max_model_len=self.max_model_len,
                          weight_type=weight_type or self.weight_type,
                          activations=self.activations, proposer=proposer)
