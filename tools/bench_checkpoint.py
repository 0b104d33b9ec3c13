"""Checkpoint size and save/load time of a scenario's pair (both sides), printed as numbers.

Every rank builds the scenario's two stacks and trains them a few steps (so Muon and Adam state
exist). Then each repeat saves both sides through torch.distributed.checkpoint, the way a
``resume_at`` scenario does (atomic directory, marker with sha256 of every file), verifies the
checkpoint as the parent does before a resume (reads and hashes every file), and loads it back
into the stacks. Times are the slowest rank's, the median over repeats. After the last load every
tensor of the stacks must equal what was saved (checked bit for bit).

    python tools/bench_checkpoint.py                          # the default scenario on CPU
    python tools/bench_checkpoint.py --device cuda --world 1 --ep 1 --medium
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

MEDIUM = dict(hidden=1024, ffn_hidden=4096, num_heads=8, num_layers=4, seq_len=1024, micro_batch=4,
              vocab_size=1024, moe_ffn_hidden=1024)


def rank_work(ctx, scenario, train_steps, repeats, root):
    import torch
    import torch.distributed as dist

    from parity.distributed.groups import build_groups
    from parity.harness import resume
    from parity.harness.snapshot import tensor_sha256
    from parity.optim import checkpoint as ckpt
    from parity.optim.stack import Stack
    from parity.vocab import Side

    device = torch.device(ctx.device)
    groups = build_groups(scenario.ep)
    cfg_test, cfg_ref = scenario.stack_configs()
    stacks = {Side.TEST: Stack(cfg_test, groups, device), Side.REF: Stack(cfg_ref, groups, device)}
    for step in range(train_steps):
        for st in stacks.values():
            st.step(step, lambda step, phase, tensors, complete=True: None)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def digests():
        out = {}
        for side, st in stacks.items():
            for k, v in ckpt.stack_state(st, prefix=f"{side}/").items():
                if torch.is_tensor(v) and type(v) is torch.Tensor:  # ShardedTensor chunks are copies
                    out[k] = tensor_sha256(v.detach())
        return out

    before = digests()
    rows = []
    for r in range(repeats):
        path = os.path.join(root, f"ckpt{r}")
        sync()
        saved = resume.save_pair(path, scenario, stacks, train_steps, device)
        t0 = time.perf_counter()
        if ctx.rank == 0:
            resume.check_checkpoint(path, dataclasses.replace(scenario, steps=train_steps + 1), reshard=False)
        verify_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        _, info = resume.load_pair(path, scenario, stacks, device, reshard=False)
        sync()
        load_s = time.perf_counter() - t0
        rows.append({"save_s": saved["seconds"], "write_s": saved.get("write_s"), "marker_s": saved.get("marker_s"),
                     "verify_s": verify_s, "load_s": load_s, "dcp_load_s": info["load_s"],
                     "bytes": saved["bytes"], "files": saved["files"]})
        dist.barrier()
        if ctx.rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    after = digests()
    bad = sorted(k for k in before if before[k] != after.get(k))
    return {"rows": rows, "changed": bad[:5], "n_changed": len(bad), "n_tensors": len(before)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", nargs="?", default="default")
    ap.add_argument("--device", choices=("cpu", "cuda"))
    ap.add_argument("--world", type=int)
    ap.add_argument("--ep", type=int)
    ap.add_argument("--recipe", choices=("blockwise", "mxfp8"))
    ap.add_argument("--medium", action="store_true", help="the medium model of tools/bench_step.py")
    ap.add_argument("--train-steps", type=int, default=2, help="steps before the first save")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp dir)")
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()

    from parity.harness.driver import launch_config
    from parity.harness.launch import launch
    from parity.harness.scenario import load_all, make_scenario

    known = {s.name: s for s in load_all()}
    if args.scenario not in known:
        sys.exit(f"bench_checkpoint: unknown scenario {args.scenario!r}")
    raw = known[args.scenario].to_dict()
    raw.update({k: v for k, v in (("device", args.device), ("world", args.world), ("ep", args.ep),
                                  ("recipe", args.recipe)) if v is not None})
    if args.medium:
        raw["model"] = {**raw["model"], **MEDIUM}
    raw.update(name=f"bench-{args.scenario}", steps=args.train_steps + 1, resume_at=None, resume_world=None)
    scenario = make_scenario(raw)
    root = args.dir or tempfile.mkdtemp(prefix="parity-bench-ckpt-")
    try:
        cfg = launch_config(scenario, timeout_s=600.0, allow_nondeterministic=False)
        results = launch(rank_work, cfg, scenario, args.train_steps, args.repeats, root)
    finally:
        if not args.dir:
            shutil.rmtree(root, ignore_errors=True)
    per_repeat = [{k: (max(r["rows"][i][k] for r in results) if k.endswith("_s") else results[0]["rows"][i][k])
                   for k in results[0]["rows"][i]} for i in range(args.repeats)]
    med = {k: statistics.median(row[k] for row in per_repeat) for k in per_repeat[0]}
    changed = sum(r["n_changed"] for r in results)
    out = {"scenario": args.scenario, "world": scenario.world, "ep": scenario.ep, "device": scenario.device,
           "recipe": scenario.recipe, "medium": args.medium, "train_steps": args.train_steps,
           "repeats": args.repeats, "median": med, "per_repeat": per_repeat,
           "tensors_checked": sum(r["n_tensors"] for r in results), "tensors_changed_by_round_trip": changed}
    print(f"scenario {args.scenario}: world {scenario.world}, ep {scenario.ep}, {scenario.device}, "
          f"{scenario.recipe}{', medium model' if args.medium else ''}; both sides, after {args.train_steps} steps")
    print(f"checkpoint size: {med['bytes'] / 1e6:.2f} MB in {int(med['files'])} files")
    print(f"save: {med['save_s']:.3f} s (DCP write {med['write_s']:.3f} s, marker: sha256 + rename "
          f"{med['marker_s']:.3f} s)")
    print(f"verify before load (parent: read + sha256 every file): {med['verify_s']:.3f} s")
    print(f"load: {med['load_s']:.3f} s (DCP read {med['dcp_load_s']:.3f} s)")
    print(f"round trip: {out['tensors_checked']} rank-local tensors, {changed} changed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if changed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
