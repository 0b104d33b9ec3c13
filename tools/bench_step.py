"""Step-time benchmarks of the lockstep pair, printed as numbers (never asserted in tests).

- ON/OFF step-time ratio: the same config with FP8 param gather ON vs OFF, bare steps.
- harness overhead: one lockstep step with capture + compare + divergent-snapshot bookkeeping
  vs the bare pair (both sides stepped, no capture), same run.
- memory: peak allocated ON vs OFF (CUDA) and the persistent bytes of the Muon matrices.

Runs on one rank (world 1) in this process, on CPU (gloo) or CUDA (nccl).

    python tools/bench_step.py                 # tiny default model on CPU
    python tools/bench_step.py --device cuda --medium
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--recipe", default="blockwise", choices=("blockwise", "mxfp8"))
    ap.add_argument("--medium", action="store_true", help="a model that fills a GPU for tens of ms per step")
    ap.add_argument("--moe", action="store_true")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per measurement")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--json", default=None, help="also write the numbers here")
    args = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    torch.use_deterministic_algorithms(True)
    if device.type == "cpu":
        torch.set_num_threads(1)

    from parity.distributed.groups import build_groups
    from parity.harness.compare import compare_tensors
    from parity.harness.scenario import make_scenario
    from parity.optim.stack import Stack

    model = {}
    if args.medium:
        model = dict(hidden=1024, ffn_hidden=4096, num_heads=8, num_layers=4, seq_len=1024,
                     micro_batch=4, vocab_size=1024, moe_ffn_hidden=1024)
    s = make_scenario({"name": "bench", "world": 1, "recipe": args.recipe, "moe": args.moe,
                       "steps": args.steps, "device": args.device, "model": model})
    groups = build_groups(1)
    cfg_on, cfg_off = s.stack_configs()

    def build(cfg):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        st = Stack(cfg, groups, device)
        return st, (torch.cuda.memory_allocated() - base if device.type == "cuda" else None)

    on, on_alloc = build(cfg_on)
    off, off_alloc = build(cfg_off)
    noop = lambda step, ph, t, complete=True: None
    step = [0]

    def timed(fn, n):
        out = []
        for _ in range(n):
            sync(device)
            t0 = time.perf_counter()
            fn(step[0])
            sync(device)
            out.append(time.perf_counter() - t0)
            step[0] += 1
        return statistics.median(out)

    for _ in range(args.warmup):
        off.step(step[0], noop); on.step(step[0], noop); step[0] += 1

    def clock(fn):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0

    # Both stacks always take the same steps (same batches), so they stay bit-identical and the
    # harnessed steps below can compare them; ON and OFF are timed step by step, interleaved.
    t_on, t_off, t_bare, t_harn, ndiff = [], [], [], [], 0
    for _ in range(args.steps):
        k = step[0]
        t_off.append(clock(lambda: off.step(k, noop)))
        t_on.append(clock(lambda: on.step(k, noop)))
        t_bare.append(t_on[-1] + t_off[-1])
        step[0] += 1
    for _ in range(args.steps):
        k = step[0]
        caps = {}

        def capture(step, ph, t, complete=True):
            caps.setdefault((step, ph), {}).update({n: v.detach().clone() for n, v in t.items()})

        def cmp(step, ph, t, complete=True):
            nonlocal ndiff
            ref = caps[(step, ph)]
            for n, v in t.items():
                if n in ref and not compare_tensors(ref[n], v, n).equal:
                    ndiff += 1
        t_harn.append(clock(lambda: (off.step(k, capture), on.step(k, cmp))))
        step[0] += 1
    t_on, t_off = statistics.median(t_on), statistics.median(t_off)
    t_bare, t_harn = statistics.median(t_bare), statistics.median(t_harn)
    res = {
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "torch": torch.__version__, "recipe": args.recipe, "model": "medium" if args.medium else "tiny",
        "moe": args.moe,
        "step_ms_on": round(t_on * 1e3, 2), "step_ms_off": round(t_off * 1e3, 2),
        "on_off_ratio": round(t_on / t_off, 4),
        "lockstep_bare_ms": round(t_bare * 1e3, 2), "lockstep_harness_ms": round(t_harn * 1e3, 2),
        "harness_overhead_ratio": round(t_harn / t_bare, 4),
        "differing_tensors_seen": ndiff,
        "muon_param_bytes_on": on.persistent_bytes()["muon_param_bytes"],
        "muon_param_bytes_off": off.persistent_bytes()["muon_param_bytes"],
    }
    if device.type == "cuda":
        res["model_alloc_bytes_on"] = on_alloc
        res["model_alloc_bytes_off"] = off_alloc
        res["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    for k, v in res.items():
        print(f"{k:28s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
