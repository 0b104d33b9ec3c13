"""The uneven all-gather of the LayerWise params on gloo: one broadcast per root (what
parity.distributed.collectives.all_gather_uneven_into does) against one all-gather of shards
padded to the largest, then unpadded. Prints milliseconds per gather; asserts nothing.

    python tools/bench_gather.py [--world 8] [--elements 20000] [--iters 100]
"""

from __future__ import annotations

import argparse
import os
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from parity.harness.launch import free_port


def _broadcasts(out, offsets, world):
    works = [dist.broadcast(out[offsets[r]:offsets[r + 1]], src=r, async_op=True) for r in range(world)]
    for w in works:
        w.wait()


def _padded_all_gather(out, offsets, world, sizes):
    m, me = max(sizes), dist.get_rank()
    send = torch.zeros(m, dtype=out.dtype)
    send[:sizes[me]] = out[offsets[me]:offsets[me + 1]]
    stage = torch.empty(world * m, dtype=out.dtype)
    dist.all_gather_into_tensor(stage, send)
    for r in range(world):
        out[offsets[r]:offsets[r + 1]].copy_(stage[r * m:r * m + sizes[r]])


def _rank(rank, world, port, elements, iters):
    warnings.filterwarnings("ignore", category=FutureWarning)  # all_gather_into_tensor's rename notice
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = [elements + 37 * r for r in range(world)]  # uneven, as LayerWise shards are
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + n)
    out = torch.zeros(offsets[-1], dtype=torch.bfloat16)
    for name in ("broadcasts", "padded all-gather", "broadcasts", "padded all-gather"):
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            if name == "broadcasts":
                _broadcasts(out, offsets, world)
            else:
                _padded_all_gather(out, offsets, world, sizes)
        dist.barrier()
        if rank == 0:
            print(f"{name}: {(time.perf_counter() - t0) / iters * 1e3:.2f} ms per gather "
                  f"({world} ranks, {os.cpu_count()} CPUs)", flush=True)
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--elements", type=int, default=20000, help="elements of the smallest shard")
    ap.add_argument("--iters", type=int, default=100)
    args = ap.parse_args()
    mp.spawn(_rank, args=(args.world, free_port(), args.elements, args.iters), nprocs=args.world)


if __name__ == "__main__":
    main()
