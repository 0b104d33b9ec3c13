"""Ad hoc (thirteenth session): per-op costs behind cpu-op-costs.txt. One thread; prints
microseconds per call. Run from the repository root:
    PYTHONPATH=. python docs/measurements/2026-12-04-thirteenth-session/adhoc_op_costs.py
"""
import time

import numpy as np
import torch

torch.set_num_threads(1)


def bench(f, n=3000):
    for _ in range(100):
        f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6


a = torch.randn(128, 32)
an = a.numpy()
print("torch mul grad mode", bench(lambda: a.mul(2.0)))
with torch.no_grad():
    print("torch mul no_grad", bench(lambda: a.mul(2.0)))
with torch.inference_mode():
    b = torch.randn(128, 32)
    print("torch mul inference_mode", bench(lambda: b.mul(2.0)))
print("numpy multiply", bench(lambda: an * np.float32(2.0)))
print("torch amax(dim=1)", bench(lambda: a.amax(dim=1)))
print("numpy max(axis=1)", bench(lambda: an.max(axis=1)))
print("torch view(int32)", bench(lambda: a.view(torch.int32)))
print("numpy view(int32)", bench(lambda: an.view(np.int32)))
print("torch.from_numpy", bench(lambda: torch.from_numpy(an)))
print("Tensor.numpy()", bench(lambda: a.numpy()))

t = torch.randn(4, 128, 128)
u = t * 2.0 ** -10 * 2.0 ** 10
print("torch.equal fp32 64k", bench(lambda: torch.equal(u, t)))
print("torch.equal int32 views", bench(lambda: torch.equal(u.view(torch.int32), t.view(torch.int32))))
print("(a != b).any()", bench(lambda: bool((u != t).any())))
print("numpy array_equal", bench(lambda: np.array_equal(u.numpy(), t.numpy())))
print("tobytes ==", bench(lambda: u.numpy().tobytes() == t.numpy().tobytes()))

from parity.fp8.quantize import quantize  # noqa: E402

x = torch.randn(128, 256).bfloat16()
for recipe, block in (("mxfp8", None), ("blockwise", "1x128"), ("blockwise", "128x128")):
    print("quantize", recipe, block, bench(lambda: quantize(x, recipe, block=block), 200))

for shape, dims in (((128, 2, 128), (2,)), ((1, 128, 256), (1,)), ((128, 8, 32), (2,)), ((4, 32, 256), (1,)),
                    ((1, 128, 2, 128), (1, 3))):
    y = torch.randn(*shape)
    row = f"{shape} {dims}: amax+amin {bench(lambda: (y.amax(dim=dims), y.amin(dim=dims))):.1f}"
    if len(dims) == 1:
        row += f"  aminmax {bench(lambda: torch.aminmax(y, dim=dims[0])):.1f}"
    print(row + f"  abs().amax {bench(lambda: y.abs().amax(dim=dims)):.1f}")
