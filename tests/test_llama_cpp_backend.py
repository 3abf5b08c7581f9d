"""What is particular to the llama.cpp backend: choosing it, the error without
llama-cpp-python, the GGUF's own tokenizer and chat template, and llama-cpp-python's own
generate as bench peers. (The shared backend and engine tests run on it through
``make_backend``.)"""

import importlib.util
import re
import sys
import warnings

import numpy as np
import pytest

from exactspec import SamplingParams, SpeculativeGenerator, PromptLookupProposer
from exactspec.backends.llama_cpp_backend import (LlamaCppBackend, LlamaCppNotInstalledError,
                                                  import_llama_cpp)
from exactspec.model_files import DEFAULT_MODEL, EMBEDDED_MODELS, ModelNotFoundError
from exactspec.models import choose_backend
from exactspec.proposers.spec import parse_proposer

from conftest import ALPHABET, tiny_model, one

needs_llama_cpp = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                     reason="llama-cpp-python is not installed "
                                            "(pip install 'exactspec[llama-cpp]')")


def embedded_model_path():
    try:
        return EMBEDDED_MODELS[DEFAULT_MODEL].path()
    except ModelNotFoundError as error:
        pytest.skip(str(error))


def test_missing_llama_cpp_names_the_install_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` fail
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    with pytest.raises(LlamaCppNotInstalledError,
                       match=re.escape(f'CMAKE_ARGS="-DGGML_LLAMAFILE=OFF" CFLAGS="{no_amx}" '
                                       f'CXXFLAGS="{no_amx}" pip install --no-cache-dir')):
        import_llama_cpp()
    with pytest.raises(LlamaCppNotInstalledError, match="llama-cpp-python"):
        LlamaCppBackend.load("model.gguf")


@needs_llama_cpp
def test_a_build_with_amx_warns_before_its_first_forward(monkeypatch, tmp_path):
    """AMX crashes llama.cpp where a virtual machine reports it without enabling it (a
    segmentation fault, no Python error): a build that has it names the reinstall command
    before anything runs."""
    import llama_cpp
    from conftest import BackendFactory

    make = BackendFactory("llama_cpp", tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        make()  # this build (the README's flags): no AMX, no warning
    info = llama_cpp.llama_print_system_info()
    monkeypatch.setattr(llama_cpp, "llama_print_system_info",
                        lambda: info + b" AMX_INT8 = 1 |")
    with pytest.warns(RuntimeWarning, match=r"uses AMX.*-mno-amx-tile.*--force-reinstall"):
        make()


def test_choose_backend(monkeypatch, tmp_path):
    import gguf as gguf_package

    import exactspec.models as module  # where choose_backend looks llama_cpp_available up
    from exactspec.backends import native
    from conftest import tiny_model
    from tiny_gguf import write_tiny_gguf

    gguf, folder = write_tiny_gguf(tiny_model(0), tmp_path / "m.gguf"), tmp_path
    other = tmp_path / "other.gguf"  # an architecture the native backend does not run
    writer = gguf_package.GGUFWriter(str(other), "gemma3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    monkeypatch.setattr(module, "llama_cpp_available", lambda: True)
    expected = "native" if native.load() is not None else "llama_cpp"
    assert choose_backend(gguf, device="cpu") == expected
    assert choose_backend(other, device="cpu") == "llama_cpp"
    k_quant = tmp_path / "k.gguf"  # an architecture it runs, a type it does not read yet
    writer = gguf_package.GGUFWriter(str(k_quant), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.zeros((1, 84), dtype=np.uint8), raw_shape=(1, 84),
                      raw_dtype=gguf_package.GGMLQuantizationType.Q2_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert choose_backend(k_quant, device="cpu") == "llama_cpp"
    assert choose_backend(folder, device="cpu") == "transformers"
    assert choose_backend(gguf, device="cpu", dtype="float32") == "transformers"
    assert choose_backend(gguf, "transformers", device="cpu") == "transformers"
    # a proposer drafting from the target's layers or features runs where they are given
    assert choose_backend(gguf, device="cpu", proposer=parse_proposer("suffix")) == expected
    assert choose_backend(gguf, device="cpu", proposer=parse_proposer("early-exit:1")) \
        == "transformers"
    assert choose_backend(gguf, device="cpu", proposer=parse_proposer("head")) == (
        "native" if expected == "native" else "transformers")
    assert choose_backend(other, device="cpu", proposer=parse_proposer("head")) == "transformers"
    assert choose_backend(gguf, device="cpu", proposer=parse_proposer("suffix+head")) == (
        "native" if expected == "native" else "transformers")  # the model part decides
    with pytest.raises(ValueError, match="the proposer suffix\\+head drafts from the target's "
                                         "hidden features"):
        choose_backend(gguf, "llama_cpp", proposer=parse_proposer("suffix+head"))
    with pytest.raises(ValueError, match="the proposer early-exit:1 drafts with the target's "
                                         "own layers, which needs the transformers backend, "
                                         "not native: choose transformers"):
        choose_backend(gguf, "native", proposer=parse_proposer("early-exit:1"))
    with pytest.raises(ValueError, match="the proposer head drafts from the target's hidden "
                                         "features, which needs the native or transformers "
                                         "backend, not llama_cpp: choose native or transformers"):
        choose_backend(gguf, "llama_cpp", proposer=parse_proposer("head"))
    monkeypatch.setattr(native, "load", lambda: None)  # no C compiler
    assert choose_backend(gguf, device="cpu") == "llama_cpp"
    monkeypatch.setattr(module, "llama_cpp_available", lambda: False)
    assert choose_backend(gguf, device="cpu") == "transformers"
    with pytest.raises(ValueError, match="backend 'vllm' is invalid: choose one of auto, "
                                         "native, transformers, llama_cpp"):
        choose_backend(gguf, "vllm")
    with pytest.raises(ValueError, match="dtype 'bfloat16' applies to the transformers backend"):
        choose_backend(gguf, "llama_cpp", dtype="bfloat16")
    with pytest.raises(ValueError, match="device 'cuda' is not supported by the llama_cpp"):
        choose_backend(gguf, "llama_cpp", device="cuda")
    with pytest.raises(ValueError, match="the native backend loads .gguf files"):
        choose_backend(folder, "native")


@needs_llama_cpp
def test_speculation_is_refused_on_a_backend_that_is_not_batch_invariant(tmp_path):
    from exactspec.backends.base import UnsupportedModelError
    from tiny_gguf import write_tiny_gguf

    class BatchVariant(LlamaCppBackend):
        """Scores batches with a rounding-sized difference, as llamafile's kernels do."""

        def forward(self, rows, num_logits=None):
            logits = super().forward(rows, num_logits)
            return [row + 1e-6 if len(token_ids) > 1 else row
                    for row, (_, token_ids) in zip(logits, rows)]

    path = write_tiny_gguf(tiny_model(0), tmp_path / "tiny.gguf")
    honest = LlamaCppBackend.load(path, threads=1)
    assert honest.batch_invariant  # this build: GGML_LLAMAFILE=OFF
    variant = BatchVariant(honest.new_llama())
    assert not variant.batch_invariant
    one(variant).prefill([1, 2])  # the check freed the one slot: a new sequence fits
    one(variant).release()
    with pytest.raises(UnsupportedModelError, match="not batch-invariant.*GGML_LLAMAFILE=OFF"):
        SpeculativeGenerator(variant, PromptLookupProposer(), 4)
    plain = SpeculativeGenerator(variant, None).generate("abc", SamplingParams(max_new_tokens=3))
    assert len(plain.token_ids) == 3


@needs_llama_cpp
def test_load_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        LlamaCppBackend.load(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="loads .gguf files"):
        LlamaCppBackend.load(tmp_path)
    (tmp_path / "m.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="threads = 0 is invalid"):
        LlamaCppBackend.load(tmp_path / "m.gguf", threads=0)


@needs_llama_cpp
def test_gguf_tokenizer_and_eos_from_the_file(tmp_path):
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tiny_model(0), tmp_path / "tiny.gguf", eos=5)
    backend = LlamaCppBackend.load(path, threads=1)
    text = "abc abc, abd!\nok"
    ids = backend.tokenizer.encode(text)
    assert ids == [ALPHABET.index(c) for c in text]  # one token per character, no BOS
    assert backend.tokenizer.decode(ids) == text
    assert backend.eos_token_ids == (5,) and backend.vocab_size == 64
    assert backend.max_context_length == 512
    assert backend.tokenizer.get_vocab()["a"] == 0
    with pytest.raises(ValueError, match="no chat template"):
        backend.tokenizer.apply_chat_template("hi")
    assert backend.description == "llama.cpp cpu, 1 thread"


@needs_llama_cpp
def test_context_length_bounds_each_sequence_and_its_kv_cache(tmp_path):
    from tiny_gguf import write_tiny_gguf

    from exactspec import BatchedGenerator

    path = write_tiny_gguf(tiny_model(0), tmp_path / "tiny.gguf")
    with pytest.raises(ValueError, match="context_length = 1024 is invalid: tiny.gguf's "
                                         "context holds 512 tokens"):
        LlamaCppBackend.load(path, threads=1, context_length=1024)
    backend = LlamaCppBackend.load(path, threads=1, context_length=24)
    assert backend.max_context_length == 24
    backend.reserve(2)
    llama_cpp = import_llama_cpp()
    assert llama_cpp.llama_n_ctx_seq(backend._context) == 256  # 24, padded by llama.cpp
    with pytest.raises(ValueError, match="exceed the llama.cpp context of 24"):
        backend.prefill(0, [1] * 25)
    generator = SpeculativeGenerator(backend, PromptLookupProposer(), 4)
    params = SamplingParams(max_new_tokens=100, ignore_eos=True)
    alone = generator.generate("abc abc abd abc", params)
    assert alone.finish_reason == "length"
    assert len(alone.prompt_token_ids) + len(alone.token_ids) == 24
    batched = BatchedGenerator(generator, 2).generate(["abc abc abd abc"] * 2, params)
    assert [r.token_ids for r in batched] == [alone.token_ids] * 2


@needs_llama_cpp
@pytest.mark.real_model
def test_embedded_model_chat_template_and_eos_match_transformers():
    from exactspec.backends.transformers_backend import TransformersBackend

    path = embedded_model_path()
    ours = LlamaCppBackend.load(path)
    reference = TransformersBackend.load(path, device="cpu")
    prompt = "What is the capital of Japan?"
    assert ours.tokenizer.apply_chat_template(prompt) == \
        reference.tokenizer.apply_chat_template(prompt)
    assert ours.tokenizer.encode("Hello world, 123") == reference.tokenizer.encode("Hello world, 123")
    assert set(reference.eos_token_ids) <= set(ours.eos_token_ids)


@needs_llama_cpp
@pytest.mark.real_model
def test_llama_cpp_python_peers_run_and_plain_matches_ours():
    from exactspec.bench.methods import parse_method

    target = LlamaCppBackend.load(embedded_model_path())
    prompt_ids = target.tokenizer.apply_chat_template(
        "Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox")
    params = SamplingParams(max_new_tokens=32)
    ours = SpeculativeGenerator(target, None).generate(prompt_ids, params).token_ids
    for spec in ("llama-plain", "llama-prompt-lookup:k=4"):
        method = parse_method(spec, target, load_model=None)
        assert method.is_peer and method.k == (0 if spec == "llama-plain" else 4)
        outcome = method.run(prompt_ids, params)
        assert outcome.token_ids == ours, spec
    speculative = SpeculativeGenerator(target, PromptLookupProposer(), 6).generate(prompt_ids, params)
    assert speculative.token_ids == ours
    with pytest.raises(ValueError, match="needs the transformers backend"):
        parse_method("hf-plain", target, load_model=None)


@needs_llama_cpp
def test_llama_cpp_python_sampling_with_its_prompt_lookup_agrees_with_the_reference(tmp_path):
    """llama-cpp-python's own speculative sampling passes the audit against the exact
    reference on a tiny model; the same at another temperature fails; warpers that it
    applies before the temperature are refused."""
    import dataclasses

    from exactspec.audit import audit_distribution, check_greedy
    from exactspec.peers import LlamaCppPeer
    from conftest import BackendFactory
    from test_audit import lookup_friendly_prompt

    target = BackendFactory("llama_cpp", tmp_path)(0)
    prompt = lookup_friendly_prompt(target, 1, [2, 3, 4])
    engine = LlamaCppPeer(target, 4)
    params = SamplingParams(temperature=0.8, seed=3, max_new_tokens=2)
    assert not audit_distribution(target, engine, [prompt], params, 800, 0.01).rejected
    assert all(c.identical for c in check_greedy(target, engine, [prompt], 12))

    class WrongTemperature:
        name, draft_stats = "wrong", None

        def sample(self, prompt_ids, asked, n):
            return engine.sample(prompt_ids, dataclasses.replace(asked, temperature=1.1), n)

    assert audit_distribution(target, WrongTemperature(), [prompt], params, 800, 0.01).rejected
    with pytest.raises(ValueError, match="applies top-k, top-p and min-p before the temperature"):
        engine.sample(prompt, dataclasses.replace(params, top_p=0.9), 1)


@pytest.mark.parametrize("cores, threads", [(1, 1), (2, 1), (3, 1), (8, 4)])
def test_default_threads_leave_half_the_cores_free(monkeypatch, cores, threads):
    import os

    from exactspec.load_options import default_threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert default_threads() == threads


def test_decoding_far_below_the_load_time_check_names_threads():
    from types import SimpleNamespace

    from exactspec.backends.llama_cpp_backend import LlamaCppBackend, slow_decoding_warning

    def loaded(threads):
        backend = LlamaCppBackend.__new__(LlamaCppBackend)  # what the load-time check left
        backend.seconds_per_token_at_load = 0.0125
        backend.llama = SimpleNamespace(n_threads=threads)
        return backend
    assert slow_decoding_warning(loaded(2), 32, 64.0) == (
        "decoding ran at 0.5 tokens/s, 160× slower than llama.cpp scored tokens when it loaded "
        "(80 tokens/s) with 2 threads: another process is probably using the CPU, and "
        "llama.cpp's threads wait for each other when one loses its core; try fewer threads "
        "(--threads 1)")
    assert slow_decoding_warning(loaded(2), 32, 1.5) is None  # 21 tokens/s: within 5×
    assert slow_decoding_warning(loaded(1), 32, 64.0) is None  # one thread: nothing to wait for
    assert slow_decoding_warning(SimpleNamespace(), 32, 64.0) is None  # another backend


@needs_llama_cpp
def test_load_time_check_is_timed(tmp_path):
    from tiny_gguf import write_tiny_gguf

    backend = LlamaCppBackend.load(write_tiny_gguf(tiny_model(0), tmp_path / "t.gguf"), threads=1)
    assert 0 < backend.seconds_per_token_at_load < 60


@needs_llama_cpp
@pytest.mark.parametrize("weight_type", ["F32", "Q8_0"])
def test_weights_converted_to_another_type_decode_exactly(tmp_path, monkeypatch, weight_type):
    """F32 of an F32 file is the same model bit for bit; Q8_0 rounds the weights, and the
    converted model is batch-invariant and decodes speculatively as it decodes plainly."""
    from pathlib import Path

    import torch

    from exactspec import PromptLookupProposer, SamplingParams, SpeculativeGenerator
    from exactspec.model_files import converted_gguf
    from tiny_gguf import write_tiny_gguf

    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    path = write_tiny_gguf(tiny_model(0), tmp_path / "tiny.gguf")
    original = LlamaCppBackend.load(path, threads=1)
    converted = LlamaCppBackend.load(path, threads=1, weight_type=weight_type)
    assert converted.description.endswith(f"weights converted to {weight_type}")
    assert converted_gguf(path, weight_type) == Path(converted.llama.model_path)  # cached
    assert converted.batch_invariant
    prompt = converted.tokenizer.encode("abcabcab")
    one(original).prefill(prompt[:-1])
    one(converted).prefill(prompt[:-1])
    same = torch.equal(one(original).forward(prompt[-1:]), one(converted).forward(prompt[-1:]))
    one(converted).release()
    assert same == (weight_type == "F32")
    params = SamplingParams(max_new_tokens=24)
    plain = SpeculativeGenerator(converted, None).generate(prompt, params).token_ids
    drafted = SpeculativeGenerator(converted, PromptLookupProposer(1, 3), 4, "constant")
    assert drafted.generate(prompt, params).token_ids == plain
    with pytest.raises(ValueError, match="weight type 'Q4' is invalid: choose one of F32"):
        LlamaCppBackend.load(path, weight_type="Q4")
