"""Whether torchrun started this process, whether this process writes the run's shared outputs, and
whether torchrun was started as a parity run needs. No torch here: the command line asks before it
imports the launcher (bad input is answered before torch loads), and so does the fork server's start."""

from __future__ import annotations

import os
from collections.abc import Mapping


def under_torchrun() -> bool:
    """True when this process was started by torchrun (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_report_writer() -> bool:
    """Whether this process writes a run's shared outputs (report, JUnit, goldens): always, except
    under torchrun, where global rank 0 alone does."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0


def refuse_restarts(env: Mapping[str, str] | None = None) -> None:
    """Raise ConfigError when torchrun would restart the job (``--max-restarts`` above 0): a failed or
    mismatching rank would rerun the whole job and hide the first verdict."""
    from parity.harness.errors import ConfigError

    restarts = int((os.environ if env is None else env).get("TORCHELASTIC_MAX_RESTARTS", "0"))
    if restarts > 0:
        raise ConfigError(f"torchrun --max-restarts {restarts}: a parity run must not be restarted (a failed "
                          f"or mismatching rank would rerun the whole job and hide the first verdict); "
                          f"start torchrun with --max-restarts 0")
