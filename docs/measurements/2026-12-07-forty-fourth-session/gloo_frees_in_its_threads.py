"""In which thread is a numpy-owned tensor freed, after a gloo all-gather that the Python side
dropped first? A weakref.finalize on the numpy array runs in the thread that frees it: a gloo
thread there means that thread took the GIL (and made a Python thread state to do so).

    python gloo_frees_in_its_threads.py WORLD STEPS
"""
import os, sys, threading, warnings, weakref

import numpy as np
import torch
import torch.distributed as dist


def main(rank, world, port, n):
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    main_id = threading.get_ident()
    foreign = []
    for _ in range(n):
        a = np.full(32, rank, np.uint8)
        t = torch.from_numpy(a)
        weakref.finalize(a, lambda: foreign.append(threading.get_ident()) if threading.get_ident() != main_id else None)
        del a
        out = torch.empty(32 * world, dtype=torch.uint8)
        dist.all_gather_into_tensor(out, t)
        del t, out
    dist.barrier()
    print(f"rank {rank}: {len(foreign)} of {n} freed in another thread ({len(set(foreign))} distinct)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, n = int(sys.argv[1]), int(sys.argv[2])
    mp.spawn(main, args=(world, 29500 + os.getpid() % 1000, n), nprocs=world)
