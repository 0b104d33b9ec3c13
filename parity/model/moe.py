"""Mixture of experts with expert parallelism (all-to-all token dispatch over the EP group)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from parity.distributed.collectives import all_to_all_single
from parity.distributed.determinism import empty
from parity.model import matmul
from parity.vocab import Fault


class _AllToAll(torch.autograd.Function):
    """Variable-size all-to-all of rows; its gradient is the reverse exchange."""

    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, group):
        ctx.send_counts, ctx.recv_counts, ctx.group = send_counts, recv_counts, group
        return _exchange(x, send_counts, recv_counts, group)

    @staticmethod
    def backward(ctx, dy):
        return _exchange(dy.contiguous(), ctx.recv_counts, ctx.send_counts, ctx.group), None, None, None


def _exchange(x, send_counts, recv_counts, group):
    if group is None:
        return x.clone()
    out = empty((sum(recv_counts), *x.shape[1:]), dtype=x.dtype, device=x.device)
    all_to_all_single(out, x.contiguous(), recv_counts, send_counts, group)
    return out


def _exchange_counts(per_expert: torch.Tensor, ep_size: int, group) -> torch.Tensor:
    """Tokens this rank sends to each expert [num_experts] -> tokens it receives from each source
    rank for each of its experts [ep_size, experts per rank]: the dispatcher's only metadata
    exchange. Rows arrive grouped by source rank, then by expert, so the receiver derives which
    expert each row is for from these counts and no expert ids travel with the tokens."""
    recv = per_expert
    if group is not None:
        recv = empty(per_expert.shape, dtype=per_expert.dtype, device=per_expert.device)
        all_to_all_single(recv, per_expert, group=group)
    return recv.view(ep_size, -1)


class SwiGLU(nn.Module):
    """``fc2(silu(gate) * up)``, the product rounded once to the input's dtype, as upstream's fused
    SwiGLU computes it. A routed expert gets each row's routing prob and scales the activation by it
    before ``fc2`` (upstream's weighted SwiGLU), so ``fc2`` quantizes the scaled rows."""

    def __init__(self, fc1: nn.Module, fc2: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x, probs=None):
        gate, up = self.fc1(x).chunk(2, dim=-1)
        act = F.silu(gate.float()) * up.float()
        if probs is not None:
            act = act * probs.float()
        return self.fc2(act.to(x.dtype))


class MoE(nn.Module):
    """Top-k router (a bf16 matrix: Muon-managed, never quantized) over experts spread on EP ranks,
    routed as upstream's default (docs/spec/megatron.md s2.18): the top k of the bf16 logits, a
    softmax over those k, the probs rounded to bf16; each prob travels with its token to the expert,
    which scales its activation by it before ``fc2``; the expert outputs are summed per token in
    bf16, in expert order.

    ``experts`` holds only this rank's experts, keyed by their global index, so parameter names
    and init values do not depend on the EP size. ``dead_experts`` are never selected: a -inf
    selection bias on the logits (used for the top-k selection only, frozen); the probs are the
    softmax of the selected experts' own logits.
    """

    def __init__(self, router_init: torch.Tensor, experts: dict[int, nn.Module], num_experts: int,
                 topk: int, ep_size: int, ep_rank: int, ep_group, dead_experts=(), faults=frozenset()):
        super().__init__()
        self.faults = faults
        self.router = matmul.Linear(router_init.shape[1], router_init.shape[0], bias=False)
        self.router.weight = nn.Parameter(router_init.to(torch.bfloat16))
        self.experts = nn.ModuleDict({str(e): m for e, m in experts.items()})
        self.num_experts, self.topk = num_experts, topk
        self.ep_size, self.ep_rank = ep_size, ep_rank
        self.ep_group = ep_group if ep_size > 1 else None
        self.per_rank = num_experts // ep_size
        bias = None
        if dead_experts:
            bias = torch.zeros(num_experts, dtype=torch.float32, device=router_init.device)
            bias[list(dead_experts)] = float("-inf")
        self.register_buffer("selection_bias", bias, persistent=False)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, num_experts] logits -> the k probs [T, k] (the logits' dtype) and experts [T, k]."""
        if self.selection_bias is None:
            top, chosen = torch.topk(logits, self.topk, dim=-1)
        else:
            chosen = torch.topk(logits.float() + self.selection_bias, self.topk, dim=-1).indices
            top = logits.gather(-1, chosen)
        return torch.softmax(top.float(), dim=-1).to(logits.dtype), chosen

    def forward(self, h):
        shape = h.shape
        h = h.reshape(-1, shape[-1])
        T, k = h.shape[0], self.topk
        probs, chosen = self.route(self.router(h))

        # Assignments (token, slot) sorted by expert; ties keep token order (keys are unique).
        expert_of = chosen.reshape(-1)
        order = torch.argsort(expert_of * (T * k) + torch.arange(T * k, device=h.device))
        tokens = torch.div(order, k, rounding_mode="floor")
        sorted_experts = expert_of[order]
        per_expert = torch.bincount(sorted_experts, minlength=self.num_experts)
        received = _exchange_counts(per_expert, self.ep_size, self.ep_group)  # [source rank, local expert]
        send_counts = per_expert.view(self.ep_size, self.per_rank).sum(1).tolist()
        recv_counts = received.sum(1).tolist()

        # A row's prob rides in one more column of the same dtype: one exchange carries both.
        rows = torch.cat([h[tokens], probs.reshape(-1)[order].unsqueeze(1)], dim=1)
        x = _AllToAll.apply(rows, send_counts, recv_counts, self.ep_group)
        x, p = x[:, :-1], x[:, -1:]
        local = torch.arange(self.ep_rank * self.per_rank, (self.ep_rank + 1) * self.per_rank, device=h.device)
        ids = torch.repeat_interleave(local.repeat(received.shape[0]), received.reshape(-1))

        # Each local expert sees its rows in (source rank, token) order: deterministic on every rank.
        pieces, where = [], []
        for e in range(self.ep_rank * self.per_rank, (self.ep_rank + 1) * self.per_rank):
            mine = torch.nonzero(ids == e).squeeze(1)
            expert = self.experts[str(e)]
            pieces.append(expert(x[mine], p[mine]) if Fault.MOE_PROBS_AFTER_FC2 not in self.faults
                          else expert(x[mine]) * p[mine])  # the fault: fc2 quantizes unscaled rows
            where.append(mine)
        y = torch.cat(pieces)[torch.argsort(torch.cat(where))]

        y = _AllToAll.apply(y, recv_counts, send_counts, self.ep_group)
        # y is in expert order: index_add sums each token's outputs in that order, in bf16, as
        # upstream's unpermute does.
        return torch.zeros_like(h).index_add(0, tokens, y).reshape(shape)
