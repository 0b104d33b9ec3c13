"""Steps to detection: inject catalogued faults into scenarios and print where each is first
caught (step / phase / tensor), stopping each run at its first divergent step. Prints numbers;
asserts nothing.

    python tools/edge_detection.py --fault F [--fault G ...] [--steps N] [--lr LR]
                                   [--stress a,b|none] SCENARIO [SCENARIO ...]

SCENARIO: a shipped scenario name. --steps/--lr/--stress override every scenario given.
"""

from __future__ import annotations

import argparse
import json
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenarios", nargs="+")
    ap.add_argument("--fault", action="append", required=True)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--stress", default=None, help="comma-separated stress options, or 'none'")
    ap.add_argument("--json", default=None)
    ap.add_argument("--timeout", type=float, default=300.0, help="collective timeout in seconds")
    args = ap.parse_args()

    from parity.harness.driver import run_scenario
    from parity.harness.faults import parse_injection
    from parity.harness.runner import RunOptions
    from parity.harness.scenario import load_all, make_scenario

    known = {s.name: s for s in load_all()}
    rows = []
    print("| fault | scenario | steps run | first caught (step / phase / tensor) |")
    print("|---|---|---|---|")
    for fault in args.fault:
        inj = parse_injection(fault)
        for name in args.scenarios:
            if name not in known:
                raise SystemExit(f"edge_detection: unknown scenario {name!r}")
            raw = known[name].to_dict()
            for key, v in (("steps", args.steps), ("lr", args.lr)):
                if v is not None:
                    raw[key] = v
            if args.stress is not None:
                raw["stress"] = [] if args.stress == "none" else args.stress.split(",")
            s = make_scenario(raw, source="edge_detection")
            t0 = time.perf_counter()
            entry, _ = run_scenario(s, RunOptions(injections=(inj,), fail_fast=True, progress=False,
                                                  snapshot="none", golden_digests=False), timeout_s=args.timeout)
            fd = entry.get("first_divergence")
            failed = entry.get("failed_checks") or []
            if entry["status"] == "error":
                seen = "error: " + " ".join((entry.get("error") or "").split())[:120]
            elif fd:
                seen = f"step {fd['step']} / {fd['phase']} / {fd['tensor']}"
            elif failed:
                seen = f"check {failed[0]['check']} at step {failed[0]['step']}"
            else:
                seen = f"not caught in {s.steps} steps"
            rows.append({"fault": fault, "scenario": s.to_dict(), "caught": seen,
                         "step": fd["step"] if fd else None, "seconds": round(time.perf_counter() - t0, 1)})
            print(f"| {fault} | {name} | {s.steps} | {seen} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
