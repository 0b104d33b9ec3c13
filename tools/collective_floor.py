"""The collective floor of a run: its collectives alone, replayed without the computation.

Runs ``parity run ARGS --golden off`` once with every rank's torch.distributed collectives traced
(operation, group, sizes, dtypes, split sizes, async or not, in issue order), then replays each
rank's sequence on zero-filled tensors with the same number of ranks, started (and, as many as the CPUs to twice as many, bound to CPUs) by
parity's launcher as in a run. Prints the run's wall time, the replay's, and the replay's time per
kind of collective on rank 0 (an asynchronous collective's wait is counted in the next blocking
one; an object all-gather sends a 2 KiB string in place of the objects). If the replay alone takes longer than a wall-time goal, no speed-up of the computation
reaches that goal. Asserts nothing.

    python tools/collective_floor.py --recipe blockwise --ep 8          # any `parity run` arguments
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Installed as sitecustomize.py in every process of the traced run: imports torch.distributed,
# wraps its collectives, and writes a rank's trace when it exits (ranks end with os._exit, so
# atexit does not run there). The CPU pins go in the environment first, as torch loads here.
_TRACER = r'''
import json, os, sys
_trace, _names = [], ["broadcast", "all_reduce", "all_gather_into_tensor", "all_gather_single",
                      "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single",
                      "all_gather_object", "barrier"]

def _install(dist, torch):
    def desc(x):
        if isinstance(x, torch.Tensor):
            return ["T", list(x.shape), str(x.dtype).replace("torch.", "")]
        if isinstance(x, dist.ProcessGroup):
            return ["G", dist.get_process_group_ranks(x)]
        if isinstance(x, (list, tuple)):
            return [desc(v) for v in x]
        return x if isinstance(x, (int, float, str, bool, type(None))) else None
    for name in _names:
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        def traced(*a, _fn=fn, _name=name, **k):
            _trace.append([_name, [desc(v) for v in a], {kk: desc(v) for kk, v in k.items() if kk != "op"}])
            return _fn(*a, **k)
        setattr(dist, name, traced)
    exit_ = os._exit
    def dump_and_exit(code):
        if _trace and os.environ.get("RANK") is not None:
            with open(os.path.join(os.environ["PARITY_TRACE_DIR"], f"rank{os.environ['RANK']}.json"), "w") as f:
                json.dump(_trace, f)
        exit_(code)
    os._exit = dump_and_exit

import torch, torch.distributed
_install(torch.distributed, torch)
'''


def _traced_run(args: list[str], trace_dir: str, out: str) -> float:
    """Run parity with the tracer; returns the scenario's own wall time from its report."""
    from parity.distributed.pins import CPU_PINS

    site = Path(trace_dir) / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_TRACER)
    env = {**CPU_PINS, **os.environ, "PARITY_TRACE_DIR": trace_dir,
           "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "parity.cli", "run", *args, "--golden", "off", "--snapshot", "none",
                        "--out", out, "--quiet"], env=env)
    if r.returncode != 0:
        sys.exit(f"collective_floor: the traced run exited {r.returncode}")
    (entry,) = json.loads((Path(out) / "report.json").read_text())["scenarios"]
    return entry["elapsed_s"]


def _replay(ctx, traces: list[list]) -> dict:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    from parity.distributed.collectives import _all_gather_single as all_gather
    from parity.distributed.collectives import _reduce_scatter_single as reduce_scatter

    groups = {}
    for ranks in sorted({tuple(k["group"][1]) for t in traces for _, _, k in t if k.get("group")}):
        groups[ranks] = None if len(ranks) == world else dist.new_group(list(ranks))  # on every rank

    def tensor(d):
        return torch.zeros(d[1], dtype=getattr(torch, d[2]))

    ops = []
    for name, a, k in traces[rank]:
        ts = [tensor(x) if isinstance(x, list) and x[:1] == ["T"] else x for x in a]
        ops.append((name, ts, k, groups.get(tuple(k["group"][1])) if k.get("group") else None))
    spent, count, pending = collections.Counter(), collections.Counter(), []
    dist.barrier()
    start = time.perf_counter()
    for name, ts, k, g in ops:
        t0, asy = time.perf_counter(), bool(k.get("async_op"))
        if name == "all_gather_object":
            dist.all_gather_object([None] * dist.get_world_size(g), "x" * 2048, group=g)
        elif name == "broadcast":
            w = dist.broadcast(ts[0], src=k["src"], group=g, async_op=asy)
        elif name == "all_reduce":
            w = dist.all_reduce(ts[0], group=g, async_op=asy)
        elif name in ("reduce_scatter_single", "reduce_scatter_tensor"):
            w = reduce_scatter(ts[0], ts[1], group=g, async_op=asy)
        elif name in ("all_gather_single", "all_gather_into_tensor"):
            w = all_gather(ts[0], ts[1], group=g, async_op=asy)
        elif name == "all_to_all_single":
            w = dist.all_to_all_single(ts[0], ts[1], k.get("output_split_sizes"), k.get("input_split_sizes"),
                                       group=g, async_op=asy)
        elif name == "barrier":
            dist.barrier(group=g)
        if asy:
            pending.append(w)
        else:
            for p in pending:
                p.wait()
            pending = []
        spent[name] += time.perf_counter() - t0
        count[name] += 1
    for p in pending:
        p.wait()
    return {"wall": time.perf_counter() - start, "spent": dict(spent), "count": dict(count)}


def main():
    args = sys.argv[1:]
    if any(a in ("-h", "--help") for a in args):
        print(__doc__)
        return
    from parity.harness.launch import LaunchConfig, launch

    with tempfile.TemporaryDirectory() as tmp:
        wall = _traced_run(args, tmp, os.path.join(tmp, "out"))
        files = sorted(Path(tmp).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
        traces = [json.loads(p.read_text()) for p in files]
    if not traces:
        sys.exit("collective_floor: no rank traced a collective (a single-rank run has none)")
    per_rank = launch(_replay, LaunchConfig(world_size=len(traces), start_method="forkserver", deadline_s=3600),
                      traces)
    r0 = per_rank[0]
    print(f"parity run {' '.join(args)}: scenario {wall:.1f} s; {len(traces)} ranks, "
          f"{sum(r0['count'].values())} collectives on rank 0")
    print(f"replay of the collectives alone: {max(r['wall'] for r in per_rank):.1f} s (slowest rank)")
    for name, s in sorted(r0["spent"].items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {r0['count'][name]:6d} calls {s:7.2f} s {1e3 * s / r0['count'][name]:7.2f} ms/call")


if __name__ == "__main__":
    main()
