"""When do FP8 weight scales flip? Steps a scenario's stack under test (FP8 param gather ON) on
its own ranks and prints, per step, how many weight blocks changed their scale exponent, how many
are all zero (zero rule), and how many sit at the bottom clamp (blockwise scale 2^127 / mxfp8
E8M0 0), read from the persisted FP8 weights after each step's param sync. A flip is a scale
change of a block that is non-zero before and after (a pow2 exponent step); blocks leaving the
zero rule are counted apart. Prints numbers; asserts nothing.

    python tools/scale_flips.py [SCENARIO] [--steps N] [--lr LR] [--stress a,b|none] [--json FILE]

SCENARIO is a scenario name (default: `default`) or NAME from a .toml given with --file.
"""

from __future__ import annotations

import argparse
import json

KEYS = ("flips", "unzeroed", "zero", "clamp", "blocks")


def _rank(ctx, scenario):
    import warnings

    import torch
    import torch.distributed as dist

    from parity.distributed.groups import build_groups
    from parity.model import is_quantized_param
    from parity.model.edges import FlipCounter
    from parity.optim.stack import Stack

    warnings.filterwarnings("ignore", category=FutureWarning)  # torch renames of collectives
    groups = build_groups(scenario.ep)
    cfg = scenario.stack_configs()[0]  # the stack under test: FP8 params persisted
    stack = Stack(cfg, groups, torch.device(ctx.device))
    fp8 = [(stack.names[p], p) for p in stack.params if is_quantized_param(p)]
    rows = {name: [] for name, _ in fp8}
    counters = {name: FlipCounter() for name, _ in fp8}  # per param: replicas are merged by name

    def observe(step):
        for name, p in fp8:
            r = counters[name].observe([(name, p.qt)])
            rows[name].append({"step": step, **{k: r[k] for k in KEYS}})

    observe(-1)  # init: the persisted bytes before any update
    for step in range(scenario.steps):
        stack.step(step, lambda step, phase, tensors, complete=True: None)
        observe(step)
    dist.barrier()
    return rows


def merge(per_rank: list[dict]) -> tuple[list[dict], dict]:
    """Sum over distinct params (replicas on several ranks hold the same bytes: count once)."""
    params = {}
    for rows in per_rank:
        for name, r in rows.items():
            params.setdefault(name, r)
    steps = len(next(iter(params.values())))
    table = []
    for i in range(steps):
        t = {"step": params[next(iter(params))][i]["step"]}
        for k in KEYS:
            t[k] = sum(r[i][k] for r in params.values())
        t["params_flipped"] = sorted(n for n, r in params.items() if r[i]["flips"])
        table.append(t)
    return table, params


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", nargs="?", default="default")
    ap.add_argument("--file", default=None, help="scenario .toml holding SCENARIO (default: scenarios/)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--lr", type=float, default=None)
    ap.add_argument("--stress", default=None, help="comma-separated stress options, or 'none'")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()

    from parity.harness.driver import launch_config
    from parity.harness.launch import launch
    from parity.harness.scenario import load_all, load_file, make_scenario

    pool = load_file(args.file) if args.file else load_all()
    found = [s for s in pool if s.name == args.scenario]
    if not found:
        raise SystemExit(f"scale_flips: unknown scenario {args.scenario!r}")
    raw = found[0].to_dict()
    for key in ("resume_at", "resume_world"):  # this tool steps the stack only, never resumes
        raw.pop(key, None)
    if args.steps is not None:
        raw["steps"] = args.steps
    if args.lr is not None:
        raw["lr"] = args.lr
    if args.stress is not None:
        raw["stress"] = [] if args.stress == "none" else args.stress.split(",")
    s = make_scenario(raw, source="scale_flips")
    per_rank = launch(_rank, launch_config(s, 300.0, False), s)
    table, params = merge(per_rank)
    print(f"scenario {s.name}: recipe {s.recipe}, world {s.world}, ep {s.ep}, moe {s.moe}, lr {s.lr}, "
          f"stress {list(s.stress) or 'none'}; {len(params)} FP8 weights, {table[0]['blocks']} blocks")
    print("| step | pow2 scale flips | params with a flip | zero -> non-zero | all-zero blocks | "
          "clamped blocks |")
    print("|---|---|---|---|---|---|")
    for t in table:
        step = "init" if t["step"] < 0 else t["step"]
        print(f"| {step} | {t['flips']} | {len(t['params_flipped'])} | {t['unzeroed']} | {t['zero']} | "
              f"{t['clamp']} |")
    first = next((t for t in table if t["flips"]), None)
    if first is None:
        print(f"first flip: none in {s.steps} steps")
    else:
        print(f"first flip: step {first['step']} ({first['flips']} blocks, first param "
              f"{first['params_flipped'][0]})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"scenario": s.to_dict(), "table": table,
                       "first_flip_step": None if first is None else first["step"]}, f, indent=1)


if __name__ == "__main__":
    main()
