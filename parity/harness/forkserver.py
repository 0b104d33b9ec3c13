"""The fork server ranks are forked from, and starting it early.

Importing torch takes the server a second or more (on a CUDA host also loading torch's CUDA
libraries: measured 5-6 s per spawned rank on an H200 host, 0.1 s per forked one). The server only
imports: it never initializes CUDA, so every rank creates its own CUDA context (torch refuses CUDA
in a child forked after CUDA was initialized, so a mistake here fails loudly). A command starts
the server once its input is valid (those checks need no torch), so the server's imports run
beside the parent's own torch import, and bad input never pays for either (this module imports no
torch, so the start costs the parent nothing). The CLI's own CPU ranks need no server: it forks
them itself (see :func:`start_early`).
"""

from __future__ import annotations

import multiprocessing

from parity.harness.torchrun_env import under_torchrun

PRELOAD = ["parity.harness.launch", "torch._inductor.config", "parity.harness.driver"]
"""Imported once, in the server (or in a process that forks its ranks itself), so no rank imports
them again: torch with the launcher; torch._inductor.config, which torch.use_deterministic_algorithms
imports, and with it torch._dynamo, which torch.optim.Optimizer imports when it adds its first
param group (about 2 s of CPU per rank otherwise); the runner with the whole stack (what a rank's
entry point unpickles)."""


def context():
    """The forkserver start context, with the server's preload list set."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early(devices=("cpu",)) -> None:
    """Start the fork server now, in the background, for ranks on ``devices``. A no-op under
    torchrun (its supervisors start ranks themselves), when the server runs already, or when the
    ranks will be forked from this process instead: CPU ranks of a process pinned before torch
    loaded (parity.harness.launch._start_method; should that process run a second thread by the
    time it launches, the server starts then)."""
    from parity.distributed.pins import pinned_before_torch

    if under_torchrun() or (pinned_before_torch() and set(devices) <= {"cpu"}):
        return
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()
