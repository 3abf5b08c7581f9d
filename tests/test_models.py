"""Finding and checking models before anything is loaded: a folder's files, a GGUF file's
magic bytes, the layer count from metadata, and a GGUF conversion that leaves nothing
behind when it fails."""

import json
import logging
import os
from types import SimpleNamespace

import pytest

from exactspec.model_files import converted_gguf_folder
from exactspec.model_files import ModelNotFoundError, check_model_path, layer_count

from conftest import tiny_model

FORMS = ("a model is an embedded model name (smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct, "
         "qwen2.5-coder-0.5b-instruct), a Hugging Face model "
         "folder (config.json, *.safetensors or *.bin weights, tokenizer.json or "
         "tokenizer.model) or a .gguf file")


def test_a_folder_must_have_config_weights_and_tokenizer(tmp_path):
    with pytest.raises(ModelNotFoundError) as error:
        check_model_path(str(tmp_path))
    assert str(error.value) == (
        f"model folder '{tmp_path}' lacks config.json, weights (*.safetensors or *.bin) and a "
        f"tokenizer (tokenizer.json, tokenizer.model or vocab.json): {FORMS}")
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="lacks a tokenizer .tokenizer.json, "
                                                 "tokenizer.model or vocab.json.: a model is"):
        check_model_path(str(tmp_path))
    (tmp_path / "tokenizer.model").write_bytes(b"")
    assert check_model_path(str(tmp_path)) == tmp_path


def test_a_file_must_be_gguf(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_text("not a model")
    with pytest.raises(ValueError) as error:
        check_model_path(str(fake))
    assert str(error.value) == f"'{fake}' is not a GGUF file: it starts with b'not ', not b'GGUF'"
    other = tmp_path / "model.bin"
    other.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=f"model file '{other}' is not a .gguf file: a model is"):
        check_model_path(str(other))


def test_layer_count_from_config_and_gguf_metadata(tmp_path):
    from tiny_gguf import write_tiny_gguf

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"num_hidden_layers": 7}}))
    assert layer_count(tmp_path) == 7
    (tmp_path / "config.json").write_text("{}")
    assert layer_count(tmp_path) is None
    assert layer_count(write_tiny_gguf(tiny_model(0), tmp_path / "tiny.gguf")) == 2


def test_a_gguf_header_is_read_once_per_version_of_the_file(tmp_path, monkeypatch):
    """The header is parsed once per file version: the reader parses every field (the
    tokenizer's arrays too), and a command asks for the architecture several times."""
    from exactspec import gguf_file
    from exactspec.model_files import gguf_architecture, gguf_architecture_value
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tiny_model(0), tmp_path / "tiny.gguf")
    reads, reader = [], gguf_file.GGUFFile
    monkeypatch.setattr(gguf_file, "GGUFFile", lambda *args: reads.append(args) or reader(*args))
    assert gguf_architecture(path) == gguf_architecture(tmp_path / "." / "tiny.gguf")
    assert gguf_architecture_value(path, "block_count") == 2
    assert gguf_architecture_value(path, "no_such_key") is None
    assert len(reads) == 1
    write_tiny_gguf(tiny_model(1), path)  # a new version of the file: read again
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10 ** 9))
    assert gguf_architecture_value(path, "block_count") == 2 and len(reads) == 2


def test_not_gguf_is_refused_before_converting(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "fake.gguf"
    fake.write_bytes(b"\x00" * 64)
    with caplog.at_level(logging.INFO), pytest.raises(ValueError, match="is not a GGUF file"):
        converted_gguf_folder(fake)
    assert not caplog.records and not (tmp_path / "cache").exists()


class FakeLoaded:
    """Stands for transformers' tokenizer and model: ``save_pretrained`` writes a file,
    then raises ``fail`` if given."""

    def __init__(self, name, fail=None):
        self.name, self.fail = name, fail
        self.hf_quantizer = None
        self.config = SimpleNamespace(quantization_config=None)

    def save_pretrained(self, folder):
        (folder / self.name).write_text("{}")
        if self.fail:
            raise self.fail


@pytest.mark.parametrize("fail", [OSError("disk full"), KeyboardInterrupt()])
def test_a_failed_conversion_leaves_no_folder(tmp_path, monkeypatch, fail):
    import transformers

    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + b"\x00" * 60)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: FakeLoaded("tokenizer.json"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: FakeLoaded("config.json", fail))
    with pytest.raises(type(fail)):
        converted_gguf_folder(gguf)
    assert list((tmp_path / "cache" / "converted").iterdir()) == []
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: FakeLoaded("config.json"))
    folder = converted_gguf_folder(gguf)  # the same conversion, succeeding
    assert [p.name for p in (tmp_path / "cache" / "converted").iterdir()] == [folder.name]
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "tokenizer.json"]
