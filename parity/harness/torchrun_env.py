"""Whether torchrun started this process, and whether this process writes the run's shared outputs.
No torch here: the command line asks before it imports the launcher (bad input is answered before
torch loads), and so does the fork server's start."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """True when this process was started by torchrun (RANK and WORLD_SIZE are set)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def is_report_writer() -> bool:
    """Whether this process writes a run's shared outputs (report, JUnit, goldens): always, except
    under torchrun, where global rank 0 alone does."""
    return not under_torchrun() or int(os.environ["RANK"]) == 0
