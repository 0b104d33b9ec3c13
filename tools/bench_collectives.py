"""Sums on gloo: parity's exchange-and-add against gloo's own ring, per call, on CPU ranks started
by parity's launcher (bound one to a CPU when they are as many as the CPUs to twice as many, as in a run).

For each world size and fp32 element count, prints the mean wall time per call on rank 0 and the
mean CPU time per call over the ranks (user + system, every thread), for
``dist.all_reduce`` (gloo's ring), ``all_reduce_sum`` forced through the exchange, and the same
pair for reduce-scatter (the element count is then the input's). Each pair also checks that the
two give the same bits ("BITS DIFFER" otherwise). Asserts nothing; use it to place
``EXCHANGE_MAX_BYTES`` (parity/distributed/collectives.py).

    python tools/bench_collectives.py [--worlds 2 4 8] [--sizes 1024 16384 65536] [--calls 50]
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.distributed as dist

from parity.distributed import collectives as C
from parity.harness.launch import LaunchConfig, launch


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed(fn, calls: int) -> tuple[float, float]:
    dist.barrier()
    w, c = time.perf_counter(), _cpu_s()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - w) / calls, (_cpu_s() - c) / calls


def _bench(ctx, sizes: list[int], calls: int) -> list[dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for n in sizes:
        x = torch.randn(n, generator=torch.Generator().manual_seed(rank)) * 1e3
        ring, mine = x.clone(), x.clone()
        dist.all_reduce(ring)
        saved, C.EXCHANGE_MAX_BYTES = C.EXCHANGE_MAX_BYTES, 1 << 62  # force the exchange
        try:
            C.all_reduce_sum(mine, None)
            same = torch.equal(ring.view(torch.int32), mine.view(torch.int32))
            t = x.clone()
            rows.append(dict(op="all-reduce", n=n, same=same,
                             ring=_timed(lambda: dist.all_reduce(t), calls),
                             exchange=_timed(lambda: C.all_reduce_sum(t, None), calls)))
        finally:
            C.EXCHANGE_MAX_BYTES = saved
        if n % world == 0:
            a, b = torch.empty(n // world), torch.empty(n // world)
            C._reduce_scatter_single(a, x.clone())
            C.reduce_scatter_sum(b, x, None)
            rows.append(dict(op="reduce-scatter", n=n, same=torch.equal(a.view(torch.int32), b.view(torch.int32)),
                             ring=_timed(lambda: C._reduce_scatter_single(a, x), calls),
                             exchange=_timed(lambda: C.reduce_scatter_sum(b, x, None), calls)))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 1024, 8192, 16384, 32768, 65536, 262144])
    ap.add_argument("--calls", type=int, default=50)
    args = ap.parse_args()
    for world in args.worlds:
        per_rank = launch(_bench, LaunchConfig(world_size=world, start_method="forkserver", deadline_s=1800),
                          args.sizes, args.calls)
        print(f"world {world} (fp32; ms per call: wall on rank 0, CPU mean over ranks)")
        for i, row in enumerate(per_rank[0]):
            cpu = {k: sum(r[i][k][1] for r in per_rank) / world for k in ("ring", "exchange")}
            same = all(r[i]["same"] for r in per_rank)
            print(f"  {row['op']:14s} {row['n']:8d} elements: ring {1e3 * row['ring'][0]:7.2f} wall "
                  f"{1e3 * cpu['ring']:6.2f} cpu | exchange {1e3 * row['exchange'][0]:7.2f} wall "
                  f"{1e3 * cpu['exchange']:6.2f} cpu | {row['ring'][0] / row['exchange'][0]:5.2f}x"
                  f"{'' if same else '  BITS DIFFER'}", flush=True)


if __name__ == "__main__":
    main()
