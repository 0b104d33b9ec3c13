"""Ad hoc (thirteenth session): np.matmul rate of the emulated GEMM's float64 block dots, one
thread, OpenBLAS on its pinned Haswell kernels (cpu-op-costs.txt). Run:
    OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell python docs/measurements/2026-12-04-thirteenth-session/adhoc_float64_dots.py
"""
import time

import numpy as np


def bench(f, n=500):
    for _ in range(20):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


for nb, M, L, N in ((4, 128, 32, 128), (8, 128, 32, 256), (1, 128, 128, 128), (2, 128, 128, 256)):
    a, b = np.random.randn(nb, M, L), np.random.randn(nb, L, N)
    us = bench(lambda: np.matmul(a, b))
    af, bf = a.astype(np.float32), b.astype(np.float32)
    print(nb, M, L, N, f"float64 {us:.0f} us {2 * nb * M * L * N / us / 1e3:.1f} GFLOP/s",
          f"fp32 {bench(lambda: np.matmul(af, bf)):.0f} us")
