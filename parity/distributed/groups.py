"""Process groups for data parallelism (DP), expert parallelism (EP) and expert data parallelism.

TP = PP = CP = 1, so:

- DP spans the whole world.
- EP groups are blocks of ``ep`` consecutive ranks: ``[0..ep-1], [ep..2ep-1], ...``.
- Expert-DP groups are strided: the ranks that hold the same experts, i.e. the same ``ep_rank``.
  With world 4 and ep 2: EP groups {0,1}, {2,3}; expert-DP groups {0,2}, {1,3}.

``torch.distributed.new_group`` is collective over the whole world: every rank creates every group,
in the same order, even the groups it is not in. :func:`build_groups` does exactly that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["ParallelGroups", "build_groups", "ep_group_ranks", "expt_dp_group_ranks"]


@dataclass(frozen=True, kw_only=True)
class ParallelGroups:
    """This rank's process groups and its place in each."""

    world_size: int
    rank: int
    """Global rank."""
    dp: int
    """Data-parallel size (= world_size)."""
    ep: int
    """Expert-parallel size."""
    expt_dp: int
    """Expert-data-parallel size (= world_size // ep)."""
    dp_group: dist.ProcessGroup
    ep_group: dist.ProcessGroup
    expt_dp_group: dist.ProcessGroup
    dp_rank: int
    ep_rank: int
    expt_dp_rank: int
    ep_ranks: tuple[int, ...]
    """Global ranks of this rank's EP group, in group-rank order."""
    expt_dp_ranks: tuple[int, ...]
    """Global ranks of this rank's expert-DP group, in group-rank order."""

    def describe(self) -> str:
        """One line for logs, e.g. ``rank 1/4: dp 1/4, ep 1/2 [0, 1], expt_dp 0/2 [1, 3]``."""
        return (
            f"rank {self.rank}/{self.world_size}: dp {self.dp_rank}/{self.dp}, "
            f"ep {self.ep_rank}/{self.ep} {list(self.ep_ranks)}, "
            f"expt_dp {self.expt_dp_rank}/{self.expt_dp} {list(self.expt_dp_ranks)}"
        )


def _check_ep(world_size: int, ep: int) -> None:
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep must be a positive integer, got {ep!r}")
    if world_size % ep != 0:
        raise ValueError(
            f"expert-parallel size ep={ep} must divide the world size {world_size} "
            f"(EP groups are blocks of ep consecutive ranks)"
        )


def ep_group_ranks(world_size: int, ep: int) -> list[list[int]]:
    """All EP groups as lists of global ranks: contiguous blocks of ``ep`` ranks."""
    _check_ep(world_size, ep)
    return [list(range(start, start + ep)) for start in range(0, world_size, ep)]


def expt_dp_group_ranks(world_size: int, ep: int) -> list[list[int]]:
    """All expert-DP groups as lists of global ranks: ranks with the same EP rank, stride ``ep``."""
    _check_ep(world_size, ep)
    return [list(range(ep_rank, world_size, ep)) for ep_rank in range(ep)]


def build_groups(ep: int) -> ParallelGroups:
    """Create the DP, EP and expert-DP groups; call it on every rank with the same ``ep``.

    The DP group is the default (world) group. EP and expert-DP groups are new groups, also when
    they have a single rank, so collectives on them work (as no-ops) on every backend.

    Args:
        ep: expert-parallel size; must divide the world size.

    Returns:
        This rank's :class:`ParallelGroups`.

    Raises:
        RuntimeError: the default process group is not initialised.
        ValueError: ``ep`` does not divide the world size (raised on every rank, before any
            group is created).
    """
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialised default process group (see parity.harness.launch)")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    ep_blocks = ep_group_ranks(world_size, ep)
    expt_dp_strides = expt_dp_group_ranks(world_size, ep)

    # Same order on every rank: all EP groups, then all expert-DP groups.
    my_ep_group = my_expt_dp_group = None
    my_ep_ranks = my_expt_dp_ranks = None
    for ranks in ep_blocks:
        group = dist.new_group(ranks)
        if rank in ranks:
            my_ep_group, my_ep_ranks = group, ranks
    for ranks in expt_dp_strides:
        group = dist.new_group(ranks)
        if rank in ranks:
            my_expt_dp_group, my_expt_dp_ranks = group, ranks
    assert my_ep_group is not None and my_expt_dp_group is not None  # every rank is in one of each
    assert my_ep_ranks is not None and my_expt_dp_ranks is not None

    return ParallelGroups(
        world_size=world_size,
        rank=rank,
        dp=world_size,
        ep=ep,
        expt_dp=world_size // ep,
        dp_group=dist.group.WORLD,
        ep_group=my_ep_group,
        expt_dp_group=my_expt_dp_group,
        dp_rank=rank,
        ep_rank=my_ep_ranks.index(rank),
        expt_dp_rank=my_expt_dp_ranks.index(rank),
        ep_ranks=tuple(my_ep_ranks),
        expt_dp_ranks=tuple(my_expt_dp_ranks),
    )
