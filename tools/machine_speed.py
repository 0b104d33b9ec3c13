"""How fast this machine computes right now: one fixed workload timed on every CPU at once.

The vCPUs of a shared host slow down while its other tenants are busy: on the 2-core CI machine one
parity commit's EP-8 command has taken 13.5 s and 19.7 s within the same hour, with no other process
of ours running. A benchmark's number means little without the machine's speed beside it, so time
this before and after it. The workload is a fixed amount of four kinds of work a CPU rank does:
interpreter bytecode, small torch ops (mostly per-op overhead), float64 GEMMs on numpy's BLAS and
copies larger than the caches, run in one process per CPU side by side, one thread each. Lower is
faster. A reading says which phase a benchmark ran in; it does not convert between phases (eight
ranks on two CPUs slowed by about 30% where this workload slowed by about 20%: docs/measurements.md,
twenty-fifth session). Prints numbers; asserts nothing.

    python tools/machine_speed.py [--repeat 3] [--procs N]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"  # before numpy and torch load: one thread per process, as in a rank

def _python_part() -> None:
    acc = 0
    for i in range(3_000_000):
        acc = (acc * 31 + i) & 0xFFFFFFFF


def _torch_ops_part() -> None:
    import torch

    x = torch.ones(64, 128)
    y = torch.full((64, 128), 0.5)
    for _ in range(40_000):
        z = x.mul(y).add_(y)
        z.amax(dim=1)


def _gemm_part() -> None:
    import numpy as np

    a = np.ones((128, 128))
    b = np.ones((128, 384))
    for _ in range(1_500):
        a @ b


def _memory_part() -> None:
    import numpy as np

    src = np.ones(8 << 20)  # 64 MiB: larger than any cache, so this is the memory's bandwidth
    dst = np.empty_like(src)
    for _ in range(40):
        np.copyto(dst, src)


_WORK = {"python": _python_part, "torch_ops": _torch_ops_part, "f64_gemm": _gemm_part, "memory": _memory_part}
PARTS = tuple(_WORK)


def _one_process(start, out) -> None:
    import torch  # noqa: F401  (loaded before the clock starts)

    torch.set_num_threads(1)
    start.wait()  # every process starts its workload at once
    times = {}
    for name in PARTS:
        t0 = time.perf_counter()
        _WORK[name]()
        times[name] = time.perf_counter() - t0
    out.put(times)


def measure(procs: int) -> dict[str, float]:
    """Median seconds of each part over ``procs`` processes that run the workload side by side."""
    ctx = mp.get_context("spawn")  # a fresh interpreter each: nothing inherited from the caller
    start, out = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_one_process, args=(start, out)) for _ in range(procs)]
    for w in workers:
        w.start()
    results = [out.get(timeout=600) for _ in workers]
    for w in workers:
        w.join()
    return {name: statistics.median(r[name] for r in results) for name in PARTS}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="readings to take, one line each")
    ap.add_argument("--procs", type=int,
                    default=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                    help="processes side by side (default: the CPUs this process may use)")
    args = ap.parse_args()
    for _ in range(args.repeat):
        t = measure(args.procs)
        parts = ", ".join(f"{name} {t[name] * 1e3:.0f} ms" for name in PARTS)
        print(f"{time.strftime('%H:%M:%S')} {args.procs} procs: {parts}; total {sum(t.values()) * 1e3:.0f} ms",
              flush=True)


if __name__ == "__main__":
    main()
