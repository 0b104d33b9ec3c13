"""Parent side of a run: launch the ranks of each scenario, merge, check goldens, report.

The same under the built-in launcher and under torchrun: there every torchrun worker runs this
module for its own rank, the ranks' results are gathered to global rank 0, and rank 0 merges them
into the scenario's entry and shares it, so every worker takes the same decisions next.
"""

from __future__ import annotations

import faulthandler
import os
import re
import socket
import tempfile
import threading
import time

from parity.harness import report as rep
from parity.harness.errors import ConfigError
from parity.harness.launch import LaunchConfig, RankFailure, launch, thread_ids, torchrun_job, under_torchrun
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import Scenario
from parity.harness.timing import profiled, rank_cpu, start_parts, time_garbage_collection
from parity.vocab import STEP_PHASES

_SAMPLE_S = 0.5  # how often a rank's watcher thread asks whether the rank has gone quiet
# How long the heartbeat must have been quiet before the watcher reads where the main thread is.
# Reading it is not safe while gloo's threads make Python thread states, which they do as its
# collectives complete (docs/spec/platform.md s1.3): a rank that makes progress is left alone.
_QUIET_S = 2.0


_THREAD_LINE = re.compile(r"(?:Current thread|Thread) 0x([0-9a-fA-F]+)")
_FRAME_LINE = re.compile(r'  File "(.*)", line (\d+|\?\?\?) in (.*)')


def _thread_stack(dump: str, thread_id: int) -> list[tuple[str, str, str]]:
    """(file, line, function) of one thread's frames, innermost first, from a faulthandler dump."""
    frames, mine = [], False
    for line in dump.splitlines():
        header = _THREAD_LINE.match(line)
        if header:
            mine = int(header.group(1), 16) == thread_id
        elif mine and (frame := _FRAME_LINE.fullmatch(line)):
            frames.append(frame.groups())
    return frames


def _read_stack(scratch: int, thread_id: int) -> list[tuple[str, str, str]]:
    """Another thread's stack, read by faulthandler into the file ``scratch``.

    faulthandler walks the interpreter's frames in C, under the GIL, making no frame objects.
    Walking them from Python instead (``sys._current_frames()`` and ``f_back``) holds frame
    objects of a running thread across GIL switches, and CPython 3.11 can crash on that: a CI
    rank died of SIGSEGV in such a walk while its main thread imported sympy. faulthandler's walk
    has a hazard of its own: it reads the list of thread states without the lock that guards it,
    and a thread state that another thread is making meanwhile crashes it (docs/spec/platform.md
    s1.3), hence the watcher reads only a quiet rank's stack."""
    os.lseek(scratch, 0, os.SEEK_SET)
    faulthandler.dump_traceback(scratch, all_threads=True)
    size = os.lseek(scratch, 0, os.SEEK_CUR)  # an earlier, longer dump's tail lies past this
    return _thread_stack(os.pread(scratch, size, 0).decode("ascii", "replace"), thread_id)


def _where(stack: list[tuple[str, str, str]]) -> tuple[bool, str]:
    """(waiting in a collective?, innermost parity frame) of a stack, innermost first.

    Waiting: the innermost Python frame is a function of torch.distributed, or of parity's
    collectives (parity/distributed/collectives.py, the one module of parity that calls
    ``Work.wait``, a C function, on the collectives it started). Not the module code of an import
    of a torch.distributed package, which runs no collective."""
    stack = [(fn.replace(os.sep, "/"), line, func) for fn, line, func in stack]
    fn, _, func = stack[0] if stack else ("", "", "")
    in_collective = ("/torch/distributed/" in fn and func != "<module>") or fn.endswith("/parity/distributed/collectives.py")
    where = next((f"{os.path.basename(fn)}:{line} {func}" for fn, line, func in stack if "/parity/" in fn), "")
    return in_collective, where


def _thread_policies() -> list[str] | None:
    """The scheduling policies of this rank's threads, now (gloo's included), e.g. ["batch"]."""
    if not hasattr(os, "sched_getscheduler"):  # not Linux
        return None
    names = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle"}
    found = set()
    for tid in thread_ids():
        try:
            found.add(names.get(os.sched_getscheduler(tid), "real-time"))
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(found)


def _watch(state: dict, lock: threading.Lock, flush, thread_id: int, stop: threading.Event) -> None:
    """The watcher thread: every ``_SAMPLE_S`` until ``stop``, if the heartbeat ``state`` has been
    quiet for ``_QUIET_S``, record whether thread ``thread_id`` waits in a collective and its
    innermost parity frame (:func:`_where`), and post ``state`` (``flush``, ``lock`` held) when that
    changed."""
    try:
        with tempfile.TemporaryFile() as scratch:
            while not stop.wait(_SAMPLE_S):
                with lock:
                    quiet = time.time() - state["t"] >= _QUIET_S
                if not quiet:
                    continue
                found = _where(_read_stack(scratch.fileno(), thread_id))
                with lock:
                    if found != (state["in_collective"], state["where"]):
                        state["in_collective"], state["where"] = found
                        flush()
    except Exception:
        return  # diagnostics only: never disturb the run


def rank_main_with_heartbeat(ctx, scenario, opts):
    """rank_main plus a heartbeat (the rank's status in the launcher's store), so a crash or hang
    can be placed at a rank and step.

    Besides the step and phase the runner reports, a watcher thread records, once the heartbeat has
    been quiet for ``_QUIET_S``, whether the main thread is waiting in a collective and in which
    parity function: when a rank hangs, its peers time out *inside a collective* while the
    hung rank is somewhere else; that tells the culprit from its victims."""
    import parity.harness.runner as runner

    entered_at = time.time()
    time_garbage_collection()
    state = {"rank": ctx.rank, "step": -1, "phase": "build", "t": time.time(),
             "in_collective": False, "where": "", "host": socket.gethostname()}
    lock = threading.Lock()

    def flush():  # with lock held
        ctx.post_status(state)

    def beat(step, phase):
        with lock:  # where the main thread was while the rank was quiet no longer holds
            state.update(step=step, phase=phase, t=time.time(), in_collective=False, where="")
            flush()

    runner.HEARTBEAT = beat
    beat(-1, "build")
    stop = threading.Event()
    threading.Thread(target=_watch, args=(state, lock, flush, threading.get_ident(), stop),
                     name="parity-progress-watch", daemon=True).start()
    try:
        with profiled(opts.profile_path(scenario.name, ctx.rank), opts.profile):
            res = rank_main(ctx, scenario, opts)
    finally:  # the process group's teardown follows: no beats, and gloo's threads at work
        stop.set()
    res["cpu"] = rank_cpu()
    res["host"] = state["host"]  # where this rank's snapshot files are (OUT may be per node)
    res["entered_at"] = entered_at  # the parent's launch time to this: rank start-up
    res["started"] = dict(ctx.started)
    res["start_method"] = ctx.launcher
    res["cpus"] = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    res["thread_policies"] = _thread_policies()
    return res


def launch_config(scenario: Scenario, opts: RunOptions, timeout_s: float, allow_nondeterministic: bool) -> LaunchConfig:
    cuda = scenario.device == "cuda"
    return LaunchConfig(world_size=scenario.world, backend="nccl" if cuda else "gloo",
                        device=scenario.device, timeout_s=timeout_s,
                        deadline_s=max(600.0, 60.0 * scenario.steps), grace_s=3.0,
                        allow_nondeterministic=allow_nondeterministic,
                        checkpoints=opts.save_at is not None or opts.load_from is not None,
                        # Ranks fork from a server that imported torch and the stack once (seconds
                        # saved per launch; on CUDA also the loading of torch's CUDA libraries). The
                        # server never touches CUDA, so no CUDA state is forked: torch refuses CUDA
                        # in a child forked after CUDA was initialized. On a machine with few
                        # CPUs the CLI forks CPU ranks itself (parity.harness.launch._start_method).
                        start_method="forkserver")


def run_scenario(scenario: Scenario, opts: RunOptions, *, timeout_s: float = 60.0,
                 allow_nondeterministic: bool = False) -> tuple[dict, list[dict]]:
    """Returns (report entry, per-rank results).

    Under torchrun every worker calls this for the same scenarios in the same order; each gets the
    same entry (rank 0's), and only rank 0 gets the per-rank results (the others get [])."""
    if scenario.resume_at is not None:  # two launches around a checkpoint (parity/harness/resume.py)
        if under_torchrun():
            raise ConfigError(f"scenario {scenario.name}: resume_at needs two launches; under torchrun run "
                              f"the saving job and a `--resume-from` job one after the other")
        from parity.harness.resume import run_resume
        return run_resume(scenario, opts, timeout_s=timeout_s, allow_nondeterministic=allow_nondeterministic)
    check_fits(scenario)
    t0, launched_at = time.perf_counter(), time.time()
    try:
        results = launch(rank_main_with_heartbeat, launch_config(scenario, opts, timeout_s, allow_nondeterministic),
                         scenario, opts)
    except RankFailure as e:
        failure = _place_failure(e, e.statuses)
        step = failure["step"]
        when = f"at step {step}" if isinstance(step, int) and step >= 0 else "during start-up"
        if failure["phase"] in STEP_PHASES:  # the heartbeat's phase: the last one the test side reported
            when += f", after {failure['phase']}"
        msg = f"rank {failure['rank']} failed {when} ({failure['reason']})"
        return rep.error_entry(scenario, msg, time.perf_counter() - t0, failure), []
    if not under_torchrun():
        start_s = max(r["entered_at"] for r in results) - launched_at if results else None
        for r in results:
            r["start_parts"] = start_parts(launched_at, r.get("started", {}), r["entered_at"])
        return rep.merge_ranks(scenario, results, time.perf_counter() - t0, start_s), results
    job = torchrun_job()  # (torchrun started the ranks before us: no start-up time to report)
    entry = rep.merge_ranks(scenario, results, time.perf_counter() - t0) if job.rank == 0 else None
    return job.broadcast("entry", entry), (results if job.rank == 0 else [])


def check_fits(scenario: Scenario) -> None:
    """Refuse, before any rank starts, a scenario the ranks at hand cannot run (exit 2)."""
    torchrun = under_torchrun()
    if torchrun:
        job = torchrun_job()
        if scenario.world != job.world_size:
            raise ConfigError(f"scenario {scenario.name}: world {scenario.world}, but torchrun started "
                              f"{job.world_size} ranks (--nnodes x --nproc-per-node); start torchrun with "
                              f"{scenario.world} ranks in all, or pass --world {job.world_size}")
    if scenario.device == "cuda":
        import torch

        have = torch.cuda.device_count()
        # NCCL needs one GPU per rank; refusing here beats a failure inside every rank.
        if torchrun and torchrun_job().local_world_size > have:
            raise ConfigError(f"scenario {scenario.name}: torchrun --nproc-per-node "
                              f"{torchrun_job().local_world_size} needs as many GPUs on this node with NCCL "
                              f"(one rank per GPU); {have} visible")
        if not torchrun and scenario.world > have:
            raise ConfigError(f"scenario {scenario.name}: world {scenario.world} needs {scenario.world} "
                              f"GPUs with NCCL (one rank per GPU); {have} visible. Run it on a machine "
                              f"with enough GPUs, or lower --world/--ep")


_PHASE_RANK = {"build": 0, "start": 1, "forward": 2, "grad_local": 3, "grad_reduce": 4,
               "optimizer": 5, "param_sync": 6}


# What a rank raises when a peer is gone or silent (gloo, NCCL, the c10d store).
_PEER_ERROR = re.compile(r"timed? ?out|timeout|connection (reset|closed|refused)|broken pipe|"
                         r"DistNetworkError|DistStoreError|remote process exited", re.IGNORECASE)


def _progress(b: dict) -> tuple:
    return (b.get("step", -1), _PHASE_RANK.get(b.get("phase"), 9))


def _place_failure(e: RankFailure, beats: dict) -> dict:
    """Name the rank that caused the failure, and its step.

    1. A rank that died without raising (crashed, killed, exited) caused it: its peers only lost
       their connection to it.
    2. Else a rank that raised for a reason of its own (not a peer timeout or a lost connection).
    3. Else every failed rank was waiting on a peer: the culprit is a rank that never answered
       (stopped by the launcher, or still running at the deadline). Prefer one that was not
       itself waiting in a collective, then the one whose heartbeat shows the least progress.
    """
    failed = list(getattr(e, "failures", None) or [])
    stopped = list(getattr(e, "stopped", None) or [])
    first = failed[0] if failed else None
    rank = getattr(first, "rank", None)
    reason = getattr(first, "reason", "failed") if first else "failed"
    kind = "error"

    # (a rank that missed the deadline was stopped by the launcher: it did not die by itself)
    died = [f for f in failed if f.error is None and f.exitcode is not None
            and not f.reason.startswith("did not finish")]
    own = [f for f in failed if f.error is not None and not _PEER_ERROR.search(f.error)]
    if died:
        rank, reason, kind = died[0].rank, died[0].reason, "crash"
    elif own:
        rank, reason = own[0].rank, own[0].reason
    else:
        silent = stopped + [f.rank for f in failed if f.error is None and f.exitcode is None]
        pool = [r for r in silent if r in beats] or list(beats)
        if pool:
            rank = min(pool, key=lambda r: (bool(beats[r].get("in_collective")), _progress(beats[r]),
                                            beats[r].get("t", 0.0)))
            timed_out = [f.rank for f in failed if f.error is not None]
            peers = (f"rank(s) {', '.join(map(str, timed_out))} timed out waiting for it" if timed_out
                     else "it did not finish in time")
            where = beats[rank].get("where")
            kind = "hang"
            reason = f"stopped answering (hang){' in ' + where if where else ''}: {peers}"
    b = beats.get(rank, {}) if rank is not None else {}
    return {"rank": rank, "step": b.get("step"), "phase": b.get("phase"), "kind": kind, "reason": reason,
            "launcher": str(e)[:2000], "heartbeats": beats}
