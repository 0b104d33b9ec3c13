"""What each test costs in CPU, not in wall: runs the suite one test at a time and reads the machine's
busy CPU time (/proc/stat, Linux) around each test, so a test's own ranks, subprocesses, torchrun
agents and fork-server children all count, and nothing else's. Under xdist a test's duration says
mostly what ran beside it; on a CPU-bound suite the CPU-seconds are what a cut saves.

Prints the tests with the most CPU-seconds, then the files, then the total (and the wall). Asserts
nothing. Background load on the machine counts as well: run it on an otherwise idle machine.

    python tools/suite_cpu.py [--top 40] [PYTEST_ARGS...]
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import tempfile
import time

import pytest
from bench_ep8 import _busy_core_seconds as _busy_s  # tools/ is on the path: this script's folder


class _Plugin:
    """Loaded into the pytest run below (``-p``): one line per test to the file in PARITY_SUITE_CPU."""

    def __init__(self, path: str):
        self.out = open(path, "a", buffering=1)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        b0, w0 = _busy_s(), time.monotonic()
        yield
        self.out.write(f"{_busy_s() - b0:.2f}\t{time.monotonic() - w0:.2f}\t{item.nodeid}\n")


def pytest_configure(config):  # this module as a pytest plugin
    path = os.environ.get("PARITY_SUITE_CPU")
    if path:
        config.pluginmanager.register(_Plugin(path), "parity-suite-cpu")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--top", type=int, default=40, help="tests to list (default 40)")
    args, rest = ap.parse_known_args()
    if any(a == "-n" or a.startswith(("-n", "--numprocesses")) for a in rest):
        print("suite_cpu: runs one test at a time by design; leave out -n", file=sys.stderr)
        return 2
    if _busy_s() is None:
        print("suite_cpu: needs Linux's /proc/stat", file=sys.stderr)
        return 2
    with tempfile.NamedTemporaryFile("r", suffix=".tsv") as rec:
        env = {**os.environ, "PARITY_SUITE_CPU": rec.name,
               "PYTHONPATH": os.pathsep.join(filter(None, [os.path.dirname(__file__), os.environ.get("PYTHONPATH")]))}
        b0, w0 = _busy_s(), time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_cpu", "-p", "no:xdist", "-q",
                               "-p", "no:logging", *rest], env=env, capture_output=True, text=True)
        busy, wall = _busy_s() - b0, time.monotonic() - w0
        rows = [line.rstrip("\n").split("\t") for line in rec if line.strip()]
    tests = sorted(((float(c), float(w), node) for c, w, node in rows), reverse=True)
    files: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for cpu, w, node in tests:
        f = files[node.split("::")[0]]
        f[0] += cpu
        f[1] += w
        f[2] += 1
    print(f"{'CPU s':>8} {'wall s':>8}  test")
    for cpu, w, node in tests[:args.top]:
        print(f"{cpu:8.2f} {w:8.2f}  {node}")
    print(f"\n{'CPU s':>8} {'wall s':>8} {'tests':>6}  file")
    for name, (cpu, w, n) in sorted(files.items(), key=lambda kv: -kv[1][0]):
        print(f"{cpu:8.1f} {w:8.1f} {n:6d}  {name}")
    in_tests = sum(t[0] for t in tests)
    print(f"\n{len(tests)} tests: {in_tests:.0f} CPU-seconds in tests, {busy:.0f} in the whole run "
          f"(collection, start, teardown included), {wall:.0f} s wall on {os.cpu_count()} CPUs")
    last = proc.stdout.strip().splitlines()[-1:] or proc.stderr.strip().splitlines()[-1:]
    print("pytest: " + (last[0] if last else f"exit {proc.returncode}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
