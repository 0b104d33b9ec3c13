"""A gloo rank whose watcher thread dumps every thread's stack with faulthandler (parity's
watcher read the main thread's stack this way every 0.5 s) while the main thread runs small
all-gathers.

    python gloo_watch_race.py WORLD STEPS TENSOR WATCH
    TENSOR: numpy (a numpy-owned tensor goes into the collective) or torch (a torch-owned copy)
    WATCH:  dump (every 0.5 ms) or off
"""
import faulthandler, os, sys, tempfile, threading, time, warnings

import numpy as np
import torch
import torch.distributed as dist


def main(rank, world, port, n, tensor, watch):
    faulthandler.enable(all_threads=False)
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)

    def dumper():
        with tempfile.TemporaryFile() as f:
            while True:
                time.sleep(0.0005)
                os.lseek(f.fileno(), 0, 0)
                faulthandler.dump_traceback(f.fileno(), all_threads=True)

    if watch == "dump":
        threading.Thread(target=dumper, daemon=True).start()
    t0 = time.time()
    for _ in range(n):
        t = torch.from_numpy(np.full(32, rank, np.uint8))
        if tensor == "torch":
            t = t.clone()
        out = torch.empty(32 * world, dtype=torch.uint8)
        dist.all_gather_into_tensor(out, t)
        del t, out
    dist.barrier()
    print(f"rank {rank}: {n} all-gathers in {time.time() - t0:.1f} s, no crash", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    import torch.multiprocessing as mp

    world, n, tensor, watch = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    try:
        mp.spawn(main, args=(world, 29500 + os.getpid() % 1000, n, tensor, watch), nprocs=world)
    except mp.ProcessExitedException as e:
        print(f"{tensor}/{watch}: {e}")
        sys.exit(1)
