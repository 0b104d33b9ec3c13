"""parity.distributed: process groups, collectives and the determinism environment.

- :mod:`parity.distributed.determinism`: ``apply_determinism``, ``validate_determinism_env``,
  ``DeterminismError``.
- :mod:`parity.distributed.pins`: the CPU pins, settable before torch loads (no torch import).
- :mod:`parity.distributed.groups`: DP / EP / expert-DP groups: ``build_groups``, ``ParallelGroups``.
- :mod:`parity.distributed.collectives`: explicit collective wrappers, incl. the uneven all-gather.

The names below load their modules on first use, so that :mod:`parity.distributed.pins` can be
imported before torch.
"""

import importlib

_WHERE = {
    "all_gather_into": "parity.distributed.collectives",
    "all_gather_object": "parity.distributed.collectives",
    "all_gather_uneven_into": "parity.distributed.collectives",
    "all_reduce_sum": "parity.distributed.collectives",
    "all_to_all_single": "parity.distributed.collectives",
    "reduce_scatter_sum": "parity.distributed.collectives",
    "DETERMINISM_ENV": "parity.distributed.determinism",
    "DeterminismError": "parity.distributed.determinism",
    "apply_determinism": "parity.distributed.determinism",
    "validate_determinism_env": "parity.distributed.determinism",
    "ParallelGroups": "parity.distributed.groups",
    "build_groups": "parity.distributed.groups",
}

__all__ = sorted(_WHERE)


def __getattr__(name):
    if name not in _WHERE:
        raise AttributeError(f"module 'parity.distributed' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
