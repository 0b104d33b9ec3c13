"""parity.dist: ranks, process groups, collectives and the determinism environment.

- :mod:`parity.dist.launch`: run a callable on N local ranks (or under torchrun), with failure
  handling: ``launch``, ``LaunchConfig``, ``RankContext``, ``RankFailure``. The function
  ``launch`` is not re-exported here: it would hide the module ``parity.dist.launch`` (write
  ``from parity.dist.launch import launch``).
- :mod:`parity.dist.determinism`: ``apply_determinism``, ``validate_determinism_env``,
  ``DeterminismError``.
- :mod:`parity.dist.groups`: DP / EP / expert-DP groups: ``build_groups``, ``ParallelGroups``.
- :mod:`parity.dist.collectives`: explicit collective wrappers, incl. the uneven all-gather.
"""

from parity.dist.collectives import (
    all_gather_into,
    all_gather_object,
    all_gather_uneven,
    all_gather_uneven_into,
    all_reduce_sum,
    all_to_all_single,
    barrier,
    broadcast,
    reduce_scatter_sum,
)
from parity.dist.determinism import (
    DETERMINISM_ENV,
    DeterminismError,
    apply_determinism,
    validate_determinism_env,
)
from parity.dist.groups import ParallelGroups, build_groups
from parity.dist.launch import (
    FailedRank,
    LaunchConfig,
    RankContext,
    RankFailure,
    free_port,
    under_torchrun,
)

__all__ = [
    "DETERMINISM_ENV",
    "DeterminismError",
    "FailedRank",
    "LaunchConfig",
    "ParallelGroups",
    "RankContext",
    "RankFailure",
    "all_gather_into",
    "all_gather_object",
    "all_gather_uneven",
    "all_gather_uneven_into",
    "all_reduce_sum",
    "all_to_all_single",
    "apply_determinism",
    "barrier",
    "broadcast",
    "build_groups",
    "free_port",
    "reduce_scatter_sum",
    "under_torchrun",
    "validate_determinism_env",
]
