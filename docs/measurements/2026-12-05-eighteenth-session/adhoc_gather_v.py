"""Ad hoc: an uneven all-gather on gloo, CPU ranks started by parity's launcher (bound as in a run):
one broadcast per rank (parity's all_gather_uneven_into) against one all_to_all_single whose
input is this rank's slot repeated once per peer. Bits compared; wall per call on rank 0 and CPU per
call (mean over ranks). Prints; asserts nothing.

    python adhoc_gather_v.py [world ...]
"""
import resource
import sys
import time

import torch
import torch.distributed as dist

from parity.distributed import collectives as C
from parity.harness.launch import LaunchConfig, launch


def _cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _a2a(out, mine, sizes):
    world = len(sizes)
    send = mine.expand(world, -1).reshape(-1)  # my slot once per peer
    dist.all_to_all_single(out, send, output_split_sizes=sizes, input_split_sizes=[mine.numel()] * world)


def _rank(ctx, total, calls):
    r, world = dist.get_rank(), dist.get_world_size()
    base = total // world
    sizes = [base + (i % 3) * 17 for i in range(world)]  # uneven
    mine = torch.full((sizes[r],), r, dtype=torch.uint8) + torch.arange(sizes[r]).to(torch.uint8)
    a = torch.empty(sum(sizes), dtype=torch.uint8)
    b = torch.empty(sum(sizes), dtype=torch.uint8)
    C.all_gather_uneven_into(a, mine, sizes)
    _a2a(b, mine, sizes)
    same = torch.equal(a, b)
    res = {}
    for name, fn in (("broadcasts", lambda: C.all_gather_uneven_into(a, mine, sizes)),
                     ("all-to-all", lambda: _a2a(b, mine, sizes))) * 2:
        dist.barrier()
        w, c = time.perf_counter(), _cpu()
        for _ in range(calls):
            fn()
        res[name] = ((time.perf_counter() - w) / calls * 1e6, (_cpu() - c) / calls * 1e6)
    return same, res


if __name__ == "__main__":
    for world in [int(w) for w in sys.argv[1:]] or [4, 8]:
        for total in (4096, 65536, 524288):
            out = launch(_rank, LaunchConfig(world_size=world, deadline_s=600), total, 100)
            cpu = {k: sum(o[1][k][1] for o in out) / world for k in out[0][1]}
            print(f"world {world}, {total} bytes: same bits {all(o[0] for o in out)}; "
                  + "; ".join(f"{k} {out[0][1][k][0]:.0f} us wall, {cpu[k]:.0f} us CPU/rank" for k in out[0][1]))
