"""Wall time of the world-8 EP-8 blockwise 30-step lockstep run on this machine, and the CPU time
the whole machine spent meanwhile (busy core-seconds from /proc/stat, Linux; run it on an otherwise
idle machine). Prints the numbers; asserts nothing. To compare two trees, `python tools/ab.py`
runs them alternately.

    python tools/bench_ep8.py [--steps 30] [--recipe blockwise] [--repeat 1] [--golden check|off] [--speed]
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
    ap.add_argument("--golden", choices=("check", "off"), default="off")
    ap.add_argument("--speed", action="store_true",
                    help="also read the machine's speed (tools/machine_speed.py) before and after the runs")
    args = ap.parse_args()
    if args.speed:
        print(f"machine speed before: {_speed()}")
    for i in range(args.repeat):
        with tempfile.TemporaryDirectory() as out:
            cmd = [sys.executable, "-m", "parity.cli", "run", "--recipe", args.recipe, "--ep", "8",
                   "--steps", str(args.steps), "--snapshot", "none", "--out", out, "--quiet",
                   "--golden", args.golden]
            cpu0, t0 = _busy_core_seconds(), time.perf_counter()
            r = subprocess.run(cmd, capture_output=True, text=True)
            wall, cpu1 = time.perf_counter() - t0, _busy_core_seconds()
            rep = json.load(open(os.path.join(out, "report.json")))
            (e,) = rep["scenarios"]
            print(f"run {i + 1}: exit {r.returncode}, status {e['status']}, {e['steps']} steps, "
                  f"{e['compared']} comparisons, wall {wall:.1f} s (scenario {e['elapsed_s']} s), "
                  f"{os.cpu_count()} CPUs" + ("" if cpu0 is None else
                                              f", machine CPU busy {cpu1 - cpu0:.1f} core-seconds"))
    if args.speed:
        print(f"machine speed after: {_speed()}")


def _speed() -> str:
    """One reading of tools/machine_speed.py, its line as printed (lower is faster)."""
    r = subprocess.run([sys.executable, os.path.join(os.path.dirname(__file__), "machine_speed.py"), "--repeat", "1"],
                       capture_output=True, text=True)
    return r.stdout.strip() or r.stderr.strip()


def _busy_core_seconds() -> float | None:
    """Non-idle CPU time of the whole machine so far (user, system, irq, ...), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:]]
    except OSError:
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # minus idle and iowait


if __name__ == "__main__":
    main()
