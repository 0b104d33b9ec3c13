"""Global grad norm, clipping by it, and zeros in the grads (docs/spec/megatron.md s2.14).

The norm is over the reduced grads, each element of each param counted exactly once although
the two optimizers hold them differently: LayerWise grads are all-reduced, so every rank of the
DP group holds all of them (only the owner counts a param); DistOpt grads are reduce-scattered, so
a rank holds the reduced values of its shard only (it counts exactly that shard). Partial sums are
then summed over the groups that split the params: DP for dense params; expert-DP (owners) and EP
(different experts) for expert params.

Arithmetic is fp32 in a fixed order, so both sides of a pair and every rank compute the same bits:
per param the sum of squares (one torch reduction over a tensor of the same length on both sides),
then a left-to-right sum over params in model definition order, then the all-reduces.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from parity.distributed.collectives import all_reduce_sum
from parity.model import is_expert_param
from parity.optim.numerics import ieee_sqrt
from parity.vocab import Fault

CLIP_EPS = 1.0e-6
"""Added to the norm before dividing, as upstream's clip does."""


@dataclass
class GradStats:
    """This step's grad statistics: 1-element tensors, identical on every rank."""

    norm: torch.Tensor
    """fp32 L2 norm of all reduced grads."""
    num_zeros: torch.Tensor
    """int64 count of zero elements in the reduced grads (counted after clipping, as upstream)."""
    clip_coef: torch.Tensor | None
    """float64 ``clip_grad / (norm + 1e-6)``; the grads were scaled by it iff it is < 1.
    None when clipping is off."""
    elements: int
    """How many grad elements the norm and the zeros counted, summed as they are: each param's
    elements once when the ranks split the counting right."""


def counted_grads(layerwise, distopt, order: dict, faults=frozenset()) -> list[tuple[int, bool, torch.Tensor]]:
    """(definition index, is expert, grad) of every grad this rank counts, in definition order.

    LayerWise: the params this rank owns. DistOpt: this rank's reduced shard pieces.
    """
    lw = layerwise.owned
    if (layerwise.dp > 1 or layerwise.expt_dp > 1) and Fault.GRAD_NORM_DOUBLE_COUNTS_REPLICATED in faults:
        lw = [p for lists in (layerwise.dense_lists, layerwise.expert_lists) for lst in lists for p in lst]
    out = [(order[p], is_expert_param(p), p.main_grad) for p in lw]
    if any(b.dp > 1 for b in distopt.buffers) and Fault.GRAD_NORM_COUNTS_UNREDUCED_SHARD in faults:
        out += [(order[p], is_expert_param(p), p.main_grad) for b in distopt.buffers for p in b.params]
    else:
        out += [(order[pc.param], is_expert_param(pc.param), pc.grad) for pc in distopt.pieces]
    return sorted(out, key=lambda t: t[0])


def held_grads(layerwise, distopt, faults=frozenset()) -> list[torch.Tensor]:
    """Every reduced grad this rank holds: all LayerWise grads (owned or not) and its DistOpt
    shards. Clipping scales all of them, so the replicas of an all-reduced grad stay replicas;
    the copies no optimizer reads change nothing else."""
    layerwise_grads = [p.main_grad for b in layerwise.lw_buffers for p in b.params]
    if distopt.pieces and Fault.CLIP_SKIPS_DISTOPT_GRADS in faults:
        return layerwise_grads  # the LayerWise child alone is clipped
    return layerwise_grads + [pc.grad for pc in distopt.pieces]


def _sum_over(value: torch.Tensor, groups) -> torch.Tensor:
    for g in groups:
        all_reduce_sum(value, g)
    return value


def global_norm(grads, *, dp_group, expt_dp_group, ep_group, device) -> torch.Tensor:
    """fp32 L2 norm of ``grads`` (from :func:`counted_grads`) over every rank, as a 1-element tensor."""
    sq = {False: torch.zeros(1, dtype=torch.float32, device=device),
          True: torch.zeros(1, dtype=torch.float32, device=device)}
    for _, expert, g in grads:
        sq[expert] += g.float().square().sum()
    total = _sum_over(sq[False], [dp_group]) + _sum_over(sq[True], [expt_dp_group, ep_group])
    return ieee_sqrt(total)


def grad_stats(grads, held, *, dp_group, expt_dp_group, ep_group, clip_grad: float, device,
               faults=frozenset()) -> GradStats:
    """Norm of ``grads`` (from :func:`counted_grads`), clipping of ``held`` (in place, when
    ``clip_grad > 0`` and the coefficient is < 1), then zeros in ``grads``."""
    norm = global_norm(grads, dp_group=dp_group, expt_dp_group=expt_dp_group, ep_group=ep_group, device=device)
    clip_coef = None
    if clip_grad > 0:
        coef = clip_grad / (float(norm) + CLIP_EPS)
        clip_coef = torch.tensor([coef], dtype=torch.float64, device=device)
        if coef < 1.0 or (held and Fault.CLIP_SCALES_UP in faults):  # the fault: no "< 1" test
            for g in held:
                g.mul_(coef)
    # [zeros, elements counted]: one reduction carries both
    counts = {False: torch.zeros(2, dtype=torch.int64, device=device),
              True: torch.zeros(2, dtype=torch.int64, device=device)}
    for _, expert, g in grads:
        counts[expert][0] += g.numel() - torch.count_nonzero(g)
        counts[expert][1] += g.numel()
    total = _sum_over(counts[False], [dp_group]) + _sum_over(counts[True], [expt_dp_group, ep_group])
    return GradStats(norm=norm, num_zeros=total[0:1].clone(), clip_coef=clip_coef, elements=int(total[1]))
