"""Memory report: per-buffer numel / unpadded numel / padding for the compact and the padded
LayerWise layouts, and the persistent bytes of the Muon matrices with FP8 param gather ON vs OFF.

    python tools/memory_report.py [--world 4] [--moe] [--recipe blockwise] [--json FILE]
"""

from __future__ import annotations

import argparse
import json


def _rank(ctx, world, moe, recipe, bucket):
    import torch

    from parity.distributed.groups import build_groups
    from parity.harness.scenario import make_scenario
    from parity.optim.stack import Stack

    groups = build_groups(1)
    out = {}
    for layout, fp8 in (("compact", True), ("compact", False), ("padded", False)):
        # overlap on in every arm: without it every buffer is one bucket (docs/spec/megatron.md s2.5)
        s = make_scenario({"name": "mem", "world": world, "moe": moe, "recipe": recipe, "layout": layout,
                           "bucket_size": bucket, "pair": "fp8_param_gather" if fp8 else "overlap_param_gather",
                           "fp8_param_gather": fp8, "overlap": True})
        cfg = s.stack_configs()[0]
        st = Stack(cfg, groups, torch.device("cpu"))
        out[f"{layout}/fp8={'on' if fp8 else 'off'}"] = {
            "buffers": st.ddp.buffer_report(), **st.persistent_bytes()}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--recipe", default="blockwise")
    ap.add_argument("--bucket-size", type=int, default=4096)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from parity.harness.launch import LaunchConfig, launch

    res = launch(_rank, LaunchConfig(world_size=args.world, prefix_output=False), args.world, args.moe,
                 args.recipe, args.bucket_size)[0]
    for arm, r in res.items():
        print(f"== {arm}: Muon matrices persist {r['muon_param_bytes']:,} bytes as params"
              f" (+{r['off_fp8_weight_copy_bytes']:,} bytes of on-the-fly FP8 weight copies)")
        for b in r["buffers"]:
            print(f"   {b['key']:34s} numel={b['numel']:>9,} unpadded={b['numel_unpadded']:>9,} "
                  f"padding={b['padding']:>7,} ({b['padding_pct']:.2f}%) buckets={b['buckets']}")
        lw = [b for b in r["buffers"] if "layerwise" in b["key"]]
        lw_pad = sum(b["padding"] for b in lw)
        lw_tot = sum(b["numel"] for b in lw)
        print(f"   LayerWise buffers: padding {lw_pad:,} of {lw_tot:,} ({100 * lw_pad / max(lw_tot, 1):.2f}%)")
    on, off = res["compact/fp8=on"]["muon_total_bytes"], res["compact/fp8=off"]["muon_total_bytes"]
    print(f"Muon matrix bytes ON/OFF (params + FP8 weight copies): {on:,} / {off:,} = {on / off:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
