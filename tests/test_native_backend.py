"""The native backend's own checks: GGUF blocks dequantised exactly, products that do not
depend on the rows or the path (fused tiles, panel, instruction sets), a forward that is the
transformers model's up to float rounding, and clear refusals. (The Backend contract, greedy
identity and sampling exactness run on it through ``make_backend`` in the other files.)"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from conftest import CharTokenizer, tiny_backend, tiny_model
from exactspec.backends import native
from exactspec.backends.base import UnsupportedModelError, forward_one

gguf = pytest.importorskip("gguf")
KERNELS = native.load()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the native kernels cannot be built")

@pytest.fixture
def isa_path(request):
    """Run the test body on one instruction-set path, restoring the best afterwards."""
    best = KERNELS.isa
    yield
    KERNELS.isa = best


BLOCKS = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
          "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)), "Q4_K": (256, 144, (0, 2)),
          "Q5_K": (256, 176, (0, 2)), "Q6_K": (256, 210, (208,))}
"""Block types: weights per block, bytes per block, where its float16 scales sit."""
NO_QUANTISER = ("Q4_K", "Q5_K", "Q6_K")
"""Types gguf-py dequantises but cannot quantise: random blocks instead."""


TYPES = ["F32", "F16", "BF16", *BLOCKS]


def quantised(weight_type: str, rows: int = 52, cols: int = 96, seed: int = 0):
    """A random ``[rows, cols]`` matrix in ``weight_type``'s blocks (gguf-py's quantiser, or
    for the K types random bytes with scales drawn in [0.001, 0.05]) and gguf-py's float32
    dequantisation of it."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[weight_type]
    if weight_type in NO_QUANTISER:
        size, nbytes, halves = BLOCKS[weight_type]
        raw = rng.integers(0, 256, (rows, cols // size, nbytes), dtype=np.uint8)
        for at in halves:
            scales = rng.uniform(0.001, 0.05, (rows, cols // size)).astype(np.float16)
            raw[:, :, at:at + 2] = scales.view(np.uint8).reshape(rows, cols // size, 2)
        blocks = raw.reshape(rows, -1)
    else:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        blocks = gguf.quants.quantize(values, qtype)
    return np.ascontiguousarray(blocks), gguf.quants.dequantize(blocks, qtype).astype(np.float32)


def shape_for(weight_type: str) -> tuple[int, int]:
    """52 columns (a partial group of 16) and K: 3 blocks, or 2 super-blocks of 256."""
    return 52, 512 if BLOCKS[weight_type][0] == 256 else 96


def available_isas() -> list[str]:
    return list(KERNELS.paths)


@pytest.mark.parametrize("weight_type", TYPES)
def test_block_products_equal_float32_products_of_the_reference_dequantisation(weight_type,
                                                                              isa_path):
    """Dequantising is exact (or, for Q4_1, one rounding as gguf-py's): the product over the
    blocks is bit for bit the float32 kernel's over gguf-py's dequantised matrix, on every
    path, for 1..9 rows."""
    blocks, reference = quantised(weight_type, *(shape_for(weight_type) if weight_type in BLOCKS
                                                 else (52, 96)))
    x = torch.randn(9, reference.shape[1])
    for isa in available_isas():
        KERNELS.isa = isa
        expected = KERNELS.linear(x, torch.from_numpy(reference))
        got = KERNELS.linear_typed(x, blocks, native.WEIGHT_TYPES[weight_type], reference.shape[0])
        assert torch.equal(got, expected), (weight_type, isa)


@pytest.mark.parametrize("weight_type", ["Q8_0", "Q4_0", "Q4_1", "F16", "BF16"])
def test_fused_tiles_and_the_panel_give_the_same_bits_for_every_row_count(weight_type):
    blocks, reference = quantised(weight_type, rows=100, cols=128)
    fused_rows = ctypes.c_int.in_dll(KERNELS._lib, "es_fused_rows")
    x = torch.randn(16, 128)
    default = fused_rows.value
    try:
        fused_rows.value = 0  # the panel only
        panel = KERNELS.linear_typed(x, blocks, native.WEIGHT_TYPES[weight_type], 100, threads=2)
        fused_rows.value = default
        for rows in range(1, 17):
            alone = KERNELS.linear_typed(x[:rows].contiguous(), blocks,
                                         native.WEIGHT_TYPES[weight_type], 100, threads=1)
            assert torch.equal(alone, panel[:rows]), rows
    finally:
        fused_rows.value = default


def test_a_broken_dequantisation_is_caught():
    """Control: the comparison above fails for a matrix that differs in one block."""
    blocks, reference = quantised("Q4_1")
    x = torch.randn(3, reference.shape[1])
    broken = reference.copy()
    broken[0, :32] += np.float32(1e-3)
    assert not torch.equal(KERNELS.linear_typed(x, blocks, native.WEIGHT_TYPES["Q4_1"], 52),
                           KERNELS.linear(x, torch.from_numpy(broken)))


def fma32(a, b, c):
    """float32 fma(a, b, c): the product exact in float64 (24 + 24 bits), the sum rounded
    once there and once to float32 (which agree but at ties of 2^-29 odds; fixed seeds)."""
    return np.float32(np.float64(a) * np.float64(b) + np.float64(c))


def unsigned_weights(blocks: np.ndarray, weight_type: str, n: int, k: int):
    """The blocks decoded (ggml-common.h's bit layouts, in numpy): per output j and block b
    of 32, the unsigned integers u [n, k / 32, 32] and what scales them: d, m (or dmin) and,
    for the K types, the sub-block's scales (Q6_K: two per block of 32, one per 16) and
    mins. w = (u - offset) d, u d + m, d sc u - dmin mn or d sc (u - 32) by type."""
    size, nbytes, _ = BLOCKS[weight_type]
    raw = blocks.reshape(n, k // size, nbytes).view(np.uint8)
    half = lambda at: raw[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)
    per_block = lambda a: np.repeat(a, size // 32, axis=1)  # one value a super-block
    sc = mn = np.zeros((n, k // 32), np.int64)
    if weight_type == "Q8_0":
        u, d, m = raw[..., 2:].view(np.int8).astype(np.int64) + 128, half(0), 0 * half(0)
    elif weight_type in ("Q4_0", "Q4_1"):
        nib = raw[..., 4:] if weight_type == "Q4_1" else raw[..., 2:]
        u = np.concatenate([nib & 15, nib >> 4], axis=-1).astype(np.int64)
        d, m = half(0), half(2) if weight_type == "Q4_1" else 0 * half(0)
    elif weight_type in ("Q5_0", "Q5_1"):
        at = 4 if weight_type == "Q5_1" else 2
        qh = raw[..., at:at + 4].copy().view(np.uint32)[..., 0].astype(np.int64)
        nib = raw[..., at + 4:].astype(np.int64)
        high = (qh[..., None] >> np.arange(32)) & 1
        u = np.concatenate([nib & 15, nib >> 4], axis=-1) | high << 4
        d, m = half(0), half(2) if weight_type == "Q5_1" else 0 * half(0)
    elif weight_type in ("Q4_K", "Q5_K"):
        q = raw[..., 4:16].astype(np.int64)
        sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 15) | (q[..., 0:4] >> 6) << 4], -1)
        mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | (q[..., 4:8] >> 6) << 4], -1)
        qs = raw[..., 48:] if weight_type == "Q5_K" else raw[..., 16:]
        chunks = qs.reshape(n, -1, 4, 32).astype(np.int64)  # 4 chunks of 64 weights
        u = np.stack([chunks & 15, chunks >> 4], axis=3)  # [n, sb, chunk, low/high, 32]
        if weight_type == "Q5_K":
            qh = raw[..., 16:48].astype(np.int64)  # bit 2c (low) / 2c + 1 (high) of qh[l]
            bits = (qh[:, :, None, None, :] >> (2 * np.arange(4)[:, None] + np.arange(2))[..., None]) & 1
            u = u | bits << 4
        sc, mn, d, m = sc.reshape(n, -1), mn.reshape(n, -1), per_block(half(0)), per_block(half(2))
    else:  # Q6_K
        ql = raw[..., :128].reshape(n, -1, 2, 2, 32).astype(np.int64)  # [.., half, l/l+32, 32]
        qh = raw[..., 128:192].reshape(n, -1, 2, 1, 32).astype(np.int64)
        low = np.concatenate([ql & 15, ql >> 4], axis=3)  # quarters of 32: a&15, b&15, a>>4, b>>4
        high = (qh >> (2 * np.arange(4))[:, None]) & 3
        u = low | high << 4
        sc = raw[..., 192:208].view(np.int8).astype(np.int64).reshape(n, -1, 2)
        d, m = per_block(half(208)), 0 * per_block(half(208))
    return u.reshape(n, k // 32, 32), d, m, sc, mn


def int8_reference(x: np.ndarray, blocks: np.ndarray, weight_type: str, n: int,
                   rounding=np.rint) -> np.ndarray:
    """The C header's int8 product, step by step in numpy (the quantised inputs, exact
    integer dot products per block, then each output's float32 sequence)."""
    rows, k = x.shape
    nb = k // 32
    u, d, m, sc, mn = unsigned_weights(blocks, weight_type, n, k)
    offset = {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}.get(weight_type, 0)
    out = np.zeros((rows, n), np.float32)
    for r in range(rows):
        xb = x[r].reshape(nb, 32)
        amax = np.abs(xb).max(axis=1)
        dx = (amax / np.float32(127)).astype(np.float32)
        inv = np.where(dx != 0, np.float32(1) / np.where(dx != 0, dx, 1), 0).astype(np.float32)
        xq = rounding((xb * inv[:, None]).astype(np.float32)).astype(np.int64)
        sx, sxa = xq.sum(axis=1), xq[:, :16].sum(axis=1)
        dxs = (dx * sx.astype(np.float32)).astype(np.float32)
        for j in range(n):
            acc = np.float32(0)
            for b in range(nb):
                products = u[j, b] * xq[b]
                if weight_type == "Q6_K":
                    i = (sc[j, b, 0] * (products[:16].sum() - 32 * sxa[b])
                         + sc[j, b, 1] * (products[16:].sum() - 32 * (sx[b] - sxa[b])))
                    acc = fma32(np.float32(i), np.float32(d[j, b] * dx[b]), acc)
                elif weight_type in ("Q4_K", "Q5_K"):
                    scale = np.float32(d[j, b] * np.float32(sc[j, b]))
                    acc = fma32(np.float32(products.sum()), np.float32(scale * dx[b]), acc)
                    acc = fma32(-np.float32(m[j, b] * np.float32(mn[j, b])), dxs[b], acc)
                else:
                    i = int(products.sum()) - offset * int(sx[b])
                    acc = fma32(np.float32(i), np.float32(d[j, b] * dx[b]), acc)
                    if weight_type in ("Q4_1", "Q5_1"):
                        acc = fma32(m[j, b], dxs[b], acc)
            out[r, j] = acc
    return out


def test_the_replays_decoding_is_gguf_pys():
    """The replay's own decoding (above) gives gguf-py's dequantised weights, for every
    block type, so the replay below checks the C code against an independent reading."""
    for weight_type in BLOCKS:
        n, k = shape_for(weight_type)
        blocks, reference = quantised(weight_type, n, k)
        u, d, m, sc, mn = unsigned_weights(blocks, weight_type, n, k)
        u, d, m = u.astype(np.float64), d[..., None], m[..., None]
        if weight_type == "Q6_K":
            w = d * np.repeat(sc, 16, axis=-1) * (u - 32)
        elif weight_type in ("Q4_K", "Q5_K"):
            w = d * sc[..., None] * u - m * mn[..., None]
        else:
            w = (u - {"Q4_0": 8, "Q5_0": 16, "Q8_0": 128}.get(weight_type, 0)) * d + m
        # w is exact in float64; gguf-py rounds at most once to float32 (the subtraction or
        # addition of m): within half an ulp, 2^-24 |w|
        assert np.allclose(w.reshape(n, k), reference, rtol=2.0 ** -23, atol=0), weight_type


def stated_q4_0(x: np.ndarray) -> np.ndarray:
    """blocks.c's re-quantisation to Q4_0 in numpy, float32 throughout: per block of 32 the
    value a of largest magnitude (the first of equals; +0 for an all-zero block), d =
    half(a / -8), u = clamp(floor(x / d + 8.5), 0, 15) (8 where d = 0)."""
    rows = x.shape[0]
    blocks = x.reshape(rows, -1, 32).astype(np.float32)
    first = np.abs(blocks).argmax(-1)[..., None]
    a = np.take_along_axis(blocks, first, -1)[..., 0]
    a = np.where(np.abs(a) > 0, a, np.float32(0.0))
    d = np.clip(a / np.float32(-8.0), -65504, 65504).astype(np.float16)
    dh = d.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        u = np.floor(blocks / dh + np.float32(8.5))
    u = np.where(dh == 0, 8, np.clip(u, 0, 15)).astype(np.uint8)
    nibbles = u[..., :16] | (u[..., 16:] << 4)
    return np.concatenate([d[..., None].view(np.uint8), nibbles], -1).reshape(rows, -1)


@pytest.mark.parametrize("weight_type", TYPES)
def test_requantised_q4_0_is_the_stated_arithmetic_within_one_step_of_the_input(weight_type):
    """es_quantize_q4_0 from every type gives blocks.c's bytes (stated_q4_0 of the
    dequantised input; an all-zero block from the float types), and each weight read back is within its block's |d| of the input:
    u = floor(x / d + 8.5) is the nearest step except where it clamps at 15, x / d = 8 (the
    block's extreme itself, off by one step), and d's rounding to half moves x / d by at most
    8 * 2^-11 of a step."""
    rows, cols = shape_for(weight_type) if weight_type in BLOCKS else (52, 96)
    if weight_type in BLOCKS:
        raw, floats = quantised(weight_type, rows, cols)
    else:
        qtype = gguf.GGMLQuantizationType[weight_type]
        floats = np.random.default_rng(1).standard_normal((rows, cols)).astype(np.float32)
        floats[3, :32] = 0.0  # an all-zero block: d = 0, every u = 8
        raw = floats if weight_type == "F32" else gguf.quants.quantize(floats, qtype)
        floats = gguf.quants.dequantize(raw, qtype).astype(np.float32)
    got = KERNELS.quantize_q4_0(np.ascontiguousarray(raw), native.WEIGHT_TYPES[weight_type],
                                rows, cols)
    assert np.array_equal(got, stated_q4_0(floats))
    back = gguf.quants.dequantize(got, gguf.GGMLQuantizationType.Q4_0).reshape(rows, -1, 32)
    steps = np.abs(got.reshape(rows, -1, 18)[..., :2].copy().view(np.float16).astype(np.float32))
    error = np.abs(back - floats.reshape(rows, -1, 32))
    assert (error <= steps * (1 + 2.0 ** -8)).all()
    with pytest.raises(ValueError, match="multiple of 32"):
        KERNELS.quantize_q4_0(np.zeros((2, 40), np.float32), 0, 2, 40)


def test_requantised_scales_are_halves_rounded_to_nearest_even_in_every_range():
    """The Q4_0 scale d = half(a / -8) (blocks.c's own float -> half conversion) is numpy's
    round-to-nearest-even float16 across every range: subnormal halves, the underflow to
    zero, normals, exact ties either way, and the clamp at the largest finite half."""
    rng = np.random.default_rng(2)
    maxima = np.concatenate([
        2.0 ** rng.uniform(-30, 19, 400),  # d from underflow through subnormal to clamped
        8 * np.array([1 + 2.0 ** -11, 1 + 3 * 2.0 ** -11, 2.0 ** -24, 1.5 * 2.0 ** -24,
                      2.0 ** -25, 65504.0, 65520.0, 6.1e-5])])  # ties, the smallest halves
    blocks = rng.uniform(-1, 1, (len(maxima), 32)).astype(np.float32)
    blocks[:, 5] = 1.0  # the block's largest magnitude, scaled to its maximum (sign kept)
    blocks *= (maxima * rng.choice([-1, 1], len(maxima)))[:, None].astype(np.float32)
    got = KERNELS.quantize_q4_0(np.ascontiguousarray(blocks), native.WEIGHT_TYPES["F32"],
                                len(maxima), 32)
    assert np.array_equal(got, stated_q4_0(blocks))


@pytest.mark.parametrize("weight_type", native.INT8_TYPES)
def test_int8_products_are_the_stated_arithmetic_with_the_same_bits_everywhere(weight_type,
                                                                            isa_path):
    """The int8-activation product (the native forward's over every block type) is the C
    header's arithmetic bit for bit (a numpy replay), the same bits on every instruction-set
    path, for 1..16 rows alone or together, 1 or 2 threads, and 52 columns (a partial group
    of 16); a replay that rounds toward zero instead of to nearest even is caught."""
    n, k = shape_for(weight_type)
    blocks, _ = quantised(weight_type, n, k)
    number = native.WEIGHT_TYPES[weight_type]
    packed = KERNELS.repack(blocks, number, n, k)
    x = torch.randn(16, k)
    expected = int8_reference(x.numpy(), blocks, weight_type, 52)
    for isa in available_isas():
        KERNELS.isa = isa
        together = KERNELS.linear_int8(x, packed, number, 52, threads=2)
        assert np.array_equal(together.numpy(), expected), isa
        for rows in range(1, 17):
            alone = KERNELS.linear_int8(x[:rows].contiguous(), packed, number, 52)
            assert torch.equal(alone, together[:rows]), (isa, rows)
    truncated = int8_reference(x[:2].numpy(), blocks, weight_type, 52, rounding=np.trunc)
    assert not np.array_equal(truncated, expected[:2])


def test_a_type_without_an_int8_product_is_refused():
    blocks, _ = quantised("F16")
    with pytest.raises(ValueError, match="has no int8 product"):
        KERNELS.repack(blocks, native.WEIGHT_TYPES["F16"], 52, 96)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from tiny_gguf import write_tiny_gguf

    return write_tiny_gguf(tiny_model(5), tmp_path_factory.mktemp("native") / "tiny.gguf")


def native_backend(path, **options):
    from exactspec.backends.native_backend import GGUFModel, NativeBackend

    return NativeBackend(GGUFModel(path), CharTokenizer(), **options)


def test_the_forward_is_the_transformers_model_up_to_rounding(tiny_gguf):
    ours, theirs = native_backend(tiny_gguf), tiny_backend(5)
    tokens = [3, 14, 15, 9, 2, 6, 5, 3, 5]
    for backend in (ours, theirs):
        backend.prefill(1, tokens[:4])
    a, b = forward_one(ours, 1, tokens[4:]), forward_one(theirs, 1, tokens[4:])
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    assert ours.batch_invariant and ours.sequences_invariant


def test_every_path_gives_the_same_forward_bits(tiny_gguf, isa_path):
    """AVX2 and portable agree bit for bit (AVX-512 sums products in 16 lanes: its own bits,
    batch-invariant on its own)."""
    results = {}
    for isa in available_isas():
        KERNELS.isa = isa
        backend = native_backend(tiny_gguf)
        assert backend.batch_invariant and backend.sequences_invariant, isa
        backend.prefill(1, [1, 2, 3])
        results[isa] = forward_one(backend, 1, [4, 5, 6, 7])
    if "avx2" in results:
        assert torch.equal(results["avx2"], results["portable"])


def test_int8_activations_give_the_same_forward_bits_on_every_path(tiny_gguf, tmp_path,
                                                                   monkeypatch, isa_path):
    """Over block weights the forward takes int8 activations by default: batch-invariant,
    the same bits on every instruction-set path (AVX-512 included: its lanes hold output
    columns), close to the float32-activation forward (which differs: the inputs' rounding)."""
    from exactspec.backends.native_backend import GGUFModel
    from exactspec.model_files import converted_gguf

    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path))
    path = converted_gguf(tiny_gguf, "Q8_0")  # the Q4 products: the test above
    results = {}
    for isa in available_isas():
        KERNELS.isa = isa
        backend = native_backend(path)
        assert "int8 activations" in backend.description
        assert backend.batch_invariant and backend.sequences_invariant, isa
        backend.prefill(1, [1, 2, 3])
        results[isa] = forward_one(backend, 1, [4, 5, 6, 7])
    assert all(torch.equal(r, results["portable"]) for r in results.values()), list(results)
    from exactspec.backends.native_backend import NativeBackend

    floats = NativeBackend(GGUFModel(path, activations="float32"), CharTokenizer())
    assert "int8" not in floats.description
    floats.prefill(1, [1, 2, 3])
    reference = forward_one(floats, 1, [4, 5, 6, 7])
    got = results["portable"]
    assert not torch.equal(got, reference)
    assert torch.allclose(got, reference, atol=0.05 * float(reference.abs().max()))
    with pytest.raises(ValueError, match="activations = 'int4' is invalid"):
        GGUFModel(path, activations="int4")
    from exactspec import models

    asked = {}
    monkeypatch.setattr(models.NativeBackend, "load", lambda path, **options: asked.update(options))
    models.ModelSpec(str(path), backend="native", activations="float32").load()
    assert asked["activations"] == "float32"  # load_model passes it on


@pytest.mark.parametrize("weight_type", ["F16", "BF16", "Q8_0"])
def test_converted_weights_run_batch_invariant_and_close_to_float32(tiny_gguf, weight_type,
                                                                     tmp_path, monkeypatch):
    from exactspec.model_files import converted_gguf

    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path))
    backend = native_backend(converted_gguf(tiny_gguf, weight_type))
    assert backend.model.weight_types.get(weight_type, 0) > 0
    assert backend.batch_invariant and backend.sequences_invariant
    reference = native_backend(tiny_gguf)
    for b in (backend, reference):
        b.prefill(1, [1, 2, 3])
    got, expected = forward_one(backend, 1, [4, 5]), forward_one(reference, 1, [4, 5])
    assert not torch.equal(got, expected) or weight_type == "F32"
    assert torch.allclose(got, expected, atol=0.1 * float(expected.abs().max()))


def test_weights_converted_to_q4_0_are_the_stated_blocks_and_run_batch_invariant(
        tiny_gguf, tmp_path, monkeypatch):
    """converted_gguf(…, "Q4_0") (a cheaper draft model) writes every 2-D weight as
    es_quantize_q4_0 of the source's floats (stated_q4_0), keeps the vectors, and the native
    backend runs the file batch-invariant. (Its logits are not compared with float32's: 4-bit
    weights of a random tiny model move them by more than any bound worth stating; only the
    draft's acceptance depends on them.)"""
    from exactspec.backends.native_backend import converted
    from exactspec.model_files import converted_gguf

    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path))
    with pytest.raises(ValueError, match="needs exactspec's quantiser"):
        converted_gguf(tiny_gguf, "Q4_0")  # gguf-py has no Q4_0 quantiser of ours
    path = converted(tiny_gguf, "Q4_0")
    source = {t.name: t for t in gguf.GGUFReader(tiny_gguf).tensors}
    converted = gguf.GGUFReader(path).tensors
    assert {t.name for t in converted} == set(source)
    for tensor in converted:
        floats = gguf.quants.dequantize(source[tensor.name].data,
                                        source[tensor.name].tensor_type).astype(np.float32)
        if floats.ndim < 2:
            assert tensor.tensor_type.name == "F32" and np.array_equal(tensor.data, floats)
        else:
            assert tensor.tensor_type.name == "Q4_0"
            assert np.array_equal(tensor.data.reshape(floats.shape[0], -1), stated_q4_0(floats))
    backend = native_backend(path)
    assert set(backend.model.weight_types) == {"F32", "Q4_0"}
    assert backend.batch_invariant and backend.sequences_invariant


@pytest.mark.parametrize("weight_type", [None, "Q8_0", "F16"])
def test_restricted_logits_are_those_columns_of_the_whole_vocabulary_bit_for_bit(
        tiny_gguf, weight_type, tmp_path, monkeypatch, isa_path):
    """A draft vocabulary's logits are its tokens' columns of the whole vocabulary's, bit for
    bit, for one row and a block, on every path and over the float32 and int8 products."""
    from exactspec.model_files import converted_gguf

    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path))
    path = tiny_gguf if weight_type is None else converted_gguf(tiny_gguf, weight_type)
    ids = [0, 2, 3, 17, 40, 63]
    for isa in available_isas():
        KERNELS.isa = isa
        whole, restricted = native_backend(path), native_backend(path)
        restricted.restrict_logits(ids)
        assert restricted.vocab_size == len(ids) and whole.vocab_size == 64
        for backend in (whole, restricted):
            backend.prefill(1, [1, 2, 3])
        for block in ([4], [5, 6, 7]):
            expected = forward_one(whole, 1, block)[:, ids]
            got = forward_one(restricted, 1, block)
            assert got.shape == (len(block), len(ids)) and torch.equal(got, expected), isa
        forward_one(restricted, 1, [63])  # the tokens in still range over the whole vocabulary
    for bad in ([], [1, 1], [64], [-1]):
        with pytest.raises(ValueError, match="distinct token ids in \\[0, 64\\)"):
            native_backend(tiny_gguf).restrict_logits(bad)


def test_trees_score_each_node_as_its_path(tiny_gguf):
    backend = native_backend(tiny_gguf)
    backend.prefill(1, [1, 2])
    tree = backend.forward_tree(1, [7, 8, 9, 10], [-1, 0, 0, 2])
    backend.retain(1, 4, [0, 2, 3])
    backend.prefill(2, [1, 2])
    chain = forward_one(backend, 2, [7, 9, 10])
    assert torch.equal(tree[[0, 2, 3]], chain)
    assert backend.num_cached_tokens(1) == backend.num_cached_tokens(2) == 5
    assert torch.equal(forward_one(backend, 1, [11]), forward_one(backend, 2, [11]))


def test_packed_trees_score_each_row_as_alone(tiny_gguf):
    """forward_trees: a chain and two trees of three sequences in one forward, each row's
    logits and cache the same bits as its own forward or forward_tree."""
    packed, alone = native_backend(tiny_gguf), native_backend(tiny_gguf)
    rows = [(1, [7, 8, 9, 10], [-1, 0, 0, 2]), (2, [3, 4], None), (3, [5, 6, 7], [-1, 0, 0])]
    for backend in (packed, alone):
        for sequence_id, _, _ in rows:
            backend.prefill(sequence_id, [1, 2, sequence_id])
    together = packed.forward_trees(rows)
    for (sequence_id, token_ids, parents), logits in zip(rows, together):
        expected = (forward_one(alone, sequence_id, token_ids) if parents is None
                    else alone.forward_tree(sequence_id, token_ids, parents))
        assert torch.equal(logits, expected), sequence_id
    packed.retain(1, 4, [0, 2, 3])
    alone.retain(1, 4, [0, 2, 3])
    assert torch.equal(forward_one(packed, 1, [11]), forward_one(alone, 1, [11]))
    with pytest.raises(ValueError, match="at most once"):
        packed.forward_trees([(2, [1], None), (2, [1, 2], [-1, 0])])


def test_hidden_features_are_the_layer_outputs_of_the_cached_positions(tiny_gguf):
    """As the transformers backend records them (the decoder layers' outputs), up to
    rounding, after a prefill, a block and a rollback."""
    backend, reference = native_backend(tiny_gguf), tiny_backend(5)
    features = []
    for b in (backend, reference):
        b.record_hidden_features([0, 1])
        b.prefill(1, [1, 2, 3])
        forward_one(b, 1, [4, 5])
        b.rollback(1, 1)
        features.append(b.hidden_features(1, 1))
    assert features[0].shape == (3, 2 * backend.model.n_embd)
    assert torch.allclose(features[0], features[1], atol=1e-4)
    with pytest.raises(ValueError, match="cannot record"):
        backend.record_hidden_features([1])


def test_a_draft_head_drafts_on_the_native_backend(tiny_head_file, tmp_path):
    """The head trained on the transformers backend's features of tiny_model(0) reads the
    native backend's: the target's tensors are the same values (so the same shipped head
    is found), and chain and tree drafts are verified exactly (greedy: plain decoding's
    tokens), accepted at the first and second positions as often as on transformers (the
    F32 file's features agree to rounding)."""
    from tiny_gguf import write_tiny_gguf

    from exactspec.draft_head.model import target_fingerprint
    from exactspec.generator import SpeculativeGenerator
    from exactspec.proposers.head import HeadProposer
    from exactspec.sampling import SamplingParams

    target, reference = (native_backend(write_tiny_gguf(tiny_model(0), tmp_path / "t.gguf")),
                         tiny_backend(0))
    ours, theirs = target.target_tensors(), reference.target_tensors()
    for got, expected in zip(ours, theirs):
        assert torch.equal(torch.as_tensor(got), torch.as_tensor(expected))
    assert target_fingerprint(ours.lm_head_weight) == target_fingerprint(theirs.lm_head_weight)
    greedy = SamplingParams(max_new_tokens=40)
    for tree in (None, 16):
        accepted = {}
        for backend in (target, reference):
            generator = SpeculativeGenerator(
                backend, HeadProposer(backend, tiny_head_file, tree_nodes=tree), 3, "constant")
            counts = []
            for prompt in ([5, 9, 3, 7, 5, 9, 3], [9, 9, 8], [1, 2, 3, 4, 5]):
                result = generator.generate(prompt, greedy)
                if backend is target:
                    plain = SpeculativeGenerator(target, None).generate(prompt, greedy)
                    assert result.token_ids == plain.token_ids, tree
                sampled = generator.generate(prompt, SamplingParams(temperature=1.0, seed=3,
                                                                    max_new_tokens=40))
                counts += [result.stats.accepted_per_position,
                           sampled.stats.accepted_per_position]
            accepted[backend.name] = [sum(column) for column in zip(*counts)]
        assert accepted["native"] == accepted["transformers"], (tree, accepted)
        assert accepted["native"][0] > 0 and accepted["native"][1] > 0, (tree, accepted)


def test_other_architectures_and_types_are_refused_by_name(tmp_path):
    from exactspec.backends.native_backend import GGUFModel

    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gemma3")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="llama, mistral, qwen2; other.gguf is 'gemma3'"):
        GGUFModel(path)


def test_a_q2_k_tensor_is_refused_naming_the_supported_types(tiny_gguf, tmp_path):
    from exactspec.backends.native_backend import GGUFModel

    reader = gguf.GGUFReader(tiny_gguf)
    path = tmp_path / "q2k.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        data = np.array(tensor.data)
        if tensor.name == "blk.0.ffn_down.weight":  # 32 rows of one Q2_K block (84 bytes)
            writer.add_tensor(tensor.name, np.zeros((32, 84), dtype=np.uint8),
                              raw_dtype=gguf.GGMLQuantizationType.Q2_K)
            continue
        writer.add_tensor(tensor.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="blk.0.ffn_down.weight is Q2_K; the native "
                                                    "backend reads F32, F16, Q4_0, Q4_1, Q5_0, "
                                                    "Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, BF16"):
        GGUFModel(path)


def test_eos_comes_from_the_file(tmp_path):
    from tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tiny_model(5), tmp_path / "eos.gguf", eos=7)
    assert native_backend(path).eos_token_ids == (7,)
    assert native_backend(path, eos_token_ids=[3, 4]).eos_token_ids == (3, 4)


def test_exactspec_isa_caps_the_path_and_refuses_what_the_cpu_cannot_run(monkeypatch):
    """``EXACTSPEC_ISA`` (read when the kernels load): unset or empty, the CPU's best path;
    a lower one, that one; a higher one or an unknown name, an error naming the choices."""
    for value, cpu, expected in (("", "avx2", "avx2"), ("portable", "avx512", "portable"),
                                 (" AVX2 ", "avx512", "avx2"), ("avx512", "avx512", "avx512")):
        monkeypatch.setenv(native.ISA_VARIABLE, value)
        assert native.forced_isa(cpu) == expected
    monkeypatch.setenv(native.ISA_VARIABLE, "avx512")
    with pytest.raises(ValueError, match="EXACTSPEC_ISA='avx512' is more than this CPU runs: "
                                         "choose one of portable, avx2"):
        native.forced_isa("avx2")
    monkeypatch.setenv(native.ISA_VARIABLE, "sse4")
    with pytest.raises(ValueError, match="EXACTSPEC_ISA='sse4' is invalid: choose one of "
                                         "portable, avx2, avx512"):
        native.forced_isa("avx512")
    assert KERNELS.paths == native.ISAS[:native.ISAS.index(KERNELS.best_isa) + 1]
