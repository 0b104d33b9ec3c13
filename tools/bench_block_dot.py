"""The emulated GEMM's exact float64 block dot (a 128x128 by 128x384 float64 matmul, one thread):
torch's matmul with and without parity's CPU pins (ATEN_CPU_CAPABILITY, MKL_CBWR, set per rank by
parity.distributed.determinism), and numpy's own BLAS under the pins. The dot is exact in float64
whatever the kernel, so only time differs. Prints microseconds per call; asserts nothing.

    python tools/bench_block_dot.py
"""

from __future__ import annotations

import os
import subprocess
import sys

_CHILD = r"""
import os, time
import torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
a = torch.randint(-300, 300, (128, 128), generator=g).double()
b = torch.randint(-300, 300, (384, 128), generator=g).double()

def us(f, n=300):
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e6

line = f"torch.mm {us(lambda: a @ b.t()):.0f} us"
if os.environ.get("WITH_NUMPY"):
    an, bn = a.numpy(), b.numpy()
    assert torch.equal(torch.from_numpy(an @ bn.T), a @ b.t())  # exact either way
    line += f", numpy {us(lambda: an @ bn.T):.0f} us"
print(line)
"""


def main():
    from parity.distributed.determinism import CPU_PINS

    base = {k: v for k, v in os.environ.items() if k not in CPU_PINS}
    for label, env in (("unpinned", base),
                       ("pinned (" + ", ".join(f"{k}={v}" for k, v in CPU_PINS.items()) + ")",
                        {**base, **CPU_PINS, "WITH_NUMPY": "1", "OPENBLAS_NUM_THREADS": "1"})):
        r = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True)
        print(f"{label}: {(r.stdout or r.stderr).strip()}")


if __name__ == "__main__":
    main()
