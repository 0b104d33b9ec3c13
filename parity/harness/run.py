"""Parent side of a run: launch the ranks of each scenario, merge, check goldens, report."""

from __future__ import annotations

import json
import os
import tempfile
import time

from parity.dist.launch import LaunchConfig, RankFailure, launch
from parity.harness import report as rep
from parity.harness.errors import RuntimeFailure
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import Scenario


def _progress_rank_main(ctx, scenario, opts, progress_dir):
    """rank_main plus a heartbeat file, so a crash or hang can be placed at a rank and step."""
    import parity.harness.runner as runner

    path = os.path.join(progress_dir, f"rank_{ctx.rank}.json")

    def beat(step, phase):
        with open(path + ".tmp", "w") as f:
            json.dump({"rank": ctx.rank, "step": step, "phase": phase, "t": time.time()}, f)
        os.replace(path + ".tmp", path)

    runner.HEARTBEAT = beat
    beat(-1, "build")
    return rank_main(ctx, scenario, opts)


def launch_config(scenario: Scenario, timeout_s: float, allow_nondeterministic: bool) -> LaunchConfig:
    cuda = scenario.device == "cuda"
    return LaunchConfig(world_size=scenario.world, backend="nccl" if cuda else "gloo",
                        device=scenario.device, timeout_s=timeout_s,
                        deadline_s=max(600.0, 60.0 * scenario.steps), grace_s=3.0,
                        allow_nondeterministic=allow_nondeterministic)


def run_scenario(scenario: Scenario, opts: RunOptions, *, timeout_s: float = 60.0,
                 allow_nondeterministic: bool = False) -> tuple[dict, list[dict]]:
    """Returns (report entry, per-rank results)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="parity-progress-") as prog:
        try:
            results = launch(_progress_rank_main, launch_config(scenario, timeout_s, allow_nondeterministic),
                             scenario, opts, prog)
        except RankFailure as e:
            beats = _read_beats(prog)
            failure = _place_failure(e, beats)
            msg = (f"rank {failure['rank']} failed at step {failure['step']} ({failure['reason']})")
            return rep.error_entry(scenario, msg, time.perf_counter() - t0, failure), []
    entry = rep.merge_ranks(scenario, results, time.perf_counter() - t0)
    return entry, results


def _read_beats(d) -> dict:
    out = {}
    for f in os.listdir(d):
        if f.endswith(".json"):
            try:
                with open(os.path.join(d, f)) as fh:
                    b = json.load(fh)
                out[b["rank"]] = b
            except (OSError, ValueError, KeyError):
                pass
    return out


_PHASE_RANK = {"build": 0, "start": 1, "forward": 2, "grad_local": 3, "grad_reduce": 4,
               "optimizer": 5, "param_sync": 6}


def _place_failure(e: RankFailure, beats: dict) -> dict:
    """The rank that died is named by the launcher. A hung rank is the one that fell behind:
    its heartbeat shows the least progress while its peers waited in a collective."""
    failed = getattr(e, "failures", None) or []
    first = failed[0] if failed else None
    reason = getattr(first, "reason", "failed") if first else "failed"
    rank = getattr(first, "rank", None)
    if beats:
        laggard = min(beats.values(), key=lambda b: (b["step"], _PHASE_RANK.get(b["phase"], 9), b["t"]))
        lead = max(beats.values(), key=lambda b: (b["step"], _PHASE_RANK.get(b["phase"], 9)))
        dead = first is not None and first.error is None and first.exitcode not in (None, 1)
        if not dead and (laggard["step"], laggard["phase"]) != (lead["step"], lead["phase"]):
            rank, reason = laggard["rank"], "stopped answering (hang): its peers timed out waiting"
    step = beats.get(rank, {}).get("step") if rank is not None else None
    return {"rank": rank, "step": step, "reason": reason, "launcher": str(e)[:2000],
            "heartbeats": beats}
