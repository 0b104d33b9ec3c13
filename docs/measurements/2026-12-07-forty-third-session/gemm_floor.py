"""Where an emulated FP8 GEMM of the CPU scenarios' size spends its time, side by side in one
process: the whole call, the float64 block dots on numpy's BLAS (its floor), the model's fp32
GEMM of the same shape (numpy's sgemm, parity.model.matmul), a quantize, and one small torch op
(the fixed cost every op pays). Run from the repo root:
    python docs/measurements/2026-12-07-forty-third-session/gemm_floor.py
"""
from parity.distributed.pins import pin_before_torch

pin_before_torch()  # as the CLI does: the pinned BLAS kernels, one thread

import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from parity.fp8.gemm import fp8_gemm  # noqa: E402
from parity.fp8.quantize import quantize  # noqa: E402
from parity.model.matmul import mm  # noqa: E402

torch.set_num_threads(1)


def per_call_us(f, n=400):
    for _ in range(20):
        f()
    best = float("inf")
    for _ in range(3):  # the best of three rounds: the host's other load only adds
        t = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, (time.perf_counter() - t) / n * 1e6)
    return best


M, N, K = 256, 256, 128  # activations [micro_batch * seq, hidden] x a [256, 128] weight
g = torch.Generator().manual_seed(0)
x = quantize(torch.randn(M, K, generator=g).bfloat16(), "blockwise", block="1x128")
w = quantize(torch.randn(N, K, generator=g).bfloat16(), "blockwise", block="128x128")
a, b = x.gemm_operand("rowwise"), w.gemm_operand("rowwise")
a64 = np.random.default_rng(0).standard_normal((1, M, K))
b64 = np.random.default_rng(1).standard_normal((1, K, N))
a32, b32 = torch.randn(M, K), torch.randn(K, N)
xb = torch.randn(M, K, generator=g).bfloat16()
s = torch.rand(256)

rows = [
    ("emulated FP8 GEMM (1x128 x 128x128, bf16 out)", per_call_us(lambda: fp8_gemm(a, b, out_dtype=torch.bfloat16))),
    ("  its float64 block dot alone (numpy matmul)", per_call_us(lambda: np.matmul(a64, b64))),
    ("  the model's fp32 GEMM of the same shape", per_call_us(lambda: mm(a32, b32))),
    ("quantize [256, 128] bf16, 1x128, both usages", per_call_us(lambda: quantize(xb, "blockwise", block="1x128"))),
    ("  one small torch op (amax of 256 floats)", per_call_us(lambda: s.amax(), n=4000)),
]
for name, us in rows:
    print(f"{name:50s} {us:8.1f} us")
print(f"float64 BLAS share of the GEMM: {rows[1][1] / rows[0][1]:.2f}; "
      f"GFLOP/s of the float64 dot: {2 * M * N * K / rows[1][1] / 1e3:.1f}")
