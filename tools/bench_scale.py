"""How parity's cost grows with the model: tiny -> medium -> large (about 1B parameters).

For each model size it runs the real command, `parity run` on a generated scenario (world 1,
blockwise, dense; `large-moe`: 8 experts), and reads report.json's timing (parity/harness/timing.py):

- step time ON vs OFF: the stacks' own phase times, the same run, side by side;
- harness overhead: (ON + OFF + harness work) / (ON + OFF) in that run, per step (the one forward
  after the last step that captures its params, ``flush``, is a cost per run: shown on its own);
- peak memory: device (CUDA) and host (RSS) of the rank;
- rank start-up and stack construction.

With ``--snapshot-size SIZE`` it also runs SIZE with ``--snapshot all`` for 2 and for
``--snapshot-steps`` steps: host memory must not grow with the steps (one step's tensors at a
time), and the snapshot write rate is set against this disk's sequential write rate (a file of
``--disk-gib`` GiB written with fsync, in the same output directory).

Prints a table; writes ``scale.json``, ``scale.md`` and ``scale.png`` to ``--out``.

    python tools/bench_scale.py --device cuda --out docs/measurements/scale
    python tools/bench_scale.py --device cpu --sizes tiny --steps 3 --out /tmp/scale   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

SIZES = {
    "tiny": {},  # the default model (parity/model/config.py)
    "medium": dict(hidden=1024, ffn_hidden=4096, num_heads=8, num_layers=4, seq_len=1024, micro_batch=4,
                   vocab_size=1024),
    "large": dict(hidden=2048, ffn_hidden=8192, num_heads=16, num_layers=15, seq_len=1024, micro_batch=4,
                  vocab_size=1024),
    "large-moe": dict(hidden=2048, ffn_hidden=8192, num_heads=16, num_layers=8, seq_len=1024, micro_batch=4,
                      vocab_size=1024, moe=True, num_experts=8, moe_topk=2, moe_ffn_hidden=2048),
}
ROOT = Path(__file__).resolve().parent.parent


def toml_of(name: str, device: str, model: dict) -> str:
    moe = bool(model.get("moe"))
    inner = ", ".join(f"{k} = {json.dumps(v)}" for k, v in model.items() if k != "moe")
    return (f'name = "{name}"\ndevice = "{device}"\nrecipe = "blockwise"\nworld = 1\nep = 1\n'
            f"moe = {'true' if moe else 'false'}\noverlap = false\nsteps = 30\n"
            + (f"model = {{ {inner} }}\n" if inner else ""))


def run(scen: Path, out: Path, steps: int, snapshot: str, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "parity.cli", "run", str(scen), "--steps", str(steps), "--golden", "off",
           "--snapshot", snapshot, "--out", str(out), "--quiet", "--timeout", str(timeout)]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    e["process_wall_s"] = round(wall, 2)
    return e


def row(size: str, e: dict) -> dict:
    t = e["timing"]
    timed = [s for s in t["per_step"] if s["step"] >= 1]  # step 0 warms up (kernel compiles, caches)
    steps = len(timed)
    tot: dict = {"test": {}, "ref": {}, "harness": {}}
    for s in timed:
        for kind in tot:
            for k, v in s.get(kind, {}).items():
                tot[kind][k] = tot[kind].get(k, 0.0) + v
    on = sum(v for k, v in tot["test"].items() if k != "init")
    off = sum(v for k, v in tot["ref"].items() if k != "init")
    flush = tot["harness"].get("flush", 0.0)  # once per run, not per step
    harness = sum(tot["harness"].values()) - flush
    return {
        "size": size, "params": sum(b["numel_unpadded"] for b in e["buffers"]), "steps": steps,
        "step_s_on": round(on / steps, 4), "step_s_off": round(off / steps, 4),
        "on_off_ratio": round(on / off, 4),
        "harness_s_per_step": round(harness / steps, 4),
        "harness_overhead_ratio": round((on + off + harness) / (on + off), 4),
        "harness_parts_s": {k: round(v, 4) for k, v in tot["harness"].items()},
        "flush_s": round(flush, 4),
        "phases_on_s": tot["test"], "phases_off_s": tot["ref"],
        "start_s": t["start_s"], "build_s": t["build_s"], "wall_s": e["elapsed_s"],
        "process_wall_s": e["process_wall_s"], "memory": e.get("memory", {}),
    }


def disk_write_rate(directory: Path, gib: float) -> dict:
    """Sequential write of one file, 64 MiB at a time, fsync'd: MB/s."""
    path = directory / "disk-probe.bin"
    block = os.urandom(1 << 20) * 64
    n = max(1, int(gib * 1024 / 64))
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(n):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    dt = time.perf_counter() - t0
    path.unlink()
    return {"bytes": n * len(block), "seconds": round(dt, 3), "mb_per_s": round(n * len(block) / 1e6 / dt, 1)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(11, 4))
    for label, group, style in (("dense", [r for r in rows if "moe" not in r["size"]], "-"),
                                ("MoE", [r for r in rows if "moe" in r["size"]], ":")):
        if not group:
            continue
        x = [r["params"] / 1e6 for r in group]
        ax[0].plot(x, [r["step_s_on"] * 1e3 for r in group], "o" + style, label=f"{label} ON")
        ax[0].plot(x, [r["step_s_off"] * 1e3 for r in group], "s" + style, mfc="none", label=f"{label} OFF")
        ax[1].plot(x, [r["harness_overhead_ratio"] for r in group], "o" + style, label=label)
        for r in group:
            ax[1].annotate(r["size"], (r["params"] / 1e6, r["harness_overhead_ratio"]), fontsize=8)
    ax[0].set(xscale="log", yscale="log", xlabel="parameters (M)", ylabel="step time (ms)",
              title="stack step time, ON vs OFF")
    ax[1].set(xscale="log", xlabel="parameters (M)", ylabel="(ON + OFF + harness) / (ON + OFF)",
              title="harness overhead (capture + compare + checks)")
    ax[1].legend()
    for a in ax:
        a.grid(True, which="both", alpha=0.3)
    ax[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--sizes", default="tiny,medium,large,large-moe")
    ap.add_argument("--steps", type=int, default=4, help="lockstep steps per size (step 0 is not timed)")
    ap.add_argument("--snapshot-size", default=None, help="run this size with --snapshot all as well")
    ap.add_argument("--snapshot-steps", type=int, default=6)
    ap.add_argument("--disk-gib", type=float, default=4.0)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = out / "runs"
    rows, snap = [], {}
    for size in args.sizes.split(","):
        scen = work / f"{size}.toml"
        scen.parent.mkdir(parents=True, exist_ok=True)
        scen.write_text(toml_of(f"scale-{size}", args.device, SIZES[size]))
        e = run(scen, work / size, args.steps, "none", args.timeout)
        rows.append(row(size, e))
        r = rows[-1]
        print(f"{size:10s} {r['params'] / 1e6:8.1f} M params  ON {r['step_s_on'] * 1e3:9.1f} ms  OFF "
              f"{r['step_s_off'] * 1e3:9.1f} ms  ON/OFF {r['on_off_ratio']:.3f}  harness x{r['harness_overhead_ratio']:.3f}"
              f"  start {r['start_s']} s  memory {r['memory']}", flush=True)
    if args.snapshot_size:
        size = args.snapshot_size
        scen = work / f"{size}.toml"
        scen.write_text(toml_of(f"scale-{size}", args.device, SIZES[size]))
        for steps in (2, args.snapshot_steps):
            d = work / f"{size}-snapshot-{steps}"
            e = run(scen, d, steps, "all", args.timeout)
            snap[steps] = {"snapshot_io": e["snapshot_io"], "memory": e["memory"], "wall_s": e["elapsed_s"],
                           "snapshot_s": e["timing"]["totals"].get("harness", {}).get("snapshot")}
            print(f"snapshot all, {size}, {steps} steps: {snap[steps]}", flush=True)
            shutil.rmtree(d / "snapshots", ignore_errors=True)  # tens of GB: keep the report only
        snap["disk"] = disk_write_rate(work, args.disk_gib)
        print(f"disk sequential write: {snap['disk']}", flush=True)
    import torch

    res = {"device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
           "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "steps": args.steps,
           "rows": rows, "snapshot": {str(k): v for k, v in snap.items()}}
    (out / "scale.json").write_text(json.dumps(res, indent=1))
    lines = [f"# parity cost by model size ({res['device']}, torch {res['torch']}, {res['date']})", "",
             f"World 1, blockwise, `parity run --steps {args.steps} --snapshot none` per size; times are the "
             "stacks' own phase times from report.json, mean per step over steps 1 and on (step 0 warms up).", "",
             "| size | params | step ON (ms) | step OFF (ms) | ON/OFF | harness per step (ms) | overhead | "
             "flush forward (ms, once) | rank start (s) | peak device memory | peak host RSS |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["memory"]
        dev = f"{m['cuda_peak_allocated_bytes'] / 2**30:.1f} GiB" if "cuda_peak_allocated_bytes" in m else "-"
        lines.append(f"| {r['size']} | {r['params'] / 1e6:.1f} M | {r['step_s_on'] * 1e3:.1f} | "
                     f"{r['step_s_off'] * 1e3:.1f} | {r['on_off_ratio']:.3f} | {r['harness_s_per_step'] * 1e3:.1f} | "
                     f"x{r['harness_overhead_ratio']:.3f} | {r['flush_s'] * 1e3:.1f} | {r['start_s']} | {dev} | "
                     f"{m.get('peak_rss_bytes', 0) / 2**30:.2f} GiB |")
    if snap:
        lines += ["", f"Snapshots (`--snapshot all`, {args.snapshot_size}): "]
        for k, v in snap.items():
            if k == "disk":
                lines.append(f"- disk sequential write (fsync, {v['bytes'] / 2**30:.1f} GiB): {v['mb_per_s']} MB/s")
            else:
                io = v["snapshot_io"]
                lines.append(f"- {k} steps: {io['bytes'] / 1e9:.2f} GB written at {io['mb_per_s']} MB/s (writer "
                             f"thread); peak host RSS {v['memory'].get('peak_rss_bytes', 0) / 2**30:.2f} GiB")
    (out / "scale.md").write_text("\n".join(lines) + "\n")
    try:
        plot(rows, out / "scale.png")
    except ImportError:
        pass
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
