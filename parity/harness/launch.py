"""Run a Python callable on N local ranks, one process per rank; or, under torchrun, in this process.

Usage::

    def work(ctx: RankContext, n: int) -> float:
        t = torch.full((n,), float(ctx.rank))
        dist.all_reduce(t)
        return t.sum().item()

    results = launch(work, LaunchConfig(world_size=4), 8)   # [result of rank 0, rank 1, ...]

``fn`` and its arguments must be picklable (``fn`` defined at module top level). Each rank is a
fresh interpreter (``spawn``, the default) or a child of a fork server that imported torch once
(``start_method="forkserver"``: much faster starts); never a plain ``fork`` of a caller that runs
other threads, which a fork would not copy (a "forkserver" caller that runs none and was pinned
before torch loaded, as the CLI is, forks its ranks itself where that is faster: a torchrun
supervisor, or CPU ranks on a machine with few CPUs, see ``_start_method``; the built-in launcher
serves the rendezvous store only once its ranks are started, and sends each its port). In every rank the
determinism environment is applied *before* ``init_process_group``, so communicators and cuBLAS
see it.

Failure handling. The parent watches every rank. The first rank that raises, exits non-zero, is
killed, or exits without returning a result ends the run: the parent terminates the other ranks
(SIGTERM, then SIGKILL after ``grace_s``), reaps them, and raises :class:`RankFailure` naming the
failed rank, its exit code or signal and its exception text. A rank blocked in a collective whose
peer died therefore never holds the run up. An overall watchdog (``deadline_s``) ends runs in which
a rank hangs. Ranks exit by themselves if the parent dies (a pipe whose EOF they watch, plus
``PR_SET_PDEATHSIG`` on Linux for spawned ranks). A rank's exception travels to the parent as text;
neither the rank nor the parent prints a traceback.

The rendezvous store is a ``TCPStore`` served by the parent on a port the OS picks when it binds,
so concurrent launches never race for a port. Ranks leave with ``os._exit`` once their result is
sent: ``atexit`` handlers do not run in ranks. A rank may post a small status (``ctx.post_status``,
e.g. the step it is at) to that store; a :class:`RankFailure` carries every rank's last status.

Under torchrun (any number of nodes) each process torchrun starts is the *supervisor* of one rank:
it starts that rank as its own child, exactly as above, and watches it (with "forkserver" it forks
the rank itself when it runs a single thread, as the CLI's supervisors do: it has imported torch and
the stack already, and a fork server would import them again). Supervisors share torchrun's
store (the agent's ``TCPStore``, ``MASTER_ADDR:MASTER_PORT``); the ranks rendezvous through it under
a key prefix of their own. A rank that fails makes its supervisor post an abort; every supervisor
then stops its rank, and every supervisor posts how its rank ended. Global rank 0's supervisor
assembles one :class:`RankFailure` (or, on success, the results, which the ranks gather to rank 0
over their process group) and shares the verdict, so every supervisor raises the same failure. A
supervisor never dies with its rank, so torchrun's agents see no worker fail before the verdict is
out. torchrun must run with ``--max-restarts 0``: :func:`torchrun_job` refuses anything else.
"""

from __future__ import annotations

import ctypes
import dataclasses
import faulthandler
import gc
import importlib
import json
import multiprocessing as mp
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing import connection
from typing import Any

import torch
import torch.distributed as dist

from parity.distributed.determinism import apply_determinism
from parity.distributed.pins import pinned_before_torch, pinned_environ
from parity.harness.forkserver import context, forks_cpu_ranks, preload
from parity.harness.torchrun_env import refuse_restarts, under_torchrun

__all__ = [
    "FailedRank",
    "LaunchConfig",
    "RankContext",
    "RankFailure",
    "TorchrunJob",
    "free_port",
    "launch",
    "torchrun_job",
    "under_torchrun",
]

_BACKENDS = ("gloo", "nccl")
_DEVICES = ("cpu", "cuda")
_START_METHODS = ("spawn", "forkserver")
_TRACEBACK_LINES = 20  # lines of a rank's traceback kept in the RankFailure message
_POLL_S = 0.5  # under torchrun: how often a supervisor looks for an abort posted by another node
_STORE_PREFIX = "parity"  # every key parity puts in a rendezvous store lives under this prefix


@dataclass(kw_only=True)
class LaunchConfig:
    """How to run the ranks."""

    world_size: int = 2
    """Number of ranks. Under torchrun it must equal torchrun's WORLD_SIZE."""
    backend: str = "gloo"
    """"gloo" (CPU or CUDA tensors) or "nccl" (CUDA only, one GPU per rank)."""
    device: str = "cpu"
    """"cpu" or "cuda". With cuda each rank uses GPU ``local_rank`` (modulo the GPU count for gloo)."""
    timeout_s: float = 120.0
    """Timeout of each collective and of the rendezvous, in seconds."""
    deadline_s: float | None = 1800.0
    """Watchdog: the whole run (start-up included) must end within this many seconds; None: no limit."""
    grace_s: float = 5.0
    """Seconds between SIGTERM and SIGKILL when the launcher stops ranks."""
    master_addr: str = "127.0.0.1"
    """Address the rendezvous store listens on."""
    master_port: int = 0
    """Port of the rendezvous store; 0 lets the OS pick a free one."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment overrides for every rank, applied before the determinism defaults."""
    allow_nondeterministic: bool = False
    """Run even if the environment violates the determinism rules (they become warnings)."""
    num_threads: int | None = 1
    """torch.set_num_threads and numpy's BLAS threads in every rank; None leaves torch's default and
    the BLAS pool as the rank's process loaded it (one thread in a fork server, a spawned rank or a
    pinned CLI: parity.distributed.pins.LOAD_ENV)."""
    prefix_output: bool = True
    """Prefix each line a rank prints from Python with ``[rank N]``."""
    bind_cpu_ranks: bool = True
    """CPU ranks at least as many as the CPUs the launching process may use on this host, and at
    most twice as many, are each bound to one of them, consecutive local ranks to the same CPU. A
    rank's threads (its own and gloo's) then hand work to one another on one CPU instead of waking
    each other across CPUs: 2 ranks on 2 CPUs ran 5% faster (docs/measurements.md, sixth session), 4
    ranks 8% faster (seventeenth session). Consecutive ranks form the EP groups, which exchange
    tokens in every MoE layer: with them on one CPU, `default` (4 ranks, EP 2) ran 2-3% faster than
    with the ranks dealt round-robin (seventeenth session). Fewer ranks are left free to move:
    concurrent launches of them would all start on the same CPUs. More ranks are left free too:
    their work per step differs (an expert's tokens), and ranks bound four to a CPU leave that CPU
    idle while they wait for the ranks of the other; free, the scheduler fills it (8 ranks on 2
    CPUs under SCHED_BATCH: 3.5% faster free, seventeenth session). CUDA ranks are never bound."""
    batch_scheduling: bool = True
    """CPU ranks at least as many as the CPUs (as for :attr:`bind_cpu_ranks`) run every thread under
    Linux's SCHED_BATCH policy: a thread that wakes (a rank whose collective completed, a gloo
    thread with data) waits for the running one's time slice instead of preempting it. With 4
    ranks on a CPU, wake-up preemption switched ranks ten times as often and cost system time; under
    SCHED_BATCH 8 ranks on 2 CPUs ran 12-13% faster, with half the system time (docs/measurements.md,
    fifteenth session). The scheduling policy changes no bits. CUDA ranks are left as they are."""
    retain_freed_memory: bool = True
    """CPU ranks keep the memory they free in their heap for the next allocation (glibc's
    mallopt: no mmap for blocks up to 32 MiB, no trimming of the heap top). With glibc's defaults
    the many tensors of a few hundred KiB a step are mapped and unmapped each time, and every
    page is faulted in afresh. With this and :attr:`freeze_start_objects`, a world-4 MoE command
    faulted in a third as many pages, spent a third less system time and ran 12% faster
    (docs/measurements.md, twelfth session). The rank hands freed memory back to the OS only when
    it exits. CUDA ranks are left as they are."""
    freeze_start_objects: bool = True
    """Every rank moves the objects it holds when it starts (torch's and the stack's modules, about
    170k) out of the garbage collector's reach (``gc.freeze``): they live until the rank ends, and
    a full collection walked all of them, 0.2-0.3 s per CPU rank, copying each page it touched of
    a forked rank's memory (docs/measurements.md, twelfth session)."""
    checkpoints: bool = False
    """The ranks save or load a checkpoint: the process they are forked from imports the checkpoint
    code first (parity.harness.forkserver.CHECKPOINT_PRELOAD), rather than every rank."""
    start_method: str = "spawn"
    """"spawn": every rank is a fresh interpreter (imports torch itself: about 1.3 s of CPU per rank).
    "forkserver": ranks are forked from a server process that imported torch once per parent
    process; the first launch pays that import, later launches start in well under a second.
    Never a plain "fork" of a process that runs other threads: the child would inherit locks held
    by threads it does not have (a single-threaded process pinned before torch forks, see
    _start_method).
    Either way a rank's stdout/stderr are the launching process's at the time of the launch."""

    def __post_init__(self) -> None:
        def positive_int(name: str, value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"LaunchConfig.{name} must be a positive integer, got {value!r}")

        def positive_number(name: str, value: Any) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise ValueError(f"LaunchConfig.{name} must be a positive number of seconds, got {value!r}")

        positive_int("world_size", self.world_size)
        if self.backend not in _BACKENDS:
            raise ValueError(f"LaunchConfig.backend must be one of {_BACKENDS}, got {self.backend!r}")
        if self.device not in _DEVICES:
            raise ValueError(f"LaunchConfig.device must be one of {_DEVICES}, got {self.device!r}")
        if self.backend == "nccl" and self.device != "cuda":
            raise ValueError("LaunchConfig: backend 'nccl' needs device 'cuda' (use 'gloo' for CPU ranks)")
        positive_number("timeout_s", self.timeout_s)
        if self.deadline_s is not None:
            positive_number("deadline_s", self.deadline_s)
        if not isinstance(self.grace_s, (int, float)) or isinstance(self.grace_s, bool) or self.grace_s < 0:
            raise ValueError(f"LaunchConfig.grace_s must be >= 0 seconds, got {self.grace_s!r}")
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ValueError(f"LaunchConfig.master_addr must be a non-empty string, got {self.master_addr!r}")
        if not isinstance(self.master_port, int) or not 0 <= self.master_port <= 65535:
            raise ValueError(f"LaunchConfig.master_port must be an int in 0..65535, got {self.master_port!r}")
        bad_env = {k: v for k, v in self.env.items() if not (isinstance(k, str) and isinstance(v, str))}
        if bad_env:
            raise ValueError(f"LaunchConfig.env must map str to str, got {bad_env!r}")
        if self.num_threads is not None:
            positive_int("num_threads", self.num_threads)
        if self.start_method not in _START_METHODS:
            raise ValueError(
                f"LaunchConfig.start_method must be one of {_START_METHODS}, got {self.start_method!r}"
            )


@dataclass(frozen=True, kw_only=True)
class RankContext:
    """What ``fn`` gets as its first argument."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    device: torch.device
    backend: str
    launcher: str
    """How this rank was started: "spawn", "forkserver" or "fork" (by :func:`launch` itself), or
    "torchrun"."""
    determinism: dict[str, Any]
    """What :func:`~parity.distributed.determinism.apply_determinism` applied in this rank."""
    status_store: Any = field(default=None, repr=False, compare=False)
    """A client of the launcher's store (its own connection) that :meth:`post_status` writes to."""
    started: dict[str, float] = field(default_factory=dict)
    """Wall-clock marks of this rank's start (``time.time()``): ``entry`` (the launcher's code
    reached: interpreter and imports done), ``device`` (device chosen; on CUDA the context exists),
    ``group`` (process group initialized: every rank has joined). Empty under torchrun."""

    def post_status(self, status: dict[str, Any]) -> None:
        """Publish this rank's latest status (a small JSON-serialisable dict), replacing the last.

        The launcher keeps it beyond the rank's death: a :class:`RankFailure` carries the last
        status of every rank (``statuses``), e.g. to tell at which step a rank crashed or hung."""
        if self.status_store is not None:
            self.status_store.set(f"status/{self.rank}", json.dumps(status))


@dataclass(frozen=True)
class FailedRank:
    """One rank's failure, as the parent saw it."""

    rank: int
    reason: str
    """One line: what happened."""
    exitcode: int | None = None
    """How the process ended: exit code, or minus the signal number. None for a rank that missed
    the deadline: it did not end by itself (the launcher then killed it)."""
    error: str | None = None
    """``ExceptionType: message`` when the rank raised."""
    traceback: str | None = None
    """The rank's full traceback text when it raised."""
    at: float | None = None
    """Wall-clock time the rank raised (its own clock), when it raised."""
    deadline: bool = False
    """True for a rank the watchdog stopped at the deadline."""


class RankFailure(RuntimeError):
    """A rank failed, died, or missed the deadline; all other ranks were stopped."""

    exit_code = 3

    def __init__(self, failures: list[FailedRank], stopped: list[int], pids: dict[int, int],
                 statuses: dict[int, dict] | None = None):
        self.failures = failures
        """Failed ranks, first observed first; ``failures[0]`` is the one that ended the run."""
        self.stopped = stopped
        """Ranks the launcher terminated because of the failure."""
        self.pids = pids
        """Process id of every rank that was started, by rank (all reaped by now; under torchrun
        each pid is one on the node of that rank)."""
        self.statuses = statuses or {}
        """The last status each rank posted (:meth:`RankContext.post_status`), by rank."""
        super().__init__(self._message())


    @property
    def rank(self) -> int:
        """The rank that ended the run."""
        return self.failures[0].rank

    def _message(self) -> str:
        first = self.failures[0]
        lines = [f"rank {first.rank} failed: {first.reason}"]
        if first.traceback:
            tb = first.traceback.rstrip().splitlines()
            if len(tb) > _TRACEBACK_LINES:
                tb = ["..."] + tb[-_TRACEBACK_LINES:]
            lines += ["  " + line for line in tb]
        for other in self.failures[1:]:
            lines.append(f"also: rank {other.rank}: {other.reason}")
        if self.stopped:
            lines.append(f"stopped by the launcher: rank(s) {', '.join(map(str, self.stopped))}")
        return "\n".join(lines)


_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port for a server that another process starts later (a torchrun rendezvous, a
    MASTER_PORT): free a moment ago, and where the kernel can tell, outside the range it hands out
    to ``bind(0)`` and ``connect()``, where gloo's listeners and the stores take theirs meanwhile
    (docs/spec/platform.md s1.4). Only another process choosing ports this way can still take it
    first."""
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            low, high = (int(v) for v in f.read().split())
    except (OSError, ValueError):  # not Linux: any port bind(0) gives
        low, high = 10000, 65535
    below, above = range(10000, low), range(max(10000, high + 1), 65536)
    pool = below if len(below) >= len(above) else above
    rng = random.Random()  # its own: the caller's seeding of the random module must not matter
    tries = 200 if len(pool) >= 1000 else 0  # a sliver of a range outside is not worth searching
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        for port in (rng.choice(pool) for _ in range(tries)):
            try:
                s.bind((host, port))
                return port
            except OSError:  # in use: try another
                pass
        s.bind((host, 0))
        return s.getsockname()[1]


def launch(fn: Callable[..., Any], cfg: LaunchConfig | None, *args: Any) -> list[Any] | None:
    """Run ``fn(ctx, *args)`` on every rank and return the results in rank order.

    Under torchrun (RANK and WORLD_SIZE set) this process supervises rank RANK only: it starts it,
    watches it and the other supervisors, and the ranks gather their results to rank 0 over their
    process group. Every supervisor of the job must call ``launch`` the same number of times, in
    the same order, with the same ``cfg.world_size`` (= torchrun's WORLD_SIZE).

    Args:
        fn: top-level function ``fn(ctx: RankContext, *args)``; its result must be picklable.
        cfg: launch settings; None for the defaults.
        *args: passed to ``fn`` in every rank; must be picklable.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``; under torchrun that list on global rank 0
        and None on every other rank.

    Raises:
        DeterminismError: the environment violates the determinism rules (nothing was started).
        RankFailure: a rank failed; every rank has been stopped. Under torchrun every supervisor
            raises the same failure, assembled from all nodes.
    """
    cfg = LaunchConfig() if cfg is None else cfg
    if under_torchrun():
        return _launch_under_torchrun(fn, cfg, args)
    return _spawn_and_monitor(fn, cfg, args)


# ---------------------------------------------------------------------------------------------
# Torchrun: this process supervises one rank; the supervisors meet in torchrun's store
# ---------------------------------------------------------------------------------------------


class TorchrunJob:
    """This process's place in a torchrun job, and a namespace of the job's store for parity.

    Keys are numbered by a per-process sequence: every supervisor makes the same calls in the same
    order, so the n-th call of each names the same keys. Nothing here is a collective over a
    process group (supervisors have none); everything goes through the store torchrun serves.
    """

    def __init__(self, env: dict[str, str] | None = None, timeout_s: float = 300.0):
        env = os.environ if env is None else env
        self.rank = int(env["RANK"])
        """Global rank of the rank this process supervises."""
        self.world_size = int(env["WORLD_SIZE"])
        """Number of ranks in the job (all nodes)."""
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        """Rank on this node (the GPU index on CUDA)."""
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        """Ranks on this node."""
        refuse_restarts(env)
        self.addr = env.get("MASTER_ADDR", "127.0.0.1")
        """Host of torchrun's store."""
        self.port = int(env.get("MASTER_PORT", "0"))
        """Port of torchrun's store."""
        # torchrun's agent serves the store (the default); else rank 0 serves it, as env:// does.
        hosts = env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" and self.rank == 0
        run_id = env.get("TORCHELASTIC_RUN_ID", "none")
        self.prefix = f"{_STORE_PREFIX}/{run_id}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        """Key prefix of everything parity puts in the store for this job."""
        self.timeout_s = timeout_s
        try:
            tcp = dist.TCPStore(self.addr, self.port, is_master=hosts, timeout=timedelta(seconds=timeout_s),
                                wait_for_workers=False)
        except Exception as exc:
            raise self._lost(f"cannot reach it ({type(exc).__name__}: {exc})") from None
        self.store = dist.PrefixStore(self.prefix, tcp)  # holds the TCPStore (and its server on rank 0)
        """The job's store, under :attr:`prefix`."""
        self._seq = 0

    def _lost(self, what: str) -> Exception:
        from parity.harness.errors import RuntimeFailure

        return RuntimeFailure(f"torchrun store {self.addr}:{self.port}: {what}")

    def next_prefix(self, name: str) -> str:
        """A fresh key prefix, the same on every supervisor for its n-th call."""
        self._seq += 1
        return f"{self._seq}-{name}"

    def wait(self, keys: list[str], timeout_s: float, what: str) -> None:
        try:
            self.store.wait(keys, timedelta(seconds=timeout_s))
        except Exception as exc:
            raise self._lost(f"no {what} within {timeout_s:.0f} s ({type(exc).__name__}: "
                             f"{str(exc).splitlines()[0] if str(exc) else ''})") from None

    def broadcast(self, name: str, obj: Any = None, timeout_s: float | None = None) -> Any:
        """Rank 0's ``obj``, on every rank (others pass anything)."""
        key = f"{self.next_prefix(name)}/value"
        if self.rank == 0:
            self.store.set(key, pickle.dumps(obj))
            return obj
        self.wait([key], self.timeout_s if timeout_s is None else timeout_s, f"{name} from rank 0")
        return pickle.loads(self.store.get(key))

    def allgather(self, name: str, obj: Any, timeout_s: float | None = None) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank; also a barrier."""
        prefix = self.next_prefix(name)
        self.store.set(f"{prefix}/{self.rank}", pickle.dumps(obj))
        keys = [f"{prefix}/{r}" for r in range(self.world_size)]
        self.wait(keys, self.timeout_s if timeout_s is None else timeout_s, f"{name} from every rank")
        values = [pickle.loads(v) for v in self.store.multi_get(keys)]
        # Nobody leaves before everyone has read: the store may go when the first process exits.
        done = f"{prefix}/read"
        if self.store.add(done, 1) == self.world_size:
            self.store.set(f"{prefix}/all-read", b"1")
        self.wait([f"{prefix}/all-read"], self.timeout_s if timeout_s is None else timeout_s,
                  f"{name}: every rank reading")
        return values


_JOB: TorchrunJob | None = None


def torchrun_job() -> TorchrunJob:
    """The torchrun job this process belongs to (made on first use; connects to torchrun's store).

    Raises:
        ConfigError: torchrun runs with --max-restarts above 0.
        RuntimeFailure: torchrun's store cannot be reached.
    """
    global _JOB
    if _JOB is None:
        _JOB = TorchrunJob()
    return _JOB


def _launch_under_torchrun(fn: Callable[..., Any], cfg: LaunchConfig, args: tuple) -> list[Any] | None:
    job = torchrun_job()
    if cfg.world_size != job.world_size:
        raise ValueError(
            f"launched by torchrun with WORLD_SIZE={job.world_size} but LaunchConfig.world_size={cfg.world_size}"
        )
    ns_name = job.next_prefix("launch")
    ns = dist.PrefixStore(ns_name, job.store)
    me = job.rank

    def abort() -> str | None:
        try:
            return "a rank on another node failed" if ns.check(["abort"]) else None
        except Exception as exc:
            return f"torchrun's store is gone ({type(exc).__name__})"

    plan = _RankPlan(rank=me, world_size=job.world_size, local_rank=job.local_rank,
                     local_world_size=job.local_world_size, store_addr=job.addr, store_port=job.port,
                     store_prefix=f"{job.prefix}/{ns_name}", gather=True, launcher="torchrun")
    out = _supervise(fn, cfg, args, [plan], abort)
    outcome = {"ok": me in out.results, "failures": out.failures, "stopped": out.stopped, "pids": out.pids}
    # Bounded: once any rank failed every supervisor stops its rank within _POLL_S + grace_s.
    wait_s = cfg.timeout_s + cfg.grace_s + 60.0
    try:
        if out.failures:
            ns.set("abort", str(me))
        ns.set(f"outcome/{me}", pickle.dumps(outcome))
        if me == 0:
            verdict = _job_verdict(ns, job.world_size, outcome, wait_s)
            ns.set("verdict", pickle.dumps(verdict))
        else:
            ns.wait(["verdict"], timedelta(seconds=2 * wait_s))
            verdict = pickle.loads(ns.get("verdict"))
    except Exception as exc:  # the store is gone (an agent exited) or rank 0's supervisor is
        raise job._lost(f"lost while the ranks' outcomes were collected ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); this rank "
                        f"{'failed: ' + out.failures[0].reason if out.failures else 'had no failure'}") from None
    if verdict["ok"]:
        return out.results[me] if me == 0 else None
    raise RankFailure(verdict["failures"], verdict["stopped"], verdict["pids"], verdict["statuses"])


def _job_verdict(ns: Any, world_size: int, mine: dict, wait_s: float) -> dict:
    """Rank 0's supervisor: every supervisor's outcome, made into one verdict."""
    outcomes = {0: mine}
    end = time.monotonic() + wait_s
    for r in range(1, world_size):
        try:
            ns.wait([f"outcome/{r}"], timedelta(seconds=max(0.1, end - time.monotonic())))
            outcomes[r] = pickle.loads(ns.get(f"outcome/{r}"))
        except Exception:
            outcomes[r] = None
    if all(o is not None and o["ok"] for o in outcomes.values()):
        return {"ok": True}
    failures: list[FailedRank] = []
    stopped: list[int] = []
    pids: dict[int, int] = {}
    for r, o in sorted(outcomes.items()):
        if o is None:
            failures.append(FailedRank(rank=r, reason=f"its supervisor (the torchrun worker of rank {r}) "
                                                      f"reported nothing within {wait_s:.0f} s"))
            continue
        failures += o["failures"]
        stopped += o["stopped"]
        pids.update(o["pids"])
    if not failures:  # every rank was stopped, none failed by itself (e.g. the store went away)
        failures = [FailedRank(rank=r, reason="stopped: torchrun's store or another supervisor went away")
                    for r in stopped]
        stopped = []
    statuses = {}
    for r in range(world_size):
        try:
            if ns.check([f"status/{r}"]):
                statuses[r] = json.loads(ns.get(f"status/{r}"))
        except Exception:
            pass
    return {"ok": False, "failures": _cause_first(failures), "stopped": sorted(stopped), "pids": pids,
            "statuses": statuses}


def _rank_device(cfg: LaunchConfig, local_rank: int, local_world_size: int) -> torch.device:
    """The device of a rank; for CUDA also makes it the current device."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 0:
        raise RuntimeError("LaunchConfig.device='cuda' but no CUDA device is visible")
    if cfg.backend == "nccl" and count < local_world_size:
        raise RuntimeError(
            f"nccl needs one GPU per rank: {local_world_size} local ranks, {count} GPU(s) visible "
            f"(NCCL refuses several ranks on one GPU; use backend='gloo' for that)"
        )
    device = torch.device("cuda", local_rank % count)
    torch.cuda.set_device(device)
    return device


# ---------------------------------------------------------------------------------------------
# Spawned ranks: child side
# ---------------------------------------------------------------------------------------------


class _PrefixedStream:
    """Writes whole lines to ``stream``, each prefixed; a partial line waits for its newline."""

    def __init__(self, stream: Any, prefix: str):
        self._stream = stream
        self._prefix = prefix
        self._partial = ""
        self._lock = threading.Lock()

    def write(self, text: str) -> int:
        with self._lock:
            self._partial += text
            if "\n" in self._partial:
                *lines, self._partial = self._partial.split("\n")
                # One write per batch of lines, so lines of different ranks do not interleave.
                self._stream.write("".join(f"{self._prefix}{line}\n" for line in lines))
                self._stream.flush()
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def close_partial(self) -> None:
        """Write out a trailing line that never got its newline."""
        with self._lock:
            if self._partial:
                self._stream.write(f"{self._prefix}{self._partial}\n")
                self._partial = ""
            self._stream.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, isatty, encoding, ...
        return getattr(self._stream, name)


class _InheritedFd:
    """Pickles as a duplicate of file descriptor ``fd`` that the rank receives (as an int).

    Used for stdout/stderr: a fork server's own descriptors are the ones the parent had when the
    server started (e.g. before pytest swapped its capture files), not the current ones.
    """

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return (_InheritedFd._receive, (reduction.DupFd(self.fd),))

    @staticmethod
    def _receive(dup: Any) -> int:
        return dup.detach()


def _adopt_std_streams(stdout_fd: int, stderr_fd: int) -> None:
    for stream, target, fd in ((sys.stdout, 1, stdout_fd), (sys.stderr, 2, stderr_fd)):
        try:
            stream.flush()
        except Exception:
            pass
        if fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _die_with_parent(lifeline: connection.Connection, parent_pid: int | None) -> None:
    """Make this rank exit as soon as the launching process dies.

    ``lifeline`` is this rank's end of a socket pair whose other end the launching process holds
    and no longer writes to (its one message, the store's port, has been read): it turns readable
    (EOF) when that process is gone, however it went. This also covers "forkserver" ranks, whose
    OS parent is the fork server (the server exits once the launching process and all its ranks
    are gone). With "spawn" or "fork" the launching process is the OS parent, and
    ``PR_SET_PDEATHSIG`` (Linux) also kills the rank at once; that also covers a forked rank whose
    later-forked siblings inherited a copy of the other end.
    """
    if parent_pid is not None:
        if sys.platform.startswith("linux"):
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                pr_set_pdeathsig = 1
                libc.prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
            except (OSError, AttributeError):
                pass  # the lifeline still covers it
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    def watch() -> None:
        try:
            lifeline.poll(None)  # returns on EOF: nothing is ever sent this way
        except Exception:
            pass
        os._exit(1)

    threading.Thread(target=watch, name="parity-parent-watch", daemon=True).start()


def _exit(code: int) -> None:
    """Flush Python's streams and leave without interpreter teardown.

    Teardown can block: c10d's background threads, and destructors of communicators whose peers
    are gone. Whatever the rank had to say has already been sent through the pipe.
    """
    for stream in (sys.stdout, sys.stderr):
        try:
            if isinstance(stream, _PrefixedStream):
                stream.close_partial()
            else:
                stream.flush()
        except Exception:
            pass
    os._exit(code)


@dataclass(frozen=True, kw_only=True)
class _RankPlan:
    """Where one spawned rank sits and how it meets its peers."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    store_addr: str
    store_port: int
    """0: the port comes over the rank's pipe, once the launching process serves the store (the
    built-in launcher starts its ranks first, so that a fork copies a single-threaded process)."""
    store_prefix: str
    """Key prefix of this launch in the store: the process group under ``<prefix>/pg``, statuses
    under ``<prefix>/status/<rank>``."""
    gather: bool
    """Gather every rank's result to rank 0 over the process group (rank 0 returns the list,
    the others None): torchrun, where no single parent sees every rank."""
    launcher: str


def _share_the_cpus(cfg: LaunchConfig, local_rank: int, local_world_size: int) -> None:
    """Where this host has at least as many CPU ranks as CPUs this process may use: bind it to one
    of them, consecutive local ranks to the same CPU, if they are at most twice as many
    (:attr:`LaunchConfig.bind_cpu_ranks`), and schedule its
    threads, and those it starts, as batch work (:attr:`LaunchConfig.batch_scheduling`)."""
    if cfg.device != "cpu" or not hasattr(os, "sched_getaffinity"):  # not Linux
        return
    cpus = sorted(os.sched_getaffinity(0))
    if local_world_size < len(cpus):
        return
    if cfg.bind_cpu_ranks and local_world_size <= 2 * len(cpus):
        # neighbours share a CPU: an EP group is a block of consecutive ranks
        os.sched_setaffinity(0, {cpus[local_rank * len(cpus) // local_world_size]})
    if cfg.batch_scheduling:
        for tid in thread_ids():  # a forked rank has one; threads started later inherit the policy
            try:
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
            except OSError:  # refused (a sandbox): slower, not wrong; the report lists the policies
                pass


def thread_ids() -> list[int]:
    """The ids of this process's threads (Linux: /proc/self/task)."""
    return [int(t) for t in os.listdir("/proc/self/task")]


# glibc mallopt parameters (malloc.h); 32 MiB is the largest mmap threshold every glibc accepts.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 1 << 30  # mallopt takes a C int


def _retain_freed_memory() -> None:
    """Keep freed blocks of up to 32 MiB in this process's heap (see
    :attr:`LaunchConfig.retain_freed_memory`). Both settings together: either alone turns off
    glibc's adaptive threshold and leaves the other at its 128 KiB default, which faults more
    pages than before. Nothing happens where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library handle, or no mallopt in it
        return
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)


def _rank_main(
    plan: _RankPlan,
    cfg: LaunchConfig,
    payload: bytes,
    conn: connection.Connection,
    parent_pid: int | None,
    parent_env: dict[str, str],
    std_fds: tuple[int, int],
) -> None:
    """Entry point of a spawned rank. Never returns: it ends with ``os._exit``."""
    started = {"entry": time.time()}
    rank, world_size = plan.rank, plan.world_size
    # A forked rank has its parent's Python-level signal handlers and streams (a torchrun
    # supervisor turns SIGTERM into KeyboardInterrupt and silences stdout on ranks > 0): start
    # from what a fresh interpreter has, so that a rank stopped by SIGTERM dies of it.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    store_port = plan.store_port
    if not store_port:  # the one message the parent sends, before the pipe becomes the lifeline
        try:
            store_port = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            os._exit(1)  # the parent is gone before it served the store
    _die_with_parent(conn, parent_pid)
    _share_the_cpus(cfg, plan.local_rank, plan.local_world_size)
    if cfg.device == "cpu" and cfg.retain_freed_memory:
        _retain_freed_memory()
    if cfg.freeze_start_objects:
        gc.freeze()
    _adopt_std_streams(*std_fds)
    # A rank killed by a fatal signal (SIGSEGV in native code) prints the Python stack of the thread
    # that took the signal to its stderr first, so the failure says where it happened. Only that
    # thread's: the others may be running, and walking a running thread's frames from a signal
    # handler can crash before it reaches the one that matters (docs/spec/platform.md s1.3).
    faulthandler.enable(all_threads=False)
    if cfg.prefix_output:
        sys.stdout = _PrefixedStream(sys.stdout, f"[rank {rank}] ")
        sys.stderr = _PrefixedStream(sys.stderr, f"[rank {rank}] ")
    try:
        # The launching process's environment as of this launch: a fork server's copy dates from
        # the server's start.
        if dict(os.environ) != parent_env:
            os.environ.clear()
            os.environ.update(parent_env)
        os.environ.update(cfg.env)
        os.environ.update(
            MASTER_ADDR=plan.store_addr, MASTER_PORT=str(store_port), RANK=str(rank),
            WORLD_SIZE=str(world_size), LOCAL_RANK=str(plan.local_rank),
            LOCAL_WORLD_SIZE=str(plan.local_world_size),
        )
        # Before any communicator or CUDA context exists.
        applied = apply_determinism(
            os.environ, allow_nondeterministic=cfg.allow_nondeterministic, num_threads=cfg.num_threads
        )
        fn, args = pickle.loads(payload)
        device = _rank_device(cfg, plan.local_rank, plan.local_world_size)
        if device.type == "cuda":
            torch.empty(0, device=device)  # the CUDA context now, so that "device" times it
        started["device"] = time.time()
        timeout = timedelta(seconds=cfg.timeout_s)

        def client() -> Any:
            return dist.TCPStore(plan.store_addr, store_port, is_master=False, timeout=timeout)

        store = dist.PrefixStore(f"{plan.store_prefix}/pg", client())
        dist.init_process_group(cfg.backend, store=store, rank=rank, world_size=world_size, timeout=timeout)
        if cfg.backend == "gloo" and world_size > 1:
            # gloo connects every pair as the group is made, and a rank can be done with its side
            # while its peer still reads the handshake: a rank that then ran a short fn and exited
            # made that peer fail in gloo. After the barrier every connection is up on every rank.
            dist.barrier()
        started["group"] = time.time()
        conn.send_bytes(pickle.dumps(("ready", None)))
        ctx = RankContext(
            rank=rank, world_size=world_size, local_rank=plan.local_rank,
            local_world_size=plan.local_world_size, device=device, backend=cfg.backend,
            launcher=plan.launcher, determinism=applied,
            # Its own connection: a status posted from a thread never shares a socket with the group.
            status_store=dist.PrefixStore(plan.store_prefix, client()), started=started,
        )
        result = fn(ctx, *args)
        if plan.gather:
            gathered = [None] * world_size if rank == 0 else None
            dist.gather_object(result, gathered, dst=0)
            result = gathered
        try:
            message = pickle.dumps(("ok", result))
        except Exception as exc:
            raise TypeError(f"the result of fn is not picklable: {type(exc).__name__}: {exc}") from None
    except BaseException as exc:  # SystemExit and KeyboardInterrupt too: report, then leave
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        try:
            conn.send_bytes(pickle.dumps(("error", (summary, traceback.format_exc(), time.time()))))
        except Exception:
            pass  # parent gone or pipe broken: the exit code still tells
        _exit(1)
    try:
        conn.send_bytes(message)
    except Exception:
        _exit(1)
    try:
        dist.destroy_process_group()
    except Exception:
        pass  # the result is delivered; a teardown error must not turn it into a failure
    _exit(0)


# ---------------------------------------------------------------------------------------------
# Spawned ranks: parent side
# ---------------------------------------------------------------------------------------------


def _describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _cause_first(failures: list[FailedRank]) -> list[FailedRank]:
    """``failures`` ordered so the likely cause of the run's end comes first.

    The parent may see events in another order than they happened: a rank's exit status can reach
    it after the errors its death caused in its peers ("connection closed by peer"), in particular
    through a fork server, which relays exit statuses, and under torchrun, where each node sees
    its own ranks. So: ranks that missed the deadline first (the watchdog's reason to stop), then
    ranks that ended without reporting an error (exit code, signal), then ranks that raised, in
    the order they raised.
    """

    def key(item: tuple[int, FailedRank]) -> tuple[int, float, int]:
        seen, f = item
        if f.deadline:
            return (0, 0.0, seen)
        if f.error is None:
            return (1, 0.0, seen)
        return (2, f.at if f.at is not None else float("inf"), seen)

    return [f for _, f in sorted(enumerate(failures), key=key)]


class _Monitor:
    """Parent-side bookkeeping for one launch."""

    def __init__(self, world_size: int, ranks: list[int] | None = None):
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, connection.Connection] = {}
        self.ready: set[int] = set()
        self.results: dict[int, Any] = {}
        self.errors: dict[int, tuple[str, str, float]] = {}  # summary, traceback, when (wall clock)
        self.finished: set[int] = set()  # exited 0 after delivering a result
        self.failures: list[FailedRank] = []
        self.deadline_missed: set[int] = set()
        self.world_size = world_size
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        """The ranks this process started (all of them, or under torchrun its one rank)."""

    def pending(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished and r not in self.failed_ranks()]

    def failed_ranks(self) -> set[int]:
        return {f.rank for f in self.failures}

    def drain(self, rank: int) -> None:
        """Read every message rank ``rank`` has sent so far."""
        conn = self.conns.get(rank)
        if conn is None:
            return
        try:
            while conn.poll():
                kind, value = pickle.loads(conn.recv_bytes())
                if kind == "ready":
                    self.ready.add(rank)
                elif kind == "ok":
                    self.results[rank] = value
                elif kind == "error":
                    self.errors[rank] = value
                    self.fail(rank, exitcode=None)
        except (EOFError, OSError):
            conn.close()
            del self.conns[rank]

    def fail(self, rank: int, exitcode: int | None, reason: str | None = None) -> None:
        if rank in self.failed_ranks():
            return
        error, tb, at = self.errors.get(rank, (None, None, None))
        if reason is None:
            reason = f"raised {error}" if error else _describe_exit(exitcode)
        self.failures.append(FailedRank(rank=rank, reason=reason, exitcode=exitcode, error=error, traceback=tb,
                                        at=at, deadline=rank in self.deadline_missed))

    def cause_first(self) -> None:
        """Order ``failures`` so the likely cause of the run's end comes first (:func:`_cause_first`)."""
        self.failures = _cause_first(self.failures)

    def on_exit(self, rank: int) -> None:
        """Rank ``rank``'s process has ended."""
        proc = self.procs[rank]
        proc.join()
        self.drain(rank)
        code = proc.exitcode
        if rank in self.errors:
            self.failures = [dataclasses.replace(f, exitcode=code) if f.rank == rank else f for f in self.failures]
        elif code == 0 and rank in self.results:
            self.finished.add(rank)
        elif code == 0:
            self.fail(rank, code, "exited with code 0 without returning a result")
        else:
            where = "" if rank in self.ready else " during start-up (before init_process_group returned)"
            self.fail(rank, code, _describe_exit(code) + where)


def _stop(procs: dict[int, Any], grace_s: float) -> list[int]:
    """SIGTERM every live rank, SIGKILL those still alive after ``grace_s``, reap all."""
    alive = {r: p for r, p in procs.items() if p.is_alive()}
    for p in alive.values():
        try:
            p.terminate()
        except Exception:
            pass
    end = time.monotonic() + grace_s
    waiting = [p for p in alive.values() if p.exitcode is None]
    while waiting and time.monotonic() < end:
        connection.wait([p.sentinel for p in waiting], timeout=max(0.0, end - time.monotonic()))
        waiting = [p for p in waiting if p.exitcode is None]
    for p in waiting:
        try:
            p.kill()
        except Exception:
            pass
    for p in procs.values():
        if p.pid is not None:
            p.join()
    return sorted(alive)


@dataclass
class _Outcome:
    """How the ranks one process started ended."""

    results: dict[int, Any]
    """Results of the ranks that delivered one."""
    failures: list[FailedRank]
    """Failed ranks, cause first (empty when none failed)."""
    stopped: list[int]
    """Ranks this process terminated (another rank failed, or an abort came)."""
    pids: dict[int, int]
    deadline_missed: set[int]


def _spawn_and_monitor(fn: Callable[..., Any], cfg: LaunchConfig, args: tuple) -> list[Any]:
    """The built-in launcher: every rank a child of this process, which serves their store."""
    timeout = timedelta(seconds=cfg.timeout_s)
    plans = [_RankPlan(rank=r, world_size=cfg.world_size, local_rank=r, local_world_size=cfg.world_size,
                       store_addr=cfg.master_addr, store_port=0, store_prefix=_STORE_PREFIX,
                       gather=False, launcher=cfg.start_method) for r in range(cfg.world_size)]
    served = []

    def serve() -> int:
        # Only once the ranks are started: the store's server threads would make a fork unsafe.
        # Binding port 0 lets the OS pick a free port with no window in which another process
        # could take it, and the store outlives any rank.
        served.append(dist.TCPStore(cfg.master_addr, cfg.master_port, is_master=True, timeout=timeout,
                                    wait_for_workers=False))
        return served[0].port

    try:
        out = _supervise(fn, cfg, args, plans, abort=None, serve=serve)
        if out.failures:
            statuses = {}
            if served:
                ns = dist.PrefixStore(_STORE_PREFIX, served[0])
                for rank in range(cfg.world_size):
                    if ns.check([f"status/{rank}"]):
                        statuses[rank] = json.loads(ns.get(f"status/{rank}"))
            raise RankFailure(out.failures, out.stopped, out.pids, statuses)
    finally:
        served.clear()
    return [out.results[rank] for rank in range(cfg.world_size)]


def _single_threaded() -> bool:
    """Whether this process runs one OS thread (Linux; elsewhere assumed not): then a fork copies
    every thread there is, and no lock can be held by a thread the child lacks."""
    try:
        return len(os.listdir("/proc/self/task")) == 1
    except OSError:
        return False


def _start_method(cfg: LaunchConfig, launcher: str) -> str:
    """How this process starts its ranks: ``cfg.start_method``, except that a process asked for
    "forkserver" forks its ranks itself when it was pinned before torch loaded (as the CLI is) and
    runs a single thread: it has imported torch and the stack already, so its fork is what a fork
    server would give a rank, without a server importing them all again. A torchrun supervisor
    always does (no server started early for it to gain from; one that touched CUDA runs driver
    threads, and so keeps the server); the built-in launcher for CPU ranks on a machine with few
    CPUs (parity.harness.forkserver.FORK_MAX_CPUS; a CUDA driver the parent may have touched does
    not survive a fork)."""
    if cfg.start_method != "forkserver" or not _single_threaded():
        return cfg.start_method
    if launcher == "torchrun":
        return "fork" if pinned_before_torch() else cfg.start_method
    return "fork" if cfg.device == "cpu" and forks_cpu_ranks() else cfg.start_method


def _supervise(fn: Callable[..., Any], cfg: LaunchConfig, args: tuple, plans: list[_RankPlan],
               abort: Callable[[], str | None] | None, serve: Callable[[], int] | None = None) -> _Outcome:
    """Start one child per plan, watch them until all delivered or one failed, stop the rest.

    ``abort``: polled every ``_POLL_S``; a reason it returns (another node's rank failed) stops
    this process's ranks as a failure here would. ``serve``: called once every rank is started;
    the port it returns goes to each rank over its pipe (plans with ``store_port`` 0)."""
    if not cfg.allow_nondeterministic:
        # Fail before starting anything (each rank would raise the same DeterminismError);
        # checked on a copy, the parent's environment is left alone.
        apply_determinism({**os.environ, **cfg.env}, configure_torch=False)
    try:
        payload = pickle.dumps((fn, args))
    except Exception as exc:
        raise TypeError(
            f"launch: fn and args must be picklable (define fn at module top level): {type(exc).__name__}: {exc}"
        ) from None

    method = _start_method(cfg, plans[0].launcher)
    if plans[0].launcher != "torchrun":
        plans = [dataclasses.replace(plan, launcher=method) for plan in plans]
    if method == "fork":
        for name in preload(cfg.checkpoints):  # once here, rather than once in every rank
            importlib.import_module(name)
    if method == "forkserver":
        ctx = context(cfg.checkpoints)  # the server imported torch and the stack once (parity/harness/forkserver.py)
    else:
        ctx = mp.get_context(method)
    mon = _Monitor(plans[0].world_size, [p.rank for p in plans])
    deadline = None if cfg.deadline_s is None else time.monotonic() + cfg.deadline_s
    # The OS parent of the rank (a forkserver rank's is the fork server).
    parent_pid = None if method == "forkserver" else os.getpid()
    parent_env = dict(os.environ)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()  # what the parent printed comes before what the ranks print
        except Exception:
            pass
    # A fork server's descriptors date from its start: pass this process's (a fork has them).
    std_fds = (1, 2) if method == "fork" else (_InheritedFd(1), _InheritedFd(2))
    try:
        for plan in plans:
            # Duplex: the rank watches its end for EOF to notice the parent's death.
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=_rank_main,
                args=(plan, cfg, payload, child_end, parent_pid, parent_env, std_fds),
                name=f"parity-rank-{plan.rank}",
            )
            with pinned_environ():  # a spawned rank or the fork server loads numpy's BLAS pinned
                proc.start()
            child_end.close()  # only the rank holds its end: EOF there means the rank is gone
            mon.procs[plan.rank], mon.conns[plan.rank] = proc, parent_end
        if serve is not None:
            port = pickle.dumps(serve())
            for conn in mon.conns.values():
                try:
                    conn.send_bytes(port)
                except OSError:
                    pass  # that rank is gone already: its exit is judged below

        while mon.pending() and not mon.failures:
            wait_s = None if deadline is None else deadline - time.monotonic()
            if wait_s is not None and wait_s <= 0:
                for rank in mon.pending():
                    if rank in mon.results:
                        phase = "exiting after it returned its result"
                    else:
                        phase = "running fn" if rank in mon.ready else "starting up"
                    mon.deadline_missed.add(rank)
                    mon.fail(rank, None, f"did not finish within deadline_s={cfg.deadline_s} s (hung while {phase})")
                break
            if abort is not None:
                wait_s = _POLL_S if wait_s is None else min(wait_s, _POLL_S)
            waitables: dict[Any, tuple[str, int]] = {}
            for rank in mon.pending():
                waitables[mon.procs[rank].sentinel] = ("exit", rank)
                if rank in mon.conns:
                    waitables[mon.conns[rank]] = ("msg", rank)
            for obj in connection.wait(list(waitables), timeout=wait_s):
                kind, rank = waitables[obj]
                if kind == "msg":
                    mon.drain(rank)
            # Exits after messages, so a rank's last words are read before its exit is judged.
            for obj, (kind, rank) in waitables.items():
                if kind == "exit" and mon.procs[rank].exitcode is not None and rank in mon.pending():
                    mon.on_exit(rank)
            if abort is not None and mon.pending() and not mon.failures and abort() is not None:
                break  # the pending ranks are stopped below, as ranks stopped because of a failure
    finally:
        signalled = _stop(mon.procs, cfg.grace_s)
        for rank in list(mon.conns):
            mon.drain(rank)  # errors that ranks reported before they were stopped
        for conn in mon.conns.values():
            conn.close()

    # Every rank is reaped now. Ranks that ended by themselves without being recorded yet (their
    # exit status came late) are failures too; the ones that ended by the launcher's signals were
    # stopped.
    stopped: list[int] = []
    by_launcher = (-signal.SIGTERM, -signal.SIGKILL)
    for rank, proc in mon.procs.items():
        if rank in mon.finished or rank in mon.failed_ranks():
            continue
        if rank in signalled and proc.exitcode in by_launcher:
            stopped.append(rank)
        elif not (proc.exitcode == 0 and rank in mon.results):  # (a normal end just as we stopped)
            mon.on_exit(rank)
    mon.cause_first()
    failures = [  # how each failed rank ended; a rank that missed the deadline did not end by itself
        f if f.exitcode is not None or f.rank in mon.deadline_missed
        else dataclasses.replace(f, exitcode=mon.procs[f.rank].exitcode)
        for f in mon.failures
    ]
    pids = {rank: proc.pid for rank, proc in mon.procs.items()}
    return _Outcome(results=dict(mon.results), failures=failures, stopped=stopped, pids=pids,
                    deadline_missed=set(mon.deadline_missed))
