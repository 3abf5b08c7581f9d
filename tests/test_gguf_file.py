"""exactspec's GGUF reader gives gguf-py's fields and tensors (names, shapes, types, bytes)
and refuses files that are not GGUF or are cut short."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import tiny_model
from exactspec.gguf_file import GGUFFile

gguf = pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(tiny_model(3), path)
    return path


def with_block_tensors(source, path):
    """``source`` plus a Q4_K and a Q6_K tensor and a float array field."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    writer.add_array("test.floats", [0.5, -1.25, 3.0])
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    rng = np.random.default_rng(0)
    for name, qtype, nbytes in (("extra.q4_k", "Q4_K", 144), ("extra.q6_k", "Q6_K", 210)):
        writer.add_tensor(name, rng.integers(0, 256, (3, 2 * nbytes), dtype=np.uint8),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_fields_and_tensors_are_gguf_pys(tiny, tmp_path):
    path = with_block_tensors(tiny, tmp_path / "blocks.gguf")
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)
    expected = {name: field.contents() for name, field in theirs.fields.items()
                if not name.startswith("GGUF.")}
    assert ours.fields == expected
    assert ours.fields["test.floats"] == [0.5, -1.25, 3.0]
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert (mine.name, list(mine.shape), mine.tensor_type) == (
            reference.name, list(reference.shape), reference.tensor_type)
        assert mine.data.dtype == reference.data.dtype
        assert mine.data.shape == reference.data.shape
        assert np.array_equal(mine.data, reference.data), mine.name
    assert {t.tensor_type.name for t in ours.tensors} >= {"F32", "Q4_K", "Q6_K"}


def test_other_files_are_refused(tiny, tmp_path):
    text = tmp_path / "model.txt"
    text.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="is not a GGUF file: it starts with b'not '"):
        GGUFFile(text)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[:-100])
    with pytest.raises(ValueError, match="is cut short: tensor .* ends at byte"):
        GGUFFile(cut)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(tiny.read_bytes()[:200])
    with pytest.raises(ValueError, match="is cut short"):
        GGUFFile(header_only)
