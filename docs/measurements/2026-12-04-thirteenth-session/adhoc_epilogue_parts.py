"""Ad hoc (thirteenth session): the parts of the emulated GEMM epilogue on an expert's padded mxfp8
GEMM (cpu-epilogue-check-tried.txt). Run under parity's CPU pins, from the repository root:
    PYTHONPATH=. python -c "import os,subprocess,sys; from parity.distributed.determinism import CPU_PINS; subprocess.run([sys.executable, 'docs/measurements/2026-12-04-thirteenth-session/adhoc_epilogue_parts.py'], env={**os.environ, **CPU_PINS, 'OMP_NUM_THREADS': '1'})"
The pow2 / div / same lines time the tried check (reverted); _powers_of_two and _same_values are
no longer in parity, so this script defines them itself.
"""
import torch, time, numpy as np
torch.set_num_threads(1)
from parity.fp8 import quantize
from parity.fp8 import gemm as G
g = torch.Generator().manual_seed(0)
def rnd(*shape): return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)
x, w = rnd(64, 128), rnd(256, 128); x[40:] = 0
qx, qw = quantize(x, "mxfp8"), quantize(w, "mxfp8")
a, b = qx.gemm_operand("rowwise"), qw.gemm_operand("rowwise")
p = G._block_dots(a, b, 0, 4)
sa = a.scale_inv.t().unsqueeze(2); sb = b.scale_inv.t().unsqueeze(1)
def _powers_of_two(s):
    return bool((torch.frexp(s).mantissa == 0.5).all())


def _same_values(x, y):
    return bool(np.array_equal(x.numpy(), y.numpy()))


def us(f, n=300):
    for _ in range(20): f()
    t = time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter() - t) / n * 1e6
t = G._mul32(p, sa)
print("shape", tuple(p.shape), "s", tuple(sb.shape))
print("steps_exact", us(lambda: G._fp32_steps_exact(a, b, sa, sb)))
print("pow2", us(lambda: _powers_of_two(sb)))
prod = t * sb
print("mul", us(lambda: t * sb))
print("div", us(lambda: prod / sb))
q = prod / sb
print("same", us(lambda: _same_values(q, t)))
print("exact_products (as in parity)", us(lambda: G._exact_fp32_products(p, a, b, sa, sb, False)))
print("accumulate", us(lambda: G.accumulate_blocks(p, a, b, None)))
print("block_dots", us(lambda: G._block_dots(a, b, 0, 4)))
