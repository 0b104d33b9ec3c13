"""parity.distributed: process groups, collectives and the determinism environment.

- :mod:`parity.distributed.determinism`: ``apply_determinism``, ``validate_determinism_env``,
  ``DeterminismError``.
- :mod:`parity.distributed.env_contract`: the determinism environment's variables and validator,
  checkable before torch loads (no torch import).
- :mod:`parity.distributed.pins`: the CPU pins, settable before torch loads (no torch import).
- :mod:`parity.distributed.groups`: DP / EP / expert-DP groups: ``build_groups``, ``ParallelGroups``.
- :mod:`parity.distributed.collectives`: explicit collective wrappers, incl. the uneven all-gather.

Import from the modules: the package itself imports nothing, so that
:mod:`parity.distributed.pins` and :mod:`parity.distributed.env_contract` can be imported before torch.
"""
