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
    """The opt-in shard-aligned LayerWise layout: every param lies whole inside one DP shard and
    every shard of a bucket is as large as the fullest one (the persistent padding the compact
    layout removes). Params are placed largest-cost first on the least-loaded shard."""
    lay = Layout()
    chunks, cur, cur_numel = [], [], 0
    for p in reversed(params):
        cur.append(p)
        cur_numel += p.numel()
        if bucket_size is not None and cur_numel >= bucket_size:
            chunks.append(cur)
            cur, cur_numel = [], 0
    if cur or not chunks:
        chunks.append(cur)
    start, unpadded = 0, 0
    for chunk in chunks:
        cursors, placed = [0] * dp, []
        for p in sorted(chunk, key=lambda q: -_ns_cost(q)):
            r = min(range(dp), key=lambda i: (cursors[i], i))
            off = _pad(cursors[r], 64)
            placed.append((p, r, off))
            cursors[r] = off + p.numel()
            unpadded += p.numel()
        shard = _pad(max(cursors + [1]), 64)
        bid = len(lay.buckets)
        for p, r, off in placed:
            s = start + r * shard + off
            lay.index[p] = (s, s + p.numel(), bid)
            lay.shard_owner[p] = r
        lay.buckets.append((start, start + dp * shard))
        start += dp * shard
    lay.numel, lay.numel_unpadded = start, unpadded
    return lay


def _ns_cost(p) -> int:
    if p.dim() == 2:
        m, n = p.shape
        return max(m, n) * min(m, n) ** 2
    return p.numel()
