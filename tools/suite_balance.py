"""How well the two xdist workers share the suite: runs ``python -m pytest -n N -v ARGS``, notes when
each worker reports a test, reads /proc/stat before and after (Linux), and prints when each worker
reported its last test, the CPU's idle share over the run, and pytest's own summary line.

    python tools/suite_balance.py [-n 2] [PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time


def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="2")
    args, rest = ap.parse_known_args()
    before = _cpu_jiffies()
    t0 = time.time()
    last: dict[str, float] = {}
    summary = ""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-n", args.n, "-v", "-p", "no:logging", *rest],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.match(r"\[(gw\d+)\]", line)
        if m:
            last[m.group(1)] = time.time() - t0
        if re.search(r"\d+ passed", line):
            summary = line.strip()
    proc.wait()
    total, idle = (b - a for a, b in zip(before, _cpu_jiffies()))
    for worker, t in sorted(last.items()):
        print(f"{worker}: last test reported at {t:.1f} s")
    if last:
        print(f"workers ended {max(last.values()) - min(last.values()):.1f} s apart")
    print(f"CPU idle over the run: {100 * idle / max(total, 1):.1f}%")
    print(summary)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
