"""What two per-rank process settings save on the CPU: freed memory kept in the heap
(LaunchConfig.retain_freed_memory) and the start-up objects frozen out of the garbage collector
(LaunchConfig.freeze_start_objects). Runs one scenario with both settings on and both off,
alternately, in this one process, and prints the wall time, each rank's mean CPU time, page
faults and time in the garbage collector, and the largest peak RSS of a rank. Prints numbers; asserts nothing.

    python tools/bench_rank_memory.py [SCENARIO] [--steps 8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from parity.harness.driver import rank_main_with_heartbeat, launch_config
from parity.harness.launch import launch
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_all


def _once(scenario, on: bool) -> dict:
    cfg = dataclasses.replace(launch_config(scenario, 120.0, False),
                              retain_freed_memory=on, freeze_start_objects=on)
    opts = RunOptions(progress=False, snapshot="none", golden_digests=False)
    t0 = time.perf_counter()
    results = launch(rank_main_with_heartbeat, cfg, scenario, opts)
    wall = time.perf_counter() - t0
    cpu = [r["cpu"] for r in results]
    mean = {k: statistics.fmean(c[k] for c in cpu) for k in ("user_s", "system_s", "page_faults", "gc_s")}
    peak = max(r["memory"]["peak_rss_bytes"] for r in results) / 2**20
    return {"wall_s": wall, **mean, "peak_rss_mib": peak}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", nargs="?", default="mxfp8-moe-w4-ep1-overlap-on")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    (scenario,) = [s for s in load_all() if s.name == args.scenario]
    scenario = scenario.prefix(args.steps) if args.steps < scenario.steps else scenario
    _once(scenario, True)  # the fork server starts, and every import is warm, before anything is timed
    rows = {True: [], False: []}
    for i in range(args.repeat):
        for on in ((True, False) if i % 2 == 0 else (False, True)):
            r = _once(scenario, on)
            rows[on].append(r)
            print(f"run {i + 1}, settings {'on ' if on else 'off'}: wall {r['wall_s']:.2f} s, per rank: user "
                  f"{r['user_s']:.2f} s, system {r['system_s']:.2f} s, {r['page_faults']:.0f} page faults, "
                  f"{r['gc_s']:.3f} s in the garbage collector; largest peak RSS {r['peak_rss_mib']:.0f} MiB",
                  flush=True)
    print(f"{scenario.name}, world {scenario.world}, {scenario.steps} steps, means over {args.repeat} runs:")
    for on in (True, False):
        m = {k: statistics.fmean(r[k] for r in rows[on]) for k in rows[on][0]}
        print(f"  settings {'on ' if on else 'off'}: wall {m['wall_s']:.2f} s, per rank: user {m['user_s']:.2f} s, "
              f"system {m['system_s']:.2f} s, {m['page_faults']:.0f} page faults, "
              f"{m['gc_s']:.3f} s in the garbage collector; largest peak RSS "
              f"{m['peak_rss_mib']:.0f} MiB")


if __name__ == "__main__":
    main()
