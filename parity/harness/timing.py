"""Where a rank's time goes: the stacks' phases and the harness's own work, step by step.

A stack reports each phase when it has done it, so the wall time from the previous report (or
from the start of the step) to this one is the stack's work for that phase: forward, backward
(``grad_local``), reduce (``grad_reduce``), optimizer, gather (``param_sync``). Params are reported
inside the next forward, which consumes them; there the stack also marks where each module's
pre-hooks begin, so the pre-hooks (the overlapped gather) count as gather and the rest as forward
(``Stack.timer``). The time spent inside a report is the
harness's: capture and compare, plus the golden digests and snapshot hand-off it does there. On
CUDA the clock waits at every mark for the stream the stacks compute on, so kernels queued there
are charged to the phase that launched them (a comparison reads its result there anyway). It
never synchronizes the whole device: a collective launched asynchronously (the overlapped param
gather) stays in flight across the marks until the stack itself waits for it, as in training. A
device-wide barrier at each module's pre-hook would land every in-flight gather before its
copy-back, and so hide a copy-back that does not wait for its gather (docs/spec/megatron.md s2.10).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

HARNESS_PARTS = ("capture_compare", "golden", "snapshot", "checks", "checkpoint", "flush")
"""Harness work: copy and bit-compare of the reported tensors; golden digests; snapshot copies
and hand-off to the writer; step closing (replica hashes across ranks, gather checks); saving a
checkpoint (with the param sync training does before a save); the forward after the last step
that consumes its params (the gather its pre-hooks do stays gather)."""


class PhaseClock:
    """Wall-clock accounts of one rank: ``stack[(side, phase)]`` and ``harness[part]``, per step."""

    def __init__(self, device: torch.device):
        # The current stream only, never torch.cuda.synchronize (see the module's docstring).
        self._sync = ((lambda: torch.cuda.current_stream(device).synchronize())
                      if device.type == "cuda" else (lambda: None))
        self.steps: dict[int, dict[str, dict[str, float]]] = {}
        self._last = None
        self._inner = 0.0  # sub-parts timed inside the open harness span

    def _now(self) -> float:
        self._sync()
        return time.perf_counter()

    def _add(self, step: int, kind: str, key: str, dt: float) -> None:
        acc = self.steps.setdefault(step, {"test": defaultdict(float), "ref": defaultdict(float),
                                           "harness": defaultdict(float)})
        acc[kind][key] += dt

    def start(self) -> None:
        """Open the account: the next mark measures from here."""
        self._last = self._now()

    def stack_reached(self, step: int, side: str, phase: str) -> None:
        """``side``'s stack reports ``phase``: the time since the last mark was its work."""
        now = self._now()
        if self._last is not None:
            self._add(step, side, phase, now - self._last)
        self._last = now

    def harness_done(self, step: int, part: str = "capture_compare") -> None:
        """The harness finished work begun at the last mark (less sub-parts timed inside it)."""
        now = self._now()
        if self._last is not None:
            self._add(step, "harness", part, now - self._last - self._inner)
        self._inner = 0.0
        self._last = now

    @contextmanager
    def part(self, step: int, name: str):
        """Time a harness sub-part inside an open span (it is taken out of the span's part)."""
        t0 = self._now()
        try:
            yield
        finally:
            dt = self._now() - t0
            self._add(step, "harness", name, dt)
            self._inner += dt

    def to_dict(self) -> dict:
        """``{step: {"test"|"ref"|"harness": {key: seconds}}}`` (plain dicts, rounded to µs)."""
        return {s: {k: {n: round(v, 6) for n, v in d.items()} for k, d in acc.items()}
                for s, acc in sorted(self.steps.items())}


_GC = {"s": 0.0, "started": None}


def _gc_timer(phase: str, info: dict) -> None:
    if phase == "start":
        _GC["started"] = time.perf_counter()
    elif _GC["started"] is not None:
        _GC["s"] += time.perf_counter() - _GC["started"]
        _GC["started"] = None


def time_garbage_collection() -> None:
    """From now on, add up the time this process spends in the garbage collector (``gc_s`` of
    :func:`rank_cpu`; a forked rank starts from zero, not from its parent's count)."""
    _GC.update(s=0.0, started=None)
    if _gc_timer not in gc.callbacks:
        gc.callbacks.append(_gc_timer)


def rank_cpu() -> dict | None:
    """This process's CPU time, context switches, page faults (minor: no disk read) and seconds in
    the garbage collector (since :func:`time_garbage_collection`) so far (None where ``resource``
    is missing).

    With more ranks than CPUs the wall time of a phase includes the time a rank waited for a CPU;
    the CPU time says how much work the rank itself did."""
    try:
        import resource
    except ImportError:  # not on POSIX
        return None
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return {"user_s": ru.ru_utime, "system_s": ru.ru_stime,
            "voluntary_switches": ru.ru_nvcsw, "involuntary_switches": ru.ru_nivcsw,
            "page_faults": ru.ru_minflt, "gc_s": round(_GC["s"], 4)}


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _free_path(path: str) -> str:
    """``path``, or the next free ``STEM.N.EXT`` when a file is there already (the first launch
    of a resumed run wrote it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    stem, ext = os.path.splitext(path)
    n = 1
    while os.path.exists(path):
        n += 1
        path = f"{stem}.{n}{ext}"
    return path


def profile_file(directory: str, rank: int, mode: str) -> str:
    """The file a rank's profile goes to: ``rank<r>.prof`` (cProfile) or ``rank<r>.ops.json``."""
    return os.path.join(directory, f"rank{rank}.ops.json" if mode == "ops" else f"rank{rank}.prof")


def _parity_caller() -> str:
    """``module.py:function`` of the innermost parity frame on the stack (relative to the
    package), or ``-`` when none (torch's own code called by torch)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(_PACKAGE_DIR):
            return f"{name[len(_PACKAGE_DIR):]}:{f.f_code.co_name}"
        f = f.f_back
    return "-"


class _OpCounter(TorchDispatchMode):
    """Counts the torch ops dispatched while it is active, by op and by the parity function
    that issued them. On a CPU rank of these small models an op's fixed cost (argument parsing,
    dispatch, allocation: several microseconds) is a large part of its time, so the count shows
    where the ops pile up without drifting with the machine's speed. It is a count, not a time:
    ops differ in cost, so a change's effect on time needs its own measurement."""

    def __init__(self):
        super().__init__()
        self.counts: dict = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[(_parity_caller(), str(func))] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        by_function, by_op = defaultdict(int), defaultdict(int)
        for (fn, op), n in self.counts.items():
            by_function[fn] += n
            by_op[op] += n
        ranked = lambda d: dict(sorted(d.items(), key=lambda kv: (-kv[1], kv[0])))
        return {"total": sum(by_op.values()), "by_function": ranked(by_function), "by_op": ranked(by_op),
                "by_function_op": [[fn, op, n] for (fn, op), n in
                                   sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))]}


@contextmanager
def profiled(path: str | None, mode: str = "cpu"):
    """Profile the block into ``path``; no-op when None.

    mode "cpu": cProfile on the main thread's CPU time (what the rank computes, not its waits for
    a CPU or a peer); "wall": cProfile on wall time (waits included: collectives, CUDA
    synchronization); both write a pstats file (``python -m pstats PATH``). "ops": the torch ops
    the block dispatches, counted by op and by issuing parity function, as JSON
    (``python tools/op_counts.py OUT``). A file already there (the first launch of a resumed
    run) is kept: this one gets the next free ``.N`` name."""
    if path is None:
        yield
        return
    if mode == "ops":
        counter = _OpCounter()
        try:
            with counter:
                yield
        finally:
            with open(_free_path(path), "w") as f:
                json.dump(counter.summary(), f, indent=1)
        return
    import cProfile

    prof = cProfile.Profile(time.thread_time if mode == "cpu" else time.perf_counter)
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        prof.dump_stats(_free_path(path))


START_PARTS = ("process", "device", "process_group", "handoff")
"""A rank's start-up, launch to its entry point: the process and its imports (``process``), the
device (on CUDA: creating the context), joining the process group (it waits for the slowest
rank), and the launcher's hand-off to the rank's code."""


def start_parts(launched_at: float, marks: dict, entered_at: float) -> dict | None:
    """Seconds of each START_PARTS from the launch time and the rank's wall-clock marks."""
    if not {"entry", "device", "group"} <= set(marks):
        return None
    edges = [launched_at, marks["entry"], marks["device"], marks["group"], entered_at]
    return {part: round(b - a, 3) for part, a, b in zip(START_PARTS, edges, edges[1:])}


def merge_timing(results: list[dict], start_s: float | None, elapsed_s: float | None = None) -> dict:
    """A scenario's timing for report.json: the mean over ranks of every account, per step and in
    total, with the rank start-up (launch to the rank's entry), stack construction, and the rest
    of the wall time ``elapsed_s`` (construction checks, teardown, the parent's merge)."""
    ranks = [r for r in results if r.get("timing") is not None]
    if not ranks:
        return {}
    n = len(ranks)
    seen: dict[int, list[dict]] = {}  # step -> the accounts of the ranks that ran it
    for r in ranks:
        for step, acc in r["timing"].items():
            seen.setdefault(int(step), []).append(acc)
    per_step: dict[int, dict[str, dict[str, float]]] = {}
    for step, accs in seen.items():
        dst = per_step.setdefault(step, {})
        for acc in accs:
            for kind, d in acc.items():
                for key, v in d.items():
                    dst.setdefault(kind, {})[key] = dst.get(kind, {}).get(key, 0.0) + v / len(accs)
    totals: dict[str, dict[str, float]] = {}
    for acc in per_step.values():
        for kind, d in acc.items():
            for key, v in d.items():
                totals.setdefault(kind, {})[key] = totals.get(kind, {}).get(key, 0.0) + v

    def rnd(d):
        return {k: round(v, 4) for k, v in d.items()}

    accounted = sum(v for d in totals.values() for v in d.values())
    build_s = sum(r.get("build_s", 0.0) for r in ranks) / n
    parts = [r["start_parts"] for r in ranks if r.get("start_parts")]
    start_split = None if not parts else {p: round(sum(x[p] for x in parts) / len(parts), 3) for p in START_PARTS}
    methods = sorted({r["start_method"] for r in ranks if r.get("start_method")})
    on_one = [r["cpus"][0] for r in ranks if r.get("cpus") and len(r["cpus"]) == 1]
    policies = sorted({p for r in ranks for p in r.get("thread_policies") or ["unknown"]})
    cpus = [r["cpu"] for r in ranks if r.get("cpu")]
    cpu = None if not cpus else {
        **{k: round(sum(c[k] for c in cpus) / len(cpus), 3) for k in cpus[0]}, "host_cpus": os.cpu_count()}
    rest = None if elapsed_s is None or start_s is None else elapsed_s - start_s - build_s - accounted
    return {
        "start_s": None if start_s is None else round(start_s, 3),
        "start_parts": start_split,
        "start_method": "+".join(methods) or None,
        "bound_cpus": on_one if len(on_one) == n else None,  # each rank may run on one CPU only
        "thread_policies": policies,  # the scheduling policies of the ranks' threads, all ranks
        "rest_s": None if rest is None else round(rest, 3),
        "build_s": round(build_s, 3),
        "totals": {kind: rnd(d) for kind, d in totals.items()},
        "per_step": [{"step": s, **{kind: rnd(d) for kind, d in acc.items()}} for s, acc in sorted(per_step.items())],
        "ranks_averaged": n,
        "cpu": cpu,
    }


PHASE_LABEL = {"init": "init", "forward": "forward", "grad_local": "backward", "grad_reduce": "reduce",
               "optimizer": "optimizer", "param_sync": "gather"}


def timing_md(name: str, timing: dict, elapsed_s: float | None) -> list[str]:
    """summary.md lines: where one scenario's time went (seconds, mean over ranks)."""
    if not timing:
        return []
    tot = timing["totals"]
    steps = max(1, sum(1 for s in timing["per_step"] if s["step"] >= 0))
    rest = "" if timing.get("rest_s") is None else (f"; the rest (construction checks, teardown, the "
                                                    f"parent's merge) {timing['rest_s']} s")
    # (not measured under torchrun, which started the ranks, or over a resume's two launches)
    start = "not measured" if timing["start_s"] is None else f"{timing['start_s']} s"
    split = timing.get("start_parts")
    if split:
        start += " (" + ", ".join(f"{p.replace('_', ' ')} {v}" for p, v in split.items()) + ")"
    if timing.get("start_method"):
        start += f", ranks started by {timing['start_method']}"
    if timing.get("bound_cpus"):
        start += f", each on one CPU ({', '.join(map(str, timing['bound_cpus']))})"
    if timing.get("thread_policies") == ["batch"]:
        start += ", every thread under SCHED_BATCH"
    lines = [f"### {name}", "",
             f"wall {elapsed_s} s; rank start-up {start}; both stacks built in "
             f"{timing['build_s']} s{rest}; {steps} steps (seconds: total, and per step)", "",
             "| account | ON | OFF | per step ON | per step OFF |", "|---|---|---|---|---|"]
    for phase, label in PHASE_LABEL.items():
        on, off = tot.get("test", {}).get(phase), tot.get("ref", {}).get(phase)
        if on is None and off is None:
            continue
        on, off = on or 0.0, off or 0.0
        lines.append(f"| {label} | {on:.3f} | {off:.3f} | {on / steps:.4f} | {off / steps:.4f} |")
    for part in HARNESS_PARTS:
        v = tot.get("harness", {}).get(part)
        if v is not None:
            lines.append(f"| harness: {part.replace('_', ' ')} | {v:.3f} | | {v / steps:.4f} | |")
    cpu = timing.get("cpu")
    if cpu:
        lines += ["", (f"CPU time per rank (mean): user {cpu['user_s']} s, system {cpu['system_s']} s, "
                       f"{cpu['voluntary_switches']:.0f} voluntary and {cpu['involuntary_switches']:.0f} "
                       f"involuntary context switches, {cpu['page_faults']:.0f} page faults, "
                       f"{cpu['gc_s']} s in the garbage collector; "
                       f"{timing['ranks_averaged']} ranks, {cpu['host_cpus']} CPUs on "
                       f"this host")]
    return lines + [""]
