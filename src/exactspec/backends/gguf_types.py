"""A GGUF file's weights in another GGUF type, for the llama.cpp backend's ``weight_type``.

llama.cpp's cost of scoring several tokens depends on the weights' type: with the embedded
model's Q4_1 each extra token scored costs ≈ 80 % of a plain step, with Q8_0 ≈ 70 % at a
plain step no slower, with BF16 ≈ 40 % at a plain step 24 % slower
(results/llama-weights-2026-12-01). The conversion dequantises each 2-D weight exactly
(gguf-py's ``dequantize``: ``d · q + m`` in float32) and writes it as:

- ``F32``: the same weights as the file, unrounded (4 bytes a weight);
- ``BF16``, ``F16``: those weights rounded to 16 bits;
- ``Q8_0``: rounded to 8-bit blocks of 32 with a float16 scale.

1-D tensors (norms) stay F32. The converted file is written once into exactspec's cache
(``gguf-types/``, keyed by the source file's name, size and modification time) and reused.
Rounded types are another model, close to the file's: the target distribution is the
converted model's, exactly, like any other model's.
"""

from __future__ import annotations

import os
from pathlib import Path

WEIGHT_TYPES = ("F32", "BF16", "F16", "Q8_0")
"""Types a GGUF file's weights can be converted to."""


def converted_gguf(source: Path, weight_type: str) -> Path:
    """``source`` with every 2-D weight in ``weight_type`` (one of :data:`WEIGHT_TYPES`),
    converted on first use (seconds for the embedded model) and cached.

    Raises:
        ValueError: for an unknown type.
    """
    import gguf
    import numpy as np

    from exactspec.backends.transformers_backend import cache_root

    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight type {weight_type!r} is invalid: choose one of "
                         f"{', '.join(WEIGHT_TYPES)}")
    types = gguf.GGMLQuantizationType
    qtype = {"F32": types.F32, "BF16": types.BF16, "F16": types.F16, "Q8_0": types.Q8_0}[
        weight_type]
    file_type = {"F32": gguf.LlamaFileType.ALL_F32, "BF16": gguf.LlamaFileType.MOSTLY_BF16,
                 "F16": gguf.LlamaFileType.MOSTLY_F16,
                 "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[weight_type]
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
    for tensor in reader.tensors:
        weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if weights.ndim < 2 or qtype == types.F32:
            writer.add_tensor(tensor.name, weights)
        else:
            writer.add_tensor(tensor.name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(partial, target)  # atomic: another process may be converting too
    return target
