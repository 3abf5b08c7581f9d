"""Batch invariance: a token's logits are bit-identical whether it is scored alone or in a
verification block, so speculative greedy output equals plain decoding bit for bit and
sampling uses exactly plain decoding's p. The broken control is the fast kernels with a
product whose reduction order changes with the number of rows
(:func:`conftest.row_dependent_product`, so that it differs on every machine, where
PyTorch's own kernels differ only on some): it rounds a block unlike a single token, and a
near-tie shows what that does."""

import pytest
import torch

from exactspec import SamplingParams, SpeculativeGenerator
from exactspec.backends import TransformersBackend, UnsupportedModelError
from exactspec.backends.base import check_batch_invariance
from exactspec.proposers.base import Proposal, Proposer

from conftest import CharTokenizer, tiny_model, one

PROMPT = "the cat sat on the mat"


class FixedProposer(Proposer):
    """Drafts ``k`` copies of one token: every cycle scores a block of k + 1 tokens."""

    def propose(self, token_ids, k, pipeline, rng, min_confidence=0.0):
        return Proposal([5] * k)


def backend(kernels: str, seed: int = 0) -> TransformersBackend:
    return TransformersBackend(tiny_model(seed), CharTokenizer(), kernels=kernels)


def first_row_logits(target, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits of the first new position scored alone and as row 0 of a k+1 block."""
    prompt = target.tokenizer.encode(PROMPT)
    one(target).prefill(prompt[:-1])
    single = one(target).forward(prompt[-1:])[0]
    one(target).prefill(prompt[:-1])
    block = one(target).forward(prompt[-1:] + [5] * k)[0]
    return single, block


@pytest.mark.parametrize("seed", range(4))
def test_the_load_check_tells_the_kernels_apart(seed, monkeypatch):
    """The batch-invariant kernels pass it; the fast kernels with a row-dependent product
    (the control: PyTorch's own products differ between row counts on some machines only)
    fail it."""
    from conftest import row_dependent_product

    from exactspec.backends import batch_invariant

    invariant = backend("batch-invariant", seed)
    assert invariant.batch_invariant and check_batch_invariance(invariant, 17).invariant
    assert invariant.sequences_invariant
    monkeypatch.setattr(batch_invariant, "skinny_product", row_dependent_product)
    fast = backend("fast", seed)
    assert not fast.batch_invariant
    assert fast.description.endswith("fast kernels")


def native_paths() -> list:
    """Every instruction-set path of the native kernels this machine runs (none where they
    cannot be built: the fallback's own tests still run)."""
    from exactspec.backends import native

    kernels = native.load()
    if kernels is None:
        return []
    return kernels.paths


@pytest.fixture(params=native_paths() or [pytest.param(None, marks=pytest.mark.skip(
    reason="the native kernels could not be built here (no C compiler?)"))])
def native_path(request):
    """Runs the test on each native path the machine has, then restores the best one."""
    from exactspec.backends import native

    kernels = native.load()
    kernels.isa = request.param
    yield request.param
    kernels.isa = kernels.best_isa


@pytest.mark.parametrize("threads", [1, 2])
def test_native_products_are_bit_identical_for_1_to_16_rows(native_path, threads):
    """Each output row is the same bits whatever the rows beside it, how many there are,
    and how many threads split the columns; shapes of the embedded model's layers, column
    and input counts that leave tails on every path, and a row stride."""
    from exactspec.backends import native

    kernels = native.load()
    generator = torch.Generator().manual_seed(0)
    for out_features, in_features in [(192, 576), (1536, 576), (576, 1536), (101, 37)]:
        weight = torch.randn(out_features, in_features, generator=generator)
        x = torch.randn(16, in_features + 3, generator=generator)[:, :in_features]  # strided
        alone = [kernels.linear(x[i:i + 1], weight, threads=1) for i in range(16)]
        assert torch.allclose(torch.cat(alone), x @ weight.T, atol=1e-3)
        for rows in range(1, 17):
            others = torch.randn(rows, in_features, generator=generator)
            others[-1] = x[rows - 1]  # one known row among random ones
            block = kernels.linear(x[:rows], weight, threads=threads)
            assert torch.equal(block, torch.cat(alone[:rows])), (native_path, rows)
            assert torch.equal(kernels.linear(others, weight, threads=threads)[-1],
                               alone[rows - 1][0])


def test_native_kernels_refuse_arguments_they_would_misread():
    from exactspec.backends import native

    kernels = native.load()
    if kernels is None:
        pytest.skip("the native kernels could not be built here (no C compiler?)")
    weight, x = torch.randn(8, 16), torch.randn(3, 16)
    for out in (torch.empty(16, 3).t(), torch.empty(3, 8, dtype=torch.float64),
                torch.empty(2, 8)):
        with pytest.raises(ValueError):
            kernels.linear(x, weight, out)
    query, keys, out = torch.randn(2, 3, 8), torch.randn(1, 6, 8), torch.empty(3, 2, 8)
    with pytest.raises(ValueError, match="key and value"):
        kernels.attention(query, keys, torch.randn(1, 3, 8), 0.3, out)  # fewer values
    with pytest.raises(ValueError, match="key and value"):
        kernels.attention(query, torch.randn(1, 6, 4), torch.randn(1, 6, 4), 0.3, out)
    kernels.attention(query, keys, torch.randn(1, 6, 8), 0.3, out)  # fits


def test_native_paths_avx2_and_portable_give_the_same_bits():
    """Both sum 8 lanes the same way with fused multiply-adds (the AVX-512 path sums 16)."""
    from exactspec.backends import native

    paths = native_paths()
    if "avx2" not in paths:
        pytest.skip("this CPU has no AVX2 + FMA")
    kernels = native.load()
    generator = torch.Generator().manual_seed(1)
    weight, x = torch.randn(200, 300, generator=generator), torch.randn(5, 300, generator=generator)
    outputs = []
    for isa in ("avx2", "portable"):
        kernels.isa = isa
        outputs.append(kernels.linear(x, weight))
    kernels.isa = kernels.best_isa
    assert torch.equal(*outputs)


def test_native_kernels_decode_a_model_exactly_on_every_path(native_path):
    """Greedy speculative and batched output equal plain decoding on the same path, and the
    load-time check passes on it."""
    from exactspec import BatchedGenerator, PromptLookupProposer

    target = backend("batch-invariant")
    assert target.batch_invariant and check_batch_invariance(target, 17).invariant
    prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5], [7] * 6, [9, 3, 9, 3, 9]]
    params = SamplingParams(max_new_tokens=20)
    plain = [SpeculativeGenerator(target, None).generate(p, params).token_ids for p in prompts]
    generator = SpeculativeGenerator(target, PromptLookupProposer(1, 3), 5, "constant")
    assert [generator.generate(p, params).token_ids for p in prompts] == plain
    assert [r.token_ids for r in BatchedGenerator(generator, 4).generate(prompts, params)] == plain
    single, block = first_row_logits(target, 15)
    assert torch.equal(single, block)


def test_without_native_kernels_the_2_row_fallback_is_batch_invariant(monkeypatch):
    """Where the kernels cannot be built, PyTorch's products on fixed 2-row blocks keep
    the backend exact (and it says so)."""
    from exactspec.backends import batch_invariant

    monkeypatch.setattr(batch_invariant, "native_kernels_apply", lambda weight: False)
    from exactspec.backends import transformers_backend

    monkeypatch.setattr(transformers_backend, "native_kernels_apply", lambda weight: False)
    target = backend("batch-invariant")
    assert target.description.endswith("PyTorch 2-row kernels")
    assert target.batch_invariant and check_batch_invariance(target, 17).invariant
    single, block = first_row_logits(target, 6)
    assert torch.equal(single, block)


def flipping_bias(single: torch.Tensor, block: torch.Tensor) -> tuple[int, int, dict]:
    """Two tokens ``a < b`` and a logit bias (float32 values, as the logits pipeline adds
    them) under which ``single``'s argmax is ``a`` and ``block``'s is ``b``: the bias sets
    both to exactly 0 in ``single`` (x + (−x) is exact), a tie that argmax breaks to the
    lower index, while in ``block`` they become ``block − single`` of each (exact too, the
    two within a factor 2: Sterbenz), so ``b`` comes first wherever the block's rounding
    raised it more than ``a``; every other token is pushed 100 below. Such a pair exists
    wherever the block rounds some token differently from another, unless those
    differences fall with the token index all the way (then this fails)."""
    gain = block - single
    for b in gain.argsort(descending=True).tolist():
        lower = [a for a in range(b) if gain[a] < gain[b]]
        if lower:
            a = lower[0]
            bias = {t: -100.0 for t in range(single.shape[0])}
            bias[a], bias[b] = -float(single[a]), -float(single[b])
            return a, b, bias
    pytest.fail("the block rounds like a single token: no near-tie flips")


@pytest.mark.parametrize("k", [1, 4, 7, 8, 12])
def test_near_tie_flips_on_a_row_dependent_product_and_never_on_the_batch_invariant_kernels(
        k, row_dependent_fast_kernels):
    """A logit bias turns two tokens into a tie that the row-dependent product's two roundings
    break apart (:func:`flipping_bias`): there plain decoding picks one token and
    verification the other. On the batch-invariant kernels the two roundings are one, so no
    bias, even one an ulp from a tie, tells them apart."""
    target = backend("fast")
    assert not target.batch_invariant  # the load check catches the control
    first, second, bias = flipping_bias(*first_row_logits(target, k))
    params = SamplingParams(temperature=0, max_new_tokens=k + 1, logit_bias=bias)
    plain = SpeculativeGenerator(target, None).generate(PROMPT, params).token_ids
    speculative = SpeculativeGenerator(target, FixedProposer(), k, "constant",
                                       allow_batch_variance=True).generate(PROMPT, params)
    assert plain[0] == first and speculative.token_ids[0] == second  # the control flips

    target = backend("batch-invariant")
    single, block = first_row_logits(target, k)
    assert torch.equal(single, block)
    best = int(single.argmax())
    for rival in torch.topk(single, 6).indices.tolist()[1:]:  # the closest ties one can make
        gap = float(single[best] - single[rival])
        for bias in (torch.nextafter(torch.tensor(gap), torch.tensor(0.0)).item(), gap):
            params = SamplingParams(temperature=0, max_new_tokens=2 * k + 2,
                                    logit_bias={rival: bias})
            plain = SpeculativeGenerator(target, None).generate(PROMPT, params).token_ids
            speculative = SpeculativeGenerator(target, FixedProposer(), k, "constant")
            assert speculative.generate(PROMPT, params).token_ids == plain


def test_sampling_probabilities_are_bit_identical_in_a_block():
    from exactspec.logits_pipeline import logits_to_probs

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=20)
    single, block = first_row_logits(backend("batch-invariant"), 6)
    assert torch.equal(logits_to_probs(single[None], params), logits_to_probs(block[None], params))


def test_a_backend_that_is_not_batch_invariant_is_refused_unless_allowed(
        row_dependent_fast_kernels):
    target = backend("fast")
    with pytest.raises(UnsupportedModelError,
                       match=r"transformers float32 cpu, fast kernels\) scores a block of tokens "
                             r"differently .* speculation is refused\. These are the fast kernels: "
                             r"load the model with kernels='batch-invariant'"):
        SpeculativeGenerator(target, FixedProposer(), 4)
    SpeculativeGenerator(target, None)  # plain decoding needs no invariance
    SpeculativeGenerator(target, FixedProposer(), 4, allow_batch_variance=True)
    with pytest.raises(ValueError, match="kernels 'quick' is invalid: choose one of "
                                         "batch-invariant, fast"):
        TransformersBackend(tiny_model(0), CharTokenizer(), kernels="quick")


def test_the_native_kernels_build_wherever_a_c_compiler_is_found():
    """The kernels' tests skip where the kernels cannot be built; so that a C source that no
    longer compiles cannot pass as 'no compiler here', a machine with one must build them."""
    import os
    import shutil

    from exactspec.backends import native

    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler on this machine")
    if os.environ.get("EXACTSPEC_NATIVE_KERNELS", "1") == "0":
        pytest.skip("the native kernels are switched off (EXACTSPEC_NATIVE_KERNELS=0)")
    assert native.load() is not None


def test_the_kernels_build_hashes_every_source_and_names_a_compile_error(tmp_path, monkeypatch):
    """One library per version of all the files (the header too); a file that does not
    compile is the compiler's error line, not a bare exit status."""
    import shutil
    import subprocess

    from exactspec.backends import native

    if not shutil.which("cc") and not shutil.which("gcc"):
        pytest.skip("no C compiler on this machine")
    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path / "cache"))
    header, source = tmp_path / "kernels.h", tmp_path / "one.c"
    header.write_text("#define VALUE 1\n")
    source.write_text('#include "kernels.h"\nint es_value(void) { return VALUE; }\n')
    monkeypatch.setattr(native, "HEADER", header)
    monkeypatch.setattr(native, "SOURCES", (source,))
    first = native._compile()
    assert native._compile() == first  # built once
    header.write_text("#define VALUE 2\n")
    second = native._compile()
    assert second != first and first.exists() and second.exists()
    source.write_text("int es_value(void) { return nothing; }\n")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        native._compile()
    assert "one.c" in native._last_line(failed.value)
    assert "error" in native._last_line(failed.value)


def test_scratch_memory_that_cannot_be_allocated_is_a_memory_error():
    """The entry points with scratch memory return -1 when it cannot be had, before
    touching any tensor (here: attention over 2^50 keys), and Python raises."""
    from exactspec.backends import native

    kernels = native.load()
    if kernels is None:
        pytest.skip("the native kernels cannot be built here")
    with pytest.raises(MemoryError, match="es_attention: the kernels' scratch memory"):
        kernels._lib.es_attention(None, 1, 2, 64, 128, 64, None, None, 1, 2 ** 50, 0, 64, 0,
                                  64, 0.125, None, 128, 64, 1, 0, None, None)
