"""The fork server ranks are forked from, and starting it early.

Importing torch takes the server a second or more (on a CUDA host also loading torch's CUDA
libraries: measured 5-6 s per spawned rank on an H200 host, 0.1 s per forked one). The server only
imports: it never initializes CUDA, so every rank creates its own CUDA context (torch refuses CUDA
in a child forked after CUDA was initialized, so a mistake here fails loudly). A command starts
the server once its input is valid (those checks need no torch), so the server's imports run
beside the parent's own torch import, and bad input never pays for either (this module imports no
torch, so the start costs the parent nothing). On a machine with few CPUs the CLI's own CPU ranks
need no server: it forks them itself (:data:`FORK_MAX_CPUS`).
"""

from __future__ import annotations

import multiprocessing
import os

from parity.distributed.pins import pinned_before_torch, pinned_environ
from parity.harness.torchrun_env import under_torchrun

PRELOAD = ["parity.harness.launch", "parity.harness.driver"]
"""Imported once, in the server (or in a process that forks its ranks itself), so no rank imports
them again: torch with the launcher, the runner with the whole stack (what a rank's entry point
unpickles). Nothing a rank runs imports torch._dynamo (about 1 s of CPU more):
parity.optim.eager and parity.distributed.determinism avoid the two torch calls that would."""

CHECKPOINT_PRELOAD = ["parity.harness.resume"]
"""Imported as well where the ranks save or load a checkpoint: the checkpoint code with
torch.distributed.checkpoint, about 0.65 s of CPU per process that imports it (105 ranks of the
suite's checkpointing tests each imported it themselves: docs/measurements.md, forty-fourth session)."""


def preload(checkpoints: bool) -> list[str]:
    """The modules a fork server (or a process forking its ranks itself) imports once for its ranks."""
    return PRELOAD + CHECKPOINT_PRELOAD if checkpoints else PRELOAD


FORK_MAX_CPUS = 2
"""A command pinned before torch (the CLI) forks its CPU ranks itself on a machine with at most this
many usable CPUs: there a fork server's imports compete with the command's own for the same cores,
and forking saves a whole import of torch and the stack (about 1.7 core-seconds a command on 2
cores, measured while torch._dynamo was still imported too: docs/measurements.md, fifth session).
With more CPUs the server, started as soon as the input is valid, imports on an idle core beside
the command and its ranks start sooner (1.5-2.5 s sooner on a 16-CPU H200 host, same page)."""


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask on Linux)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def forks_cpu_ranks() -> bool:
    """Whether this process forks its CPU ranks itself (built-in launcher) rather than using a fork
    server, provided it still runs a single thread when it launches (parity.harness.launch)."""
    return pinned_before_torch() and usable_cpus() <= FORK_MAX_CPUS


def context(checkpoints: bool = False):
    """The forkserver start context, with the preload list of a server not started yet
    (``checkpoints``: for ranks that save or load checkpoints)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(preload(checkpoints))
    return ctx


def start_early(devices=("cpu",), checkpoints: bool = False) -> None:
    """Start the fork server now, in the background, for ranks on ``devices`` (``checkpoints``:
    some of them save or load checkpoints). A no-op under torchrun (its supervisors start ranks
    themselves), when the server runs already, or when the ranks will be forked from this process
    instead (:func:`forks_cpu_ranks`, CPU ranks only; should the process run a second thread by the
    time it launches, the server starts then)."""
    if under_torchrun() or (forks_cpu_ranks() and set(devices) <= {"cpu"}):
        return
    from multiprocessing import forkserver

    context(checkpoints)
    with pinned_environ():  # its numpy loads OpenBLAS on the pinned kernels
        forkserver.ensure_running()


def start_early_for(scenarios, resume_from: bool = False) -> None:
    """:func:`start_early` for the ranks of ``scenarios``: on their devices, with the checkpoint code
    where one of them resumes mid-run (``resume_at``) or the run resumes from a checkpoint
    (``resume_from``)."""
    start_early({s.device for s in scenarios},
                checkpoints=resume_from or any(s.resume_at is not None for s in scenarios))
