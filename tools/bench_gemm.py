"""The emulated FP8 GEMM on the CPU gate's shapes: microseconds per call, under parity's CPU pins.

The shapes are the default scenario's per-rank GEMMs (128 tokens, hidden 128, ffn 256, MoE ffn 128):
forward (activations 1x128 x weight 128x128), dgrad (grad 1x128 x weight^T 128x128) and wgrad
(grad^T 1x128 x activations^T 1x128), and the same for mxfp8 (1x32 blocks). The bench runs in a child
with parity's CPU pins and one thread, as a rank does; it prints the time per call and a digest of
every output's bits (two trees must print the same digests). Asserts nothing.

    python tools/bench_gemm.py                 # this tree
    PYTHONPATH=/other/tree python tools/bench_gemm.py
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = r"""
import hashlib, time
import torch
torch.set_num_threads(1)
from parity.fp8 import quantize, fp8_gemm

g = torch.Generator().manual_seed(0)
def rnd(*shape):
    return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

CASES = []  # (label, a operand, b operand)
for recipe, wblock in (("blockwise", "128x128"), ("mxfp8", None)):
    ablock = "1x128" if recipe == "blockwise" else None
    for n_out, n_in in ((384, 128), (128, 128), (512, 128), (128, 256), (256, 128)):
        x, w, dy = rnd(128, n_in), rnd(n_out, n_in), rnd(128, n_out)
        qx = quantize(x, recipe, block=ablock)
        qw = quantize(w, recipe, block=wblock)
        qdy = quantize(dy, recipe, block=ablock)
        CASES.append((f"{recipe} fwd   {128}x{n_out}x{n_in}", qx.gemm_operand("rowwise"), qw.gemm_operand("rowwise")))
        CASES.append((f"{recipe} dgrad {128}x{n_in}x{n_out}", qdy.gemm_operand("rowwise"), qw.gemm_operand("columnwise")))
        CASES.append((f"{recipe} wgrad {n_out}x{n_in}x{128}", qdy.gemm_operand("columnwise"), qx.gemm_operand("columnwise")))

def us(f, n):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6

total = 0.0
digest = hashlib.sha256()
for label, a, b in CASES:
    out = fp8_gemm(a, b, out_dtype=torch.bfloat16, backend="emulated")
    digest.update(out.contiguous().view(torch.int16).numpy().tobytes())
    t = min(us(lambda: fp8_gemm(a, b, out_dtype=torch.bfloat16, backend="emulated"), 40) for _ in range(3))
    total += t
    print(f"  {label:<28} {t:8.0f} us")
print(f"  all {len(CASES)} shapes: {total:.0f} us; output bits sha256 {digest.hexdigest()[:16]}")
"""


def main():
    from parity.distributed.determinism import CPU_PINS

    env = {**os.environ, **CPU_PINS, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
    print((r.stdout + r.stderr).rstrip())


if __name__ == "__main__":
    main()
