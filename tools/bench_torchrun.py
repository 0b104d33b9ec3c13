"""Wall time of `parity run` under torchrun on this host: two torchrun agents on 127.0.0.1 stand in
for two nodes (``--nnodes 2 --nproc-per-node 2``, c10d rendezvous), and, for comparison, the same
scenario with the built-in launcher. The scenario is the torchrun tests' (tests/assets/tiny4.toml:
world 4, EP 2, MoE, one layer, 3 steps).
Prints seconds from start to the last process's exit; asserts nothing. To compare two trees, run
it in each (from the tree's root), alternately.

    python tools/bench_torchrun.py [--repeat 1]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parity.harness.launch import free_port

SCENARIO = Path(__file__).parents[1] / "tests" / "assets" / "tiny4.toml"


def _timed(cmds: list[list[str]], cwd: str) -> tuple[float, list[int]]:
    t = time.perf_counter()
    procs = [subprocess.Popen(c, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in cmds]
    codes = [p.wait() for p in procs]
    return time.perf_counter() - t, codes


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    here = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeat):
            port = free_port()
            agents = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(n),
                       "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                       "--rdzv-id", f"bench{port}", "--max-restarts", "0", "-m", "parity.cli", "run", str(SCENARIO),
                       "--golden", "off", "--out", f"{tmp}/tr{i}"] for n in (0, 1)]
            tr, tr_codes = _timed(agents, here)
            bi, bi_codes = _timed([[sys.executable, "-m", "parity.cli", "run", str(SCENARIO), "--golden", "off",
                                    "--out", f"{tmp}/bi{i}"]], here)
            print(f"run {i + 1}: torchrun (2 agents x 2 ranks) {tr:.1f} s, exit {tr_codes}; "
                  f"built-in launcher {bi:.1f} s, exit {bi_codes}; {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
