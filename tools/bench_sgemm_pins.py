"""What one fp32 GEMM of Newton-Schulz's sizes costs, one thread: torch's (MKL) and the one the
stack runs on the CPU (``parity.model.matmul``: numpy's OpenBLAS), with the CPU pins the rank
launcher applies (``parity.distributed.pins.CPU_PINS``) and without them.

Runs the same timing loop in two fresh interpreters (the pins act when a library loads or first
runs) and prints microseconds and GFLOP/s per shape. The pins are what make the CPU goldens hold
across CPU vendors (docs/spec/platform.md s1, s1.2): MKL's reproducible COMPATIBLE branch is slow,
OpenBLAS's pinned Haswell kernels are not.

    python tools/bench_sgemm_pins.py [--calls 2000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

_LOOP = r"""
import sys, time, torch
from parity.model import matmul
torch.set_num_threads(1)
calls = int(sys.argv[1])
for m, k, n in ((128, 128, 128), (128, 256, 128)):
    x, y = torch.randn(m, k), torch.randn(k, n)
    for name, gemm in (("torch (MKL)", torch.mm), ("parity.model.matmul (OpenBLAS)", matmul.mm)):
        for _ in range(50):
            gemm(x, y)
        t = time.perf_counter()
        for _ in range(calls):
            gemm(x, y)
        dt = (time.perf_counter() - t) / calls
        print(f"  {m}x{k}x{n} {name:31s}: {dt * 1e6:7.1f} us  {2 * m * n * k / dt / 1e9:6.1f} GFLOP/s")
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    from parity.distributed.pins import CPU_PINS

    base = {k: v for k, v in os.environ.items() if k not in CPU_PINS}
    for label, env in (("with the pins", {**base, **CPU_PINS}), ("without", base)):
        print(label, {k: env.get(k, "unset") for k in CPU_PINS})
        env = {**env, "OPENBLAS_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-c", _LOOP, str(args.calls)], env=env, check=True)


if __name__ == "__main__":
    main()
