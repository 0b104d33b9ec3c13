"""Wall time of the world-8 EP-8 blockwise 30-step lockstep run (the issue's CPU target: <= 60 s
on the 2-core machine with the default tiny model). Prints the numbers; asserts nothing.

    python tools/bench_ep8.py [--steps 30] [--recipe blockwise] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--recipe", default="blockwise")
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "parity.cli", "run", "--recipe", args.recipe, "--ep", "8",
                   "--steps", str(args.steps), "--snapshot", "none", "--out", out, "--quiet"]
            t0 = time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            rep = json.load(open(os.path.join(out, "report.json")))
            (e,) = rep["scenarios"]
            print(f"run {i + 1}: exit {r.returncode}, status {e['status']}, {e['steps']} steps, "
                  f"{e['compared']} comparisons, wall {wall:.1f} s (scenario {e['elapsed_s']} s), "
                  f"{os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
