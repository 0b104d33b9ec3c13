"""The processes a test started, found by a marker in their environment (Linux /proc).

A test puts ``MARKER_VAR=<a fresh uuid>`` into the environment of the command it starts, and every
process that command starts inherits it (ranks, fork servers, torchrun's agents and workers), so
the test can find them after the command ended without knowing their pids: none may be left.
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from pathlib import Path

MARKER_VAR = "PARITY_TEST_MARKER"

_RUN_STATE_VARS = ("NCCL_ALGO", "NCCL_NVLS_ENABLE", "CUBLAS_WORKSPACE_CONFIG", "NVTE_ALLOW_NONDETERMINISTIC_ALGO",
                   "CUDA_DEVICE_MAX_CONNECTIONS", "PARITY_DEBUG", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                   "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""Variables a command reads as part of its run (the determinism contract, torchrun's rank
variables): a test's command starts without them unless the test sets them."""


def new_marker() -> str:
    return uuid.uuid4().hex


def command_env(marker: str | None = None, **extra: str) -> dict[str, str]:
    """This process's environment without :data:`_RUN_STATE_VARS`, with the marker (if any) and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in _RUN_STATE_VARS}
    if marker:
        env[MARKER_VAR] = marker
    env.update(extra)
    return env


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment carries the marker (a zombie is gone, only unreaped)."""
    needle = f"{MARKER_VAR}={marker}".encode()
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle not in f.read():
                    continue
            with open(f"/proc/{d}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
        except OSError:
            continue
        pids.append(int(d))
    return pids


def kill_marked(marker: str) -> None:
    """SIGKILL every marked process: a test's cleanup, for processes that test started."""
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def assert_no_orphans(marker: str, within_s: float) -> None:
    """Fail, naming them, if marked processes are still alive ``within_s`` seconds from now; those
    are killed first, so one failure leaves nothing running into the next test."""
    end = time.monotonic() + within_s
    while marked_pids(marker) and time.monotonic() < end:
        time.sleep(0.2)
    left = marked_pids(marker)
    cmdlines = []
    for p in left:
        try:
            cmdlines.append(Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200])
        except OSError:
            pass
    kill_marked(marker)
    assert not left, f"processes left behind: {left} {cmdlines}"
