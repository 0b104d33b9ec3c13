"""Every catalogued fault on every scenario of the quick set (3 steps each, fail-fast): which
scenarios show it (fail or error), which run it clean, and whether its deviation ran at all (the
stacks' record; an errored run returns none). Prints one TSV row per pair.

    python docs/measurements/2026-12-06-twenty-seventh-session/adhoc_fault_matrix.py [FAULT...]
"""
import sys
import time

from parity.harness.driver import run_scenario
from parity.harness.faults import CATALOGUE, Injection
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_set


def main():
    faults = sys.argv[1:] or [str(f) for f in CATALOGUE]
    scenarios = load_set("quick")
    print("fault\tscenario\tstatus\tfired\tseconds", flush=True)
    for name in faults:
        for s in scenarios:
            opts = RunOptions(injections=(Injection("fault", name=name),), progress=False, snapshot="none",
                              golden_digests=False, fail_fast=True)
            t0 = time.perf_counter()
            entry, _ = run_scenario(s, opts, timeout_s=60)
            fired = "-" if entry["status"] == "error" else "yes" if name in entry["faults_fired"] else "no"
            print(f"{name}\t{s.name}\t{entry['status']}\t{fired}\t{time.perf_counter() - t0:.1f}", flush=True)


if __name__ == "__main__":
    main()
