"""parity.distributed: process groups, collectives and the determinism environment.

- :mod:`parity.distributed.determinism`: ``apply_determinism``, ``validate_determinism_env``,
  ``DeterminismError``.
- :mod:`parity.distributed.groups`: DP / EP / expert-DP groups: ``build_groups``, ``ParallelGroups``.
- :mod:`parity.distributed.collectives`: explicit collective wrappers, incl. the uneven all-gather.
"""

from parity.distributed.collectives import (
    all_gather_into,
    all_gather_object,
    all_gather_uneven_into,
    all_reduce_sum,
    all_to_all_single,
    reduce_scatter_sum,
)
from parity.distributed.determinism import (
    DETERMINISM_ENV,
    DeterminismError,
    apply_determinism,
    validate_determinism_env,
)
from parity.distributed.groups import ParallelGroups, build_groups

__all__ = [
    "DETERMINISM_ENV",
    "DeterminismError",
    "ParallelGroups",
    "all_gather_into",
    "all_gather_object",
    "all_gather_uneven_into",
    "all_reduce_sum",
    "all_to_all_single",
    "apply_determinism",
    "build_groups",
    "reduce_scatter_sum",
    "validate_determinism_env",
]
