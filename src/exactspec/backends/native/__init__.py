"""exactspec's compiled batch-invariant decode kernels, built on first use.

The C sources beside this file (``kernels.h`` says which file holds what) give a matrix
product that reads the weights once for all rows and reduces every output element in one
fixed order, whatever the number of rows, the other rows or the thread split (each file's
header gives the order), the same product over GGUF weight blocks and with int8
activations, attention, and the native backend's whole forward pass (``es_forward``,
:mod:`exactspec.backends.native_backend`); this module compiles them once per version of
the sources with the machine's C compiler into exactspec's cache
(``$EXACTSPEC_CACHE_DIR/kernels``; the files compile side by side, ≈ 5 seconds on 2 cores),
loads the library with ctypes and picks the instruction set at run time: AVX-512F, AVX2 +
FMA, or portable C (``fmaf``; the same bits as AVX2). Each path is batch-invariant on its
own; one process uses one path. The float32 products sum in 16 lanes on AVX-512 (other bits
than AVX2's); attention and the products with int8 activations (``es_linear_q8``, AVX-512
VNNI where the CPU has it) give the same bits on all three.

Why compiled on first use rather than at ``pip install``: the project installs as pure
Python (``pip install -e .``, no build step to fail on a machine without a compiler), the
sources are plain C with no Python or PyTorch headers (seconds to compile, where a
``torch.utils.cpp_extension`` build takes a minute), and a machine without a compiler loses
only speed: :func:`load` returns None and the backend keeps PyTorch's kernels, saying so
once (docs/design.md, "Batch-invariant kernels that read the weights once").

Threads: OpenMP, linked against the ``libgomp`` PyTorch already loaded (one runtime, one
pool of threads), as many as ``torch.get_num_threads()``; they split output columns only.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch

from exactspec.model_files import cache_root
from exactspec.trees import TreePaths

logger = logging.getLogger(__name__)

HEADER = Path(__file__).with_name("kernels.h")
SOURCES = tuple(HEADER.with_name(name) for name in (
    "blocks.c", "float_product.c", "int8_product.c", "attention.c", "forward.c"))
"""The kernels' C files, one per concern (:data:`HEADER` says which holds what)."""
ISAS = ("portable", "avx2", "avx512")
"""The instruction-set paths, by the number ``es_best_isa`` returns."""
ISA_VARIABLE = "EXACTSPEC_ISA"
"""The environment variable that caps the path: one of :data:`ISAS`, at most what the CPU
runs (the tests then also run that path and the ones below it only)."""

COMPILE_FLAGS = ("-O3", "-fPIC", "-fopenmp", "-ffp-contract=off")
"""-O3 unrolls the tiles' loops over rows and columns, so that the accumulators live in
registers (at -O2 a 16-row product ran 3x slower); the source's intrinsics fix every
rounding, and ``-ffp-contract=off`` keeps the compiler from fusing anything else."""
WEIGHT_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8,
                "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "BF16": 30}
"""The GGUF weight types the kernels read in place, by name: ggml's type numbers."""


INT8_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
"""The block types with an int8-activation product (``es_linear_q8``; the C source's header
gives its arithmetic)."""


class Weight(ctypes.Structure):
    """``es_weight``: a matrix's first byte, its ggml type, and its repacked copy for the
    int8-activation product (null: the float32 product)."""
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("packed", ctypes.c_void_p)]


class QuantizedRows(ctypes.Structure):
    """``es_q8_rows``: rows quantised per block of 32 (int8 values, scales, sums, sums of
    each block's first 16)."""
    _fields_ = [(name, ctypes.c_void_p) for name in ("xq", "dx", "sx", "dxs", "sxa")]


class Layer(ctypes.Structure):
    """``es_layer``: one decoder layer's tensors (biases may be null)."""
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("attn_norm", "ffn_norm", "bq", "bk", "bv")] + [
                (name, Weight) for name in ("wq", "wk", "wv", "wo", "gate", "up", "down")]


class Model(ctypes.Structure):
    """``es_model``: shapes, RoPE and normalisation constants, and the tensors."""
    _fields_ = [(name, ctypes.c_int64) for name in
                ("n_layer", "n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_vocab",
                 "rope_dims", "rope_neox")] + [
                (name, ctypes.c_double) for name in ("rms_eps", "rope_base", "rope_scale")] + [
                ("rope_factors", ctypes.c_void_p), ("output_norm", ctypes.c_void_p),
                ("tok_embd", Weight), ("output", Weight), ("layers", ctypes.POINTER(Layer))]


class Segment(ctypes.Structure):
    """``es_segment``: one sequence's rows in a forward: its cache and where they go."""
    _fields_ = [("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("capacity", ctypes.c_int64), ("n_past", ctypes.c_int64),
                ("n_tokens", ctypes.c_int64), ("tree_rows", ctypes.c_void_p),
                ("tree_offsets", ctypes.c_void_p)]


class Head(ctypes.Structure):
    """``es_head``: a draft head's shapes and tensors (``es_head_step``; the norms and
    frequencies float32, the products' weights repacked, all of ``weight_type``)."""
    _fields_ = [(name, ctypes.c_int64) for name in
                ("n_embd", "n_head", "n_head_kv", "head_dim", "n_ff", "n_draft_vocab",
                 "weight_type")] + [
                ("rms_eps", ctypes.c_double)] + [
                (name, ctypes.c_void_p) for name in
                ("embedding", "input_norm", "hidden_norm", "post_norm", "final_norm",
                 "inv_freq", "qkv", "o", "gate_up", "down", "lm_head")] + [
                ("n_features", ctypes.c_int64), ("fc", ctypes.c_void_p)]


_lock = threading.Lock()
_loaded: NativeKernels | None | bool = False  # False: not tried yet


class NativeKernels:
    """The loaded library.

    Attributes:
        cpu_isa: the best path this CPU runs, one of :data:`ISAS`.
        best_isa: the path used by default: ``cpu_isa``, or lower where ``$EXACTSPEC_ISA``
            says so.
        isa: the path in use (``best_isa``; tests set the others of :attr:`paths`).
        paths: every path this process may run, from ``portable`` up to ``best_isa``.
        path: the shared library's file.
    Raises:
        ValueError: ``$EXACTSPEC_ISA`` names no path, or one this CPU cannot run.
    """

    def __init__(self, library: ctypes.CDLL, path: Path) -> None:
        self._lib, self.path = library, path
        library.es_best_isa.restype = ctypes.c_int
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        library.es_linear.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr, i64, ctypes.c_int,
                                      ctypes.c_int]
        library.es_linear.restype = None
        library.es_attention.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, i64, i64, i64,
                                         i64, i64, i64, ctypes.c_float, ptr, i64, i64,
                                         ctypes.c_int, ctypes.c_int, ptr, ptr]
        library.es_attention.restype = ctypes.c_int
        library.es_attention.errcheck = _scratch_allocated
        self._attention = library.es_attention
        library.es_linear_typed.argtypes = [ptr, i64, i64, i64, ptr, ctypes.c_int, i64, ptr, i64,
                                            ctypes.c_int, ctypes.c_int]
        library.es_linear_typed.restype = ctypes.c_int
        library.es_linear_typed.errcheck = _scratch_allocated
        library.es_row_bytes.argtypes = [ctypes.c_int, i64]
        library.es_row_bytes.restype = i64
        library.es_quantize_q4_0.argtypes = [ptr, ctypes.c_int, i64, i64, ptr]
        library.es_quantize_q4_0.restype = ctypes.c_int
        library.es_quantize_q4_0.errcheck = _scratch_allocated
        library.es_forward.argtypes = [ctypes.POINTER(Model), ctypes.POINTER(Segment), i64, ptr,
                                       ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ctypes.c_int,
                                       ctypes.c_int]
        library.es_forward.restype = ctypes.c_int
        library.es_forward.errcheck = _scratch_allocated
        library.es_repacked_bytes.argtypes = [ctypes.c_int, i64, i64]
        library.es_repacked_bytes.restype = i64
        library.es_repack.argtypes = [ptr, ctypes.c_int, i64, i64, ptr]
        library.es_repack.restype = None
        library.es_quantize_rows.argtypes = [ptr, i64, i64, i64, i64, QuantizedRows,
                                             ctypes.c_int]
        library.es_quantize_rows.restype = None
        library.es_linear_q8.argtypes = [QuantizedRows, i64, i64, ptr, ctypes.c_int, i64, ptr,
                                         i64, ctypes.c_int, ctypes.c_int]
        library.es_linear_q8.restype = None
        library.es_head_step.argtypes = [ctypes.POINTER(Head), ptr, ptr, i64, i64, ptr, ptr, ptr,
                                         ptr, ptr, ctypes.c_int, ctypes.c_int]
        library.es_head_step.restype = ctypes.c_int
        library.es_head_step.errcheck = _scratch_allocated
        self.head_step = library.es_head_step
        """``es_head_step`` (the C source's header gives its arguments and arithmetic)."""
        self.row_bytes = library.es_row_bytes
        self.forward = library.es_forward
        """``es_forward`` (the C source's header gives its arguments and arithmetic)."""
        self.cpu_isa = ISAS[library.es_best_isa()]
        self.best_isa = forced_isa(self.cpu_isa)
        self.isa = self.best_isa
        self.paths = ISAS[:ISAS.index(self.best_isa) + 1]
        self._linear = library.es_linear

    def linear(self, x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None,
               threads: int | None = None) -> torch.Tensor:
        """``x @ weight.T``, every output element reduced over k in one fixed order (see
        the C source) whatever the rows and threads.

        Args:
            x: ``[rows, K]`` float32 on the CPU, rows contiguous (row stride free).
            weight: ``[N, K]`` float32, contiguous (as ``nn.Linear`` stores it).
            out: ``[rows, N]`` float32 to write into (rows contiguous), or None.
            threads: OpenMP threads (default ``torch.get_num_threads()``).
        Returns:
            ``[rows, N]`` float32.
        Raises:
            ValueError: for other dtypes, devices, shapes or layouts.
        """
        rows, k = x.shape
        n = weight.shape[0]
        if out is None:
            out = torch.empty(rows, n, dtype=torch.float32)
        _check_cpu_float32(x, weight, out)
        if (weight.shape[1] != k or not weight.is_contiguous() or x.stride(1) != 1
                or out.shape != (rows, n) or out.stride(1) != 1):
            raise ValueError(f"shapes {tuple(x.shape)} @ {tuple(weight.shape)}.T → "
                             f"{tuple(out.shape)} or layouts do not fit: x [rows, K] with "
                             "contiguous rows, weight [N, K] contiguous, out [rows, N] with "
                             "contiguous rows")
        self._linear(x.data_ptr(), x.stride(0), rows, k, weight.data_ptr(), n,
                     out.data_ptr(), out.stride(0),
                     torch.get_num_threads() if threads is None else threads,
                     ISAS.index(self.isa))
        return out


    def linear_typed(self, x: torch.Tensor, weight: np.ndarray, weight_type: int, n: int,
                     threads: int = 1) -> torch.Tensor:
        """``x @ W.T`` for a weight ``W [n, K]`` in a GGUF block format (``weight``: an
        object with the buffer protocol holding its rows, ``weight_type``: ggml's type
        number, see :data:`WEIGHT_TYPES`), each output element the float32 arithmetic of
        :meth:`linear` over the dequantised weights.

        Args:
            x: ``[rows, K]`` float32, contiguous.
        Returns:
            ``[rows, n]`` float32.
        Raises:
            ValueError: for a type the kernels do not take or a K it cannot split in blocks.
        """
        rows, k = x.shape
        _check_cpu_float32(x)
        if not x.is_contiguous() or self.row_bytes(weight_type, k) == 0:
            raise ValueError(f"weight type {weight_type} with K = {k} (or a non-contiguous x) "
                             f"is not taken: types {sorted(WEIGHT_TYPES.values())}")
        out = torch.empty(rows, n, dtype=torch.float32)
        if not weight.flags.c_contiguous or weight.nbytes != n * self.row_bytes(weight_type, k):
            raise ValueError(f"the weight's {weight.nbytes} bytes are not {n} contiguous rows "
                             f"of type {weight_type}")
        self._lib.es_linear_typed(x.data_ptr(), k, rows, k, weight.ctypes.data, weight_type, n,
                                  out.data_ptr(), n, threads, ISAS.index(self.isa))
        return out

    def repack(self, weight: np.ndarray, weight_type: int, n: int, k: int) -> np.ndarray:
        """The int8 product's copy of a ``[n, k]`` block-format weight (``es_repack``: the
        same bytes, reordered per 16 output columns).

        Raises:
            ValueError: for a type without an int8 product (:data:`INT8_TYPES`) or a k that
                is not a multiple of 32.
        """
        size = self._lib.es_repacked_bytes(weight_type, n, k)
        if size == 0:
            raise ValueError(f"weight type {weight_type} with K = {k} has no int8 product: "
                             f"types {[WEIGHT_TYPES[name] for name in INT8_TYPES]}, K a "
                             "multiple of 32")
        packed = np.empty(size, dtype=np.uint8)
        self._lib.es_repack(weight.ctypes.data, weight_type, n, k, packed.ctypes.data)
        return packed

    def quantize_q4_0(self, weight: np.ndarray, weight_type: int, n: int, k: int) -> np.ndarray:
        """A ``[n, k]`` weight of ``weight_type`` (any of :data:`WEIGHT_TYPES`) re-quantised to
        Q4_0 (``es_quantize_q4_0``; blocks.c gives the arithmetic): ``[n, k / 32 * 18]``
        uint8, Q4_0's bytes.

        Raises:
            ValueError: for a k that is not a multiple of 32 (and of 256 for the K types), or
                a weight that is not ``n`` contiguous rows of its type.
            MemoryError: if the per-thread scratch row cannot be allocated.
        """
        row_bytes = self.row_bytes(weight_type, k)
        if k % 32 or row_bytes == 0:
            raise ValueError(f"weight type {weight_type} with K = {k} cannot be re-quantised "
                             "to Q4_0: K must be a multiple of 32 (256 for the K types)")
        if not weight.flags.c_contiguous or weight.nbytes != n * row_bytes:
            raise ValueError(f"the weight's {weight.nbytes} bytes are not {n} contiguous rows "
                             f"of type {weight_type}")
        out = np.empty((n, self.row_bytes(WEIGHT_TYPES["Q4_0"], k)), dtype=np.uint8)
        self._lib.es_quantize_q4_0(weight.ctypes.data, weight_type, n, k, out.ctypes.data)
        return out

    def linear_int8(self, x: torch.Tensor, packed: np.ndarray, weight_type: int, n: int,
                    threads: int = 1) -> torch.Tensor:
        """``x @ W.T`` as the native forward computes it for a block-format weight: each row
        of ``x`` quantised to int8 per block of 32 (its own scales), exact integer dot
        products per block, scaled in float in one fixed order (the C source's header).

        Args:
            x: ``[rows, K]`` float32, contiguous.
            packed: the weight's :meth:`repack` copy.
        Returns:
            ``[rows, n]`` float32.
        """
        rows, k = x.shape
        _check_cpu_float32(x)
        if not x.is_contiguous() or k % 32:
            raise ValueError("x must be contiguous [rows, K] with K a multiple of 32")
        buffers = [np.empty(rows * k, np.int8), np.empty(rows * k // 32, np.float32),
                   np.empty(rows * k // 32, np.int32), np.empty(rows * k // 32, np.float32),
                   np.empty(rows * k // 32, np.int32)]
        quantized = QuantizedRows(*(b.ctypes.data for b in buffers))
        self._lib.es_quantize_rows(x.data_ptr(), k, 0, rows, k, quantized,
                                   ISAS.index(self.isa))
        out = torch.empty(rows, n, dtype=torch.float32)
        self._lib.es_linear_q8(quantized, rows, k, packed.ctypes.data, weight_type, n,
                               out.data_ptr(), n, threads, ISAS.index(self.isa))
        return out

    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  scale: float, out: torch.Tensor, threads: int | None = None,
                  tree: TreePaths | None = None) -> None:
        """Causal attention of one sequence's last ``q`` positions, each query over exactly
        the keys up to its position, with the arithmetic of a one-token step there (the C
        source gives the order); grouped-query heads share their kv head. With ``tree``, the
        ``q`` positions are the nodes of a token tree and each sees the keys before them and
        then its own path only, with the arithmetic of a one-token step after that path.

        Args:
            query: ``[heads, q, head_dim]`` float32 (any strides, head_dim contiguous).
            key, value: ``[kv_heads, L, head_dim]`` float32, L ≥ q (the sequence's cache,
                these queries' keys last).
            scale: the scores' factor (head_dim ** -0.5 for Llama).
            out: ``[q, heads, head_dim]`` float32 written in place (head_dim contiguous).
            threads: OpenMP threads (default ``torch.get_num_threads()``); they take whole
                kv heads.
            tree: the nodes' paths (:class:`TreePaths`), or None for a chain.
        Raises:
            ValueError: for layouts the kernel does not take, or paths of other than ``q``
                nodes.
        """
        heads, q_len, head_dim = query.shape
        kv_heads, length, _ = key.shape
        _check_cpu_float32(query, key, value, out)
        if (any(t.stride(-1) != 1 for t in (query, key, value, out)) or length < q_len
                or heads % kv_heads or key.shape != (kv_heads, length, head_dim)
                or value.shape != key.shape or out.shape != (q_len, heads, head_dim)):
            raise ValueError("attention takes query [H, q, d], key and value [Hkv, L ≥ q, d] "
                             "and out [q, H, d] with the last dim contiguous, H a multiple of "
                             f"Hkv; got {tuple(query.shape)}, {tuple(key.shape)}, "
                             f"{tuple(value.shape)}, {tuple(out.shape)}")
        if tree is not None and tree.offsets.shape != (q_len + 1,):
            raise ValueError(f"tree paths for {tree.offsets.shape[0] - 1} nodes; the query has "
                             f"{q_len}")
        threads = torch.get_num_threads() if threads is None else threads
        self._attention(query.data_ptr(), q_len, heads, head_dim, query.stride(1),
                        query.stride(0), key.data_ptr(), value.data_ptr(), kv_heads, length,
                        key.stride(0), key.stride(1), value.stride(0), value.stride(1), scale,
                        out.data_ptr(), out.stride(0), out.stride(1), threads,
                        ISAS.index(self.isa), None if tree is None else tree.rows.data_ptr(),
                        None if tree is None else tree.offsets.data_ptr())



def forced_isa(cpu_isa: str) -> str:
    """The path ``$EXACTSPEC_ISA`` forces (``cpu_isa``, the best the CPU runs, where it is
    unset or empty). Raises ValueError for a name outside :data:`ISAS` or above
    ``cpu_isa``."""
    forced = os.environ.get(ISA_VARIABLE, "").strip().lower()
    if not forced:
        return cpu_isa
    runs = ISAS[:ISAS.index(cpu_isa) + 1]
    if forced not in ISAS:
        raise ValueError(f"{ISA_VARIABLE}={forced!r} is invalid: choose one of "
                         f"{', '.join(runs)} (the paths this CPU runs)")
    if forced not in runs:
        raise ValueError(f"{ISA_VARIABLE}={forced!r} is more than this CPU runs: choose one "
                         f"of {', '.join(runs)}")
    return forced


def _check_cpu_float32(*tensors: torch.Tensor) -> None:
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        raise ValueError("the native kernels take float32 tensors on the CPU")


def load() -> NativeKernels | None:
    """The compiled kernels (compiled now if this source version never was), or None where
    they cannot be built or loaded (no C compiler, ``EXACTSPEC_NATIVE_KERNELS=0``); the
    reason is logged once as a warning."""
    global _loaded
    if _loaded is not False:  # the hot path: once per product, no lock
        return _loaded
    with _lock:
        if _loaded is False:
            _loaded = _build_and_load()
        return _loaded


def _build_and_load() -> NativeKernels | None:
    if os.environ.get("EXACTSPEC_NATIVE_KERNELS", "1") == "0":
        logger.warning("native kernels off (EXACTSPEC_NATIVE_KERNELS=0): PyTorch's "
                       "batch-invariant kernels are used")
        return None
    try:
        path = _compile()
        return NativeKernels(ctypes.CDLL(str(path)), path)
    except (OSError, subprocess.CalledProcessError, RuntimeError) as error:
        logger.warning("exactspec's native kernels could not be built or loaded (%s); "
                       "PyTorch's batch-invariant kernels are used instead (slower for "
                       "several tokens)", _last_line(error))
        return None


def _last_line(error: Exception) -> str:
    """The line of a failed build that says why (the compiler's output where there is one)."""
    text = getattr(error, "output", None) or getattr(error, "stderr", None) or str(error)
    lines = [line for line in str(text).strip().splitlines() if line.strip()] or [repr(error)]
    errors = [line for line in lines if "error" in line]
    return (errors or lines)[-1][:300]


def _compile() -> Path:
    """The shared library for these sources, compiled into the cache if absent: each file
    to an object on its own (side by side), then linked."""
    gomp = _torch_libgomp()
    # link against PyTorch's own OpenMP runtime where it ships one, so both share a pool
    omp = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else []
    link_flags = ["-shared", "-fopenmp", *omp, "-lm"]
    digest = hashlib.sha256()
    for path in (HEADER, *SOURCES):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    digest.update(" ".join([*COMPILE_FLAGS, *link_flags]).encode())
    target = cache_root() / "kernels" / f"decode_kernels-{digest.hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (cc, gcc, or $CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objects = [Path(tmp) / f"{source.stem}.o" for source in SOURCES]
        runs = [subprocess.Popen([compiler, "-c", "-o", str(obj), str(source), *COMPILE_FLAGS],
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for source, obj in zip(SOURCES, objects)]
        for run in runs:
            output = run.communicate()[0]
            if run.returncode:
                raise subprocess.CalledProcessError(run.returncode, run.args, output)
        built = Path(tmp) / target.name
        subprocess.run([compiler, "-o", str(built), *map(str, objects), *link_flags],
                       check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: another process may be compiling too
    return target


def _scratch_allocated(status: int, function, arguments) -> int:
    """ctypes' check of an entry point that returns -1 when its scratch memory could not be
    allocated (kernels.h)."""
    if status != 0:
        raise MemoryError(f"{function.__name__}: the kernels' scratch memory could not be "
                          "allocated")
    return status


def _torch_libgomp() -> Path | None:
    """PyTorch's bundled ``libgomp.so.1``, if its build ships one."""
    found = Path(torch.__file__).parent / "lib" / "libgomp.so.1"
    return found if found.exists() else None
