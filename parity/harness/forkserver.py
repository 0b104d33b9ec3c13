"""The fork server ranks are forked from, and starting it early.

Importing torch takes the server a second or more (on a CUDA host also loading torch's CUDA
libraries: measured 5-6 s per spawned rank on an H200 host, 0.1 s per forked one). The server only
imports: it never initializes CUDA, so every rank creates its own CUDA context (torch refuses CUDA
in a child forked after CUDA was initialized, so a mistake here fails loudly). A command starts
the server once its input is valid (those checks need no torch), so the server's imports run
beside the parent's own torch import, and bad input never pays for either (this module imports no
torch, so the start costs the parent nothing).
"""

from __future__ import annotations

import multiprocessing

from parity.harness.torchrun_env import under_torchrun

PRELOAD = ["parity.harness.launch", "torch._inductor.config", "parity.harness.driver"]
"""Imported once, in the server, so no rank imports them again: torch with the launcher;
torch._inductor.config, which torch.use_deterministic_algorithms imports (about 1 s of CPU per
rank otherwise); the runner with the whole stack (what a rank's entry point unpickles)."""


def context():
    """The forkserver start context, with the server's preload list set."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def start_early() -> None:
    """Start the fork server now, in the background (a no-op under torchrun, which starts ranks
    itself, or when it is running already)."""
    if under_torchrun():
        return
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()
