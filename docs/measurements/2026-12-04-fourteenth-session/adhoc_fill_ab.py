"""torch's fill of new tensors (deterministic mode's fill_uninitialized_memory) on and off,
alternated in one process: a single-rank lockstep pair (world 1, gloo) run N times with each
setting, in the order on, off, off, on, ... so that the machine's drift falls on both alike.
Prints each run's process CPU time and the mean ratio. Asserts nothing.

    python docs/measurements/2026-12-04-fourteenth-session/adhoc_fill_ab.py [--recipe mxfp8] [--moe] [--steps 4] [--pairs 6] [--rank-heap]
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist

from parity.distributed.determinism import apply_determinism
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario


class Ctx:
    device = "cpu"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="blockwise")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--pairs", type=int, default=6)
    ap.add_argument("--rank-heap", action="store_true",
                    help="the ranks' heap settings (launch._retain_freed_memory) in this process too")
    args = ap.parse_args()
    if args.rank_heap:
        from parity.harness.launch import _retain_freed_memory

        _retain_freed_memory()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    apply_determinism(num_threads=1)
    dist.init_process_group("gloo", rank=0, world_size=1)
    scen = make_scenario({"name": "fill-ab", "world": 1, "steps": args.steps, "recipe": args.recipe,
                          "moe": args.moe})
    opts = RunOptions(progress=False, golden_digests=True, snapshot="none")

    def once(fill: bool) -> float:
        torch.utils.deterministic.fill_uninitialized_memory = fill
        t0 = time.process_time()
        res = rank_main(Ctx(), scen, opts)
        assert not res["divergences"]
        return time.process_time() - t0

    once(True)  # warm-up: imports, caches
    cpu = {True: [], False: []}
    for i in range(args.pairs):
        for fill in ((True, False) if i % 2 == 0 else (False, True)):
            cpu[fill].append(once(fill))
            print(f"pair {i + 1}, fill {'on ' if fill else 'off'}: {cpu[fill][-1]:.3f} s CPU", flush=True)
    on, off = statistics.fmean(cpu[True]), statistics.fmean(cpu[False])
    print(f"{args.recipe} {'moe' if args.moe else 'dense'} world 1, {args.steps} steps"
          f"{', rank heap settings' if args.rank_heap else ''}: fill on {on:.3f} s, "
          f"off {off:.3f} s CPU (mean of {args.pairs}); off / on = {off / on:.3f}")


if __name__ == "__main__":
    main()
