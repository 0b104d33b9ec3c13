"""Torch ops per rank and step of a `parity run --profile ops` run, by issuing parity function and
by op: where a rank's ops pile up, in a count that does not drift with the machine's speed (every
op costs several microseconds of fixed overhead on CPU). A count, not a time: ops differ in cost,
so time a change too (tools/bench_ep8.py). Prints the numbers; asserts nothing. Compare two trees
by running the same scenario in each.

    parity run --recipe blockwise --ep 8 --steps 4 --golden off --profile ops --out OUT
    python tools/op_counts.py OUT [--top 25]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the --out directory of a `parity run --profile ops`")
    ap.add_argument("--top", type=int, default=25, help="rows of each table")
    args = ap.parse_args()
    with open(os.path.join(args.out, "report.json")) as f:
        entries = json.load(f)["scenarios"]
    for e in entries:
        folder = glob.escape(os.path.join(args.out, "profile", e["name"]))  # names hold [ ]
        files = sorted(glob.glob(os.path.join(folder, "rank*.ops.json")))
        if not files:
            print(f"{e['name']}: no op counts (run with --profile ops)")
            continue
        by_function, by_op, total = defaultdict(int), defaultdict(int), 0
        for path in files:
            with open(path) as f:
                c = json.load(f)
            total += c["total"]
            for k, n in c["by_function"].items():
                by_function[k] += n
            for k, n in c["by_op"].items():
                by_op[k] += n
        per = len(files) * e["steps"]  # rank-steps (both stacks of the pair, the harness included)
        print(f"{e['name']}: {total} ops over {len(files)} rank files x {e['steps']} steps = "
              f"{total / per:.0f} per rank-step")
        for title, table in (("by parity function", by_function), ("by op", by_op)):
            print(f"  {title} (per rank-step, share)")
            for k, n in sorted(table.items(), key=lambda kv: -kv[1])[: args.top]:
                print(f"    {n / per:9.1f}  {100 * n / total:5.1f}%  {k}")


if __name__ == "__main__":
    main()
