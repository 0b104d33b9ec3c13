"""Ad hoc: all-reduce of fewer elements than 2 x world on gloo: gloo's own all_reduce against the
exchange (one all-to-all, then the ring's order added here), bits and time per call. fp32 with
spread exponents, int64 too (any order gives its bits). Prints; asserts nothing.

    python adhoc_tiny_sums.py [world ...]
"""
import sys
import time

import torch
import torch.distributed as dist

from parity.distributed import collectives as C
from parity.harness.launch import LaunchConfig, launch


def _exchange(t):
    world = dist.get_world_size()
    C._exchange_and_sum(t.view(-1), t.view(-1).expand(world, -1), 0, t.numel(), None, False)


def _int_exchange(t):
    world = dist.get_world_size()
    recv = torch.empty((world, t.numel()), dtype=t.dtype)
    dist.all_to_all_single(recv, t.view(-1).expand(world, -1).contiguous())
    t.copy_(recv.sum(0))


def _rank(ctx):
    r, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(1000 + r)
    differ = trials = 0
    for n in (1, 2, 3, 5, 7, 15):
        for _ in range(40):
            x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-30, 31, (n,), generator=g).float())
            a, b = x.clone(), x.clone()
            dist.all_reduce(a)
            _exchange(b)
            differ += int((a.view(torch.int32) != b.view(torch.int32)).sum())
            trials += n
    times = {}
    for name, fn, t in (("gloo fp32[1]", dist.all_reduce, torch.ones(1)),
                        ("exchange fp32[1]", _exchange, torch.ones(1)),
                        ("gloo int64[1]", dist.all_reduce, torch.ones(1, dtype=torch.int64)),
                        ("exchange int64[1]", _int_exchange, torch.ones(1, dtype=torch.int64))):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(200):
            fn(t)
        times[name] = (time.perf_counter() - t0) / 200 * 1e6
    return differ, trials, times


if __name__ == "__main__":
  for world in [int(w) for w in sys.argv[1:]] or [3, 4, 8]:
    res = launch(_rank, LaunchConfig(world_size=world, start_method="forkserver", deadline_s=600))
    differ = sum(r[0] for r in res)
    print(f"world {world}: {differ} of {sum(r[1] for r in res)} elements differ (gloo vs exchange);"
          " us per call on rank 0: " + ", ".join(f"{k} {v:.0f}" for k, v in res[0][2].items()))
