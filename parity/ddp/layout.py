"""Buffer grouping and the three per-buffer layouts (docs/spec/megatron.md s2.1-2.2).

Every layout walks a buffer's params in reverse (backprop) order, so offset 0 holds the last
defined parameter, and returns ``param -> (start, end, bucket_id)`` plus bucket boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from parity.model import is_expert_param, is_layer_wise_managed, is_quantized_param


@dataclass(frozen=True)
class BufferKey:
    """What separates two DDP buffers."""

    param_dtype: torch.dtype
    """Storage dtype, except that merged FP8 LayerWise params key by their bf16 logical dtype."""
    grad_dtype: torch.dtype
    """Dtype of the grad buffer (fp32: grads reduced in fp32)."""
    is_expert: bool
    """Expert-parallel params (reduced over expert-DP)."""
    is_layer_wise: bool
    """Muon (LayerWise) managed params."""


def group_params_for_buffers(named_params, *, merge_layerwise_fp8_grads: bool = True,
                             grad_dtype=torch.float32, honor_use_muon: bool = True) -> dict[BufferKey, list]:
    """Group params into buffers in registration order.

    The merge rule keys FP8 LayerWise params by their logical dtype, so ON has the same single
    bf16 Muon buffer as OFF: the all-reduce then sums the same buffer, in the same order.
    """
    groups: dict[BufferKey, list] = {}
    for _, p in named_params:
        if not p.requires_grad:
            continue
        lw = is_layer_wise_managed(p, honor_use_muon=honor_use_muon)
        dtype = p.dtype
        if is_quantized_param(p) and not (merge_layerwise_fp8_grads and lw):
            dtype = torch.uint8
        key = BufferKey(dtype, grad_dtype, is_expert_param(p), lw)
        groups.setdefault(key, []).append(p)
    return groups


def merge_rule_matters(named_params) -> bool:
    """Whether the merge rule gives other buffers than keying FP8 LayerWise params by uint8: a
    LayerWise class (dense or expert) holds FP8 and non-FP8 params both."""
    named_params = list(named_params)

    def members(merge: bool):
        groups = group_params_for_buffers(named_params, merge_layerwise_fp8_grads=merge)
        return sorted(tuple(id(p) for p in ps) for ps in groups.values())

    return members(True) != members(False)


@dataclass
class Layout:
    """A buffer's layout: where each param's grad (and, for DistOpt buffers, its value) lives."""

    index: dict = field(default_factory=dict)
    """param -> (start, end, bucket_id)"""
    buckets: list = field(default_factory=list)
    """[(start, end)] per bucket, in bucket-id order."""
    numel: int = 0
    numel_unpadded: int = 0
    shard_owner: dict = field(default_factory=dict)
    """Padded LayerWise layout only: param -> owning DP rank (the shard that holds it)."""

    @property
    def padding(self) -> int:
        return self.numel - self.numel_unpadded


def compact_layout(params, bucket_size: int | None) -> Layout:
    """No alignment, no padding; a bucket closes once it holds >= bucket_size elements."""
    lay = Layout()
    start = bucket_start = 0
    for p in reversed(params):
        end = start + p.numel()
        lay.index[p] = (start, end, len(lay.buckets))
        start = end
        if bucket_size is not None and end - bucket_start >= bucket_size:
            lay.buckets.append((bucket_start, end))
            bucket_start = end
    if start > bucket_start or not lay.buckets:
        lay.buckets.append((bucket_start, start))
    lay.numel = lay.numel_unpadded = start
    return lay


def _pad(n: int, d: int) -> int:
    return -(-n // d) * d


def distopt_layout(params, bucket_size: int | None, dp: int) -> Layout:
    """DistributedOptimizer byte layout: 64-element aligned starts, bucket ends padded to
    lcm(dp, 128) so every bucket splits into dp equal shards."""
    lay = Layout()
    divisor = math.lcm(dp, 128)
    start = bucket_start = 0
    unpadded = 0
    for p in reversed(params):
        start = _pad(start, 64)
        end = start + p.numel()
        unpadded += p.numel()
        lay.index[p] = (start, end, len(lay.buckets))
        start = end
        if bucket_size is not None and end - bucket_start >= bucket_size:
            end = _pad(end, divisor)
            lay.buckets.append((bucket_start, end))
            bucket_start = start = end
    if start > bucket_start or not lay.buckets:
        end = _pad(start, divisor)
        lay.buckets.append((bucket_start, end))
        start = end
    lay.numel, lay.numel_unpadded = start, unpadded
    return lay


def padded_layer_wise_layout(params, bucket_size: int | None, dp: int) -> Layout:
    """The opt-in shard-aligned LayerWise layout (docs/spec/megatron.md s2.2 (c)): every param lies
    whole inside one DP shard, and every shard of a bucket is as large as the fullest one (the
    persistent padding the compact layout removes).

    Chunks follow backprop order. A chunk closes once it holds its soft minimum
    ``max(bucket_size, 0.9 * dp * largest param)`` and the next param would grow the bucket (it no
    longer fits the padding of a least-loaded-shard estimate). Each chunk is packed largest
    Newton-Schulz cost first onto the shard with the least cost so far (carried across chunks),
    among shards that stay under 1.3x an even share of the chunk; if none does, onto the emptiest.
    """
    lay = Layout()
    shard_align = math.lcm(64, math.lcm(dp, 128) // dp)
    cost_so_far = [0] * dp
    start = unpadded = 0

    def emit(chunk):
        nonlocal start, unpadded
        cap = sum(p.numel() for p in chunk) / dp * 1.3
        cursors, members = [0] * dp, [[] for _ in range(dp)]
        for p in sorted(chunk, key=lambda q: -_ns_cost(q)):
            fits = [r for r in range(dp) if _pad(cursors[r], 64) + p.numel() <= cap]
            r = min(fits, key=lambda i: cost_so_far[i]) if fits else min(range(dp), key=lambda i: cursors[i])
            cursors[r] = _pad(cursors[r], 64) + p.numel()
            cost_so_far[r] += _ns_cost(p)
            members[r].append(p)
        shard = _pad(max(cursors), shard_align)
        bid = len(lay.buckets)
        for r in range(dp):
            at = start + r * shard
            for p in members[r]:
                at = _pad(at, 64)
                lay.index[p] = (at, at + p.numel(), bid)
                lay.shard_owner[p] = r
                at += p.numel()
        unpadded += sum(p.numel() for p in chunk)
        lay.buckets.append((start, start + dp * shard))
        start += dp * shard

    chunk, estimate, chunk_numel, largest = [], [0] * dp, 0, 0
    for p in reversed(params):
        n = p.numel()
        if bucket_size is not None and chunk:
            soft_min = max(bucket_size, int(dp * largest * 0.9))  # upstream's operand order
            grows = _pad(min(estimate), 64) + n > _pad(max(estimate), shard_align)
            if chunk_numel >= soft_min and grows:
                emit(chunk)
                chunk, estimate, chunk_numel, largest = [], [0] * dp, 0, 0
        r = min(range(dp), key=lambda i: estimate[i])
        estimate[r] = _pad(estimate[r], 64) + n
        chunk.append(p)
        chunk_numel, largest = chunk_numel + n, max(largest, n)
    emit(chunk)
    lay.numel, lay.numel_unpadded = start, unpadded
    return lay


def _ns_cost(p) -> int:
    if p.dim() == 2:
        m, n = p.shape
        return max(m, n) * min(m, n) ** 2
    return p.numel()
