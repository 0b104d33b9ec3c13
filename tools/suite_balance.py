"""How well the xdist workers keep the CPUs busy: runs ``python -m pytest -n N -v ARGS``, notes when
each worker reports a test, samples the machine's busy share every second (/proc/stat, Linux), and
prints when each worker reported its last test, the CPU's idle share over the run, the windows of
``--window`` seconds or more in which the CPUs were under ``--busy`` percent busy, with the test
each worker was running then, and pytest's own summary line.

A worker's test runs from its previous report to its own (xdist reports a test when it ends). On a
CPU-bound suite an idle window is wall time that no cut of computation shortens: a worker waiting
(a timeout, a subprocess start) beside a worker that uses one CPU.

    python tools/suite_balance.py [-n 2] [--busy 80] [--window 3] [PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import threading
import time


def _cpu_jiffies() -> tuple[int, int]:
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return sum(fields), fields[3] + fields[4]  # total, idle + iowait


def _sample(t0: float, out: list, stop: threading.Event) -> None:
    """(seconds since t0, busy percent over the last second), appended every second until stop."""
    a = _cpu_jiffies()
    while not stop.wait(1.0):
        b = _cpu_jiffies()
        total, idle = b[0] - a[0], b[1] - a[1]
        out.append((time.time() - t0, 100.0 * (1 - idle / max(total, 1))))
        a = b


def _windows(samples: list, busy: float, min_len: float) -> list[tuple[float, float, float]]:
    """(start, end, mean busy %) of each run of samples under ``busy`` lasting ``min_len`` s or more."""
    out, run = [], []
    for t, b in samples + [(float("inf"), 100.0)]:
        if b < busy:
            run.append((t, b))
            continue
        if run and run[-1][0] - run[0][0] + 1.0 >= min_len:
            out.append((run[0][0] - 1.0, run[-1][0], sum(x for _, x in run) / len(run)))
        run = []
    return out


def _running(reports: list, worker: str, start: float, end: float) -> list[str]:
    """The tests ``worker`` ran during [start, end]: each from its previous report to its own."""
    mine = [(t, test) for w, t, test in reports if w == worker]
    prev, out = 0.0, []
    for t, test in mine:
        if t > start and prev < end:
            out.append(test)
        prev = t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", default="2")
    ap.add_argument("--busy", type=float, default=80.0, help="a second under this busy percent is idle-ish")
    ap.add_argument("--window", type=float, default=3.0, help="shortest idle window listed, in seconds")
    args, rest = ap.parse_known_args()
    before = _cpu_jiffies()
    t0 = time.time()
    samples: list = []
    stop = threading.Event()
    sampler = threading.Thread(target=_sample, args=(t0, samples, stop), daemon=True)
    sampler.start()
    reports: list[tuple[str, float, str]] = []
    summary = ""
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-n", args.n, "-v", "-p", "no:logging", *rest],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        m = re.match(r"\[(gw\d+)\]\s+\[\s*\d+%\]\s+\w+\s+(.+?)\s*$", line)  # ids may hold spaces
        if m:
            reports.append((m.group(1), time.time() - t0, m.group(2)))
        if re.search(r"\d+ passed", line):
            summary = line.strip()
    proc.wait()
    stop.set()
    sampler.join()
    total, idle = (b - a for a, b in zip(before, _cpu_jiffies()))
    last = {w: t for w, t, _ in reports}
    for worker, t in sorted(last.items()):
        print(f"{worker}: last test reported at {t:.1f} s")
    if last:
        print(f"workers ended {max(last.values()) - min(last.values()):.1f} s apart")
    print(f"CPU idle over the run: {100 * idle / max(total, 1):.1f}%")
    for start, end, mean in _windows(samples, args.busy, args.window):
        print(f"{start:.0f}-{end:.0f} s: {mean:.0f}% busy")
        for worker in sorted(last):
            print(f"  {worker}: {', '.join(_running(reports, worker, start, end)) or '-'}")
    print(summary)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
