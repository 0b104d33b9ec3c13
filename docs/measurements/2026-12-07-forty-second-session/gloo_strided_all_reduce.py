"""torch's gloo all_reduce on a strided view: what it returns (the measurement behind
parity.distributed.collectives.all_reduce_sum's refusal of non-contiguous tensors)."""
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank(r):
    dist.init_process_group("gloo", rank=r, world_size=2)
    t = (torch.arange(8, dtype=torch.float32) * (r + 1))[::2]  # [0, 2, 4, 6] * (r + 1)
    dist.all_reduce(t)
    if r == 0:
        print(f"torch {torch.__version__}: gloo all_reduce of (arange(8) * (rank + 1))[::2] at world 2: "
              f"{t.tolist()}, the sum is {[0.0, 6.0, 12.0, 18.0]}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    mp.spawn(rank, nprocs=2)
