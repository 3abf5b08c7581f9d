"""The int8 product of the embedded model's LM head shape (49,152 x 576, Q8_0) for 1..16
rows, before and after the tile's software prefetch, interleaved in one process: the
kernels of a given commit (default HEAD~1, before) against the working tree's.

    python results/native-prefetch-2026-12-04/linear_rows.py [COMMIT]
"""
import ctypes, statistics, subprocess, sys, tempfile, time
from pathlib import Path
import gguf, torch
from exactspec.backends import native

commit = sys.argv[1] if len(sys.argv) > 1 else "HEAD~1"
new = native.load()
old_source = subprocess.run(["git", "show", f"{commit}:src/exactspec/backends/native/decode_kernels.c"],
                            check=True, capture_output=True, text=True).stdout
folder = Path(tempfile.mkdtemp())
(folder / "old.c").write_text(old_source)
gomp = native._torch_libgomp()
omp = [str(gomp), f"-Wl,-rpath,{gomp.parent}"] if gomp else []
subprocess.run(["cc", "-o", str(folder / "old.so"), str(folder / "old.c"), *native.COMPILE_FLAGS, *omp, "-lm"], check=True)
old = native.NativeKernels(ctypes.CDLL(str(folder / "old.so")), folder / "old.so")
Q8 = native.WEIGHT_TYPES["Q8_0"]
N, K = 49152, 576
w = torch.randn(N, K, generator=torch.Generator().manual_seed(0)).numpy()
blocks = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
packed = new.repack(blocks, Q8, N, K)
res = {}
for rep in range(20):
    for threads in (1, 2):
        for rows in range(1, 17):
            x = torch.randn(rows, K)
            for name, kernels in (("before", old), ("after", new)):
                t0 = time.perf_counter()
                y = kernels.linear_int8(x, packed, Q8, N, threads)
                res.setdefault((name, threads, rows), []).append((time.perf_counter() - t0) * 1e3)
                res.setdefault(("out", name, rows), y)
            assert torch.equal(res[("out", "before", rows)], res[("out", "after", rows)])
print("ms per product (median of 20), 49,152 x 576 Q8_0; outputs equal bit for bit")
for threads in (1, 2):
    for name in ("before", "after"):
        print(f"{threads} thread(s) {name:6s}", " ".join(
            f"{rows}:{statistics.median(res[(name, threads, rows)]):.2f}" for rows in range(1, 17)))
