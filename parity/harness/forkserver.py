"""The fork server CPU ranks are forked from, and starting it early.

Importing torch takes the server a second or more. Started at the top of the command line, before
the parent imports torch itself, the server's imports run beside the parent's instead of after
them (this module imports no torch, so the start costs the parent nothing).
"""

from __future__ import annotations

import multiprocessing
import os

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
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return
    from multiprocessing import forkserver

    context()
    forkserver.ensure_running()
