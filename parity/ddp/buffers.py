"""Contiguous param/grad buffers, buckets and bucket groups (docs/spec/megatron.md s2.3-2.4)."""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from parity.ddp import param_sync
from parity.ddp.layout import BufferKey, Layout
from parity.distributed.determinism import empty
from parity.distributed.collectives import (
    WorkList,
    all_gather_into,
    all_reduce_sum,
    reduce_scatter_sum,
    sums_coalesced,
)
from parity.model import is_quantized_param
from parity.vocab import Fault, FaultSet

# How a landed param gather was finished (each bucket group records one per gather).
PRE_HOOK = "pre_hook"      # a forward pre-hook waited on it and copied it back
FORCE_SYNC = "force_sync"  # start_param_sync(force_sync=True) finished it
OPTIMIZER = "optimizer"    # the optimizer gathered it right after its step (FP8 DistOpt, s2.16)

# Where a forward pre-hook found its group's param gather when it came to wait on it
# (DDP.pre_hook_waits): what the chain of pre-hooks is for.
IN_FLIGHT = "in_flight"    # launched earlier (by the pre-hook of the group before it in the chain)
ON_DEMAND = "on_demand"    # not launched yet: the hook launched it and waited at once, nothing overlapped

# Who launched a bucket group's grad reduction in a step (BucketGroup.grad_reduces):
BACKWARD = "backward"      # its backward hooks, once every param reported as often as expected
AT_FINISH = "finish"       # finish_grad_sync: without overlap; under overlap, in the first step
                           # (the expected reports are learned there) or where no param ever reported


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """Per-buffer DDP semantics. LayerWise buffers on the compact layout get a copy with
    ``use_distributed_optimizer=False``: the single source of truth their buckets and groups
    inherit."""

    use_distributed_optimizer: bool
    """Reduce-scatter grads and keep a flat param buffer (DistOpt); else all-reduce grads."""
    gradient_scaling_factor: float = 1.0
    """What the grads are multiplied by before the summing collective: 1/DP for dense and expert
    buffers alike (docs/spec/megatron.md s1.3 step 4), so the sum is the mean over the DP ranks'
    batches although an expert buffer sums over the smaller expert-DP group only."""


class Bucket:
    def __init__(self, buffer, bucket_id: int, start: int, end: int, params: list):
        self.buffer, self.id, self.start, self.end = buffer, bucket_id, start, end
        self.params = params  # in layout (backprop) order
        self.grad_data = buffer.grad_data[start:end]
        self.param_data = None if buffer.param_data is None else buffer.param_data[start:end]
        # LayerWise overlap gather state (set by the LayerWise optimizer).
        self.layerwise_lists = None       # per-rank owned params in this bucket
        self.layerwise_fp8_staged = None  # staging decision, persisted for the copy-back
        self.gather_slots = None          # per-rank views into grad_data used by a pending gather
        self.gather_send = None           # DistOpt: the send shard of a gather in flight

    @property
    def numel(self) -> int:
        return self.end - self.start

    def start_param_data_gather(self):
        """Launch the all-gather of this DistOpt bucket's flat param storage from its dp shards;
        returns the handle (the send shard is a copy, kept alive by the handle's owner)."""
        dp, group = self.buffer.dp, self.buffer.group
        if dp == 1:
            return WorkList([])
        shard = self.numel // dp
        r = dist.get_rank(group)
        self.gather_send = self.param_data[r * shard:(r + 1) * shard].clone()
        return all_gather_into(self.param_data, self.gather_send, group, async_op=True)


class ParamAndGradBuffer:
    """One buffer: fp32 grad storage (``main_grad`` views) and, for DistOpt buffers, the flat
    param storage the params are views of: bf16 values, or for a ``uint8`` buffer the rowwise FP8
    bytes of its FP8 params (their ``qt.rowwise_data`` is remapped into it, docs/spec/megatron.md
    s2.3). A ``uint8`` buffer is never all-gathered as bytes: its params are requantized from the
    gathered bf16 masters (parity.optim.distopt)."""

    def __init__(self, key: BufferKey, params: list, layout: Layout, config: BufferConfig,
                 group, device):
        self.key, self.params, self.layout, self.config = key, params, layout, config
        self.group = group
        self.dp = dist.get_world_size(group) if group is not None else 1
        self.grad_data = torch.zeros(layout.numel, dtype=key.grad_dtype, device=device)
        self.param_data = None
        if config.use_distributed_optimizer:
            if layout.numel % self.dp:
                raise AssertionError(f"DistOpt buffer numel {layout.numel} not divisible by dp {self.dp}")
            if any(is_quantized_param(p) != (key.param_dtype == torch.uint8) for p in params):
                raise AssertionError("a DistOpt buffer holds FP8 params only if it is keyed uint8")
            self.param_data = torch.zeros(layout.numel, dtype=key.param_dtype, device=device)
        for p in params:
            start, end, _ = layout.index[p]
            p.main_grad = self.grad_data[start:end].view(p.shape)
            if self.param_data is None:
                continue
            if is_quantized_param(p):
                rows = p.qt.rowwise_data
                view = self.param_data[start:end].view(rows.dtype).view(rows.shape)
                view.copy_(rows)
                p.qt.rowwise_data = view
            else:
                view = self.param_data[start:end].view(p.shape)
                view.copy_(p.data)
                p.data = view
        by_bucket: dict[int, list] = {}
        for p in sorted(params, key=lambda q: layout.index[q][0]):
            by_bucket.setdefault(layout.index[p][2], []).append(p)
        self.buckets = [Bucket(self, i, s, e, by_bucket.get(i, []))
                        for i, (s, e) in enumerate(layout.buckets)]

    def gather_param_data(self) -> None:
        """All-gather every bucket's flat param storage from its dp shards (DistOpt sync)."""
        if self.key.param_dtype == torch.uint8:
            raise AssertionError("a uint8 DistOpt buffer is synced by requantizing gathered bf16 "
                                 "masters, not by gathering FP8 bytes")
        for b in self.buckets:
            b.start_param_data_gather().wait()
            b.gather_send = None

    def report(self) -> dict:
        lay = self.layout
        pct = 100.0 * lay.padding / lay.numel if lay.numel else 0.0
        return {"key": _key_str(self.key), "params": len(self.params), "numel": lay.numel,
                "numel_unpadded": lay.numel_unpadded, "padding": lay.padding,
                "padding_pct": round(pct, 3), "buckets": len(self.buckets),
                "distopt": self.config.use_distributed_optimizer}


def _key_str(k: BufferKey) -> str:
    name = lambda d: str(d).replace("torch.", "")
    return (f"{name(k.param_dtype)}/{name(k.grad_dtype)}/{'expert' if k.is_expert else 'dense'}/"
            f"{'layerwise' if k.is_layer_wise else 'sibling'}")


class BucketGroup:
    """Buckets reduced by one collective type: all-reduce (LayerWise) or reduce-scatter (DistOpt).

    Under overlap the group also owns its param gather (docs/spec/megatron.md s2.10): launched
    asynchronously by ``start_param_sync``, finished by ``finish_param_sync`` (wait, copy back,
    zero the staging area), and recorded in ``param_gathers``."""

    def __init__(self, buckets: list[Bucket], *, check_agreement: bool = True, faults=frozenset()):
        kinds = {b.buffer.config.use_distributed_optimizer for b in buckets}
        if check_agreement and len(kinds) > 1:
            raise AssertionError("Cannot merge buckets with differing effective "
                                 "use_distributed_optimizer into one bucket group")
        self.buckets, self.faults = buckets, FaultSet(faults)
        # The collective of a group is decided by its head bucket; agreement makes that safe.
        self.use_distributed_optimizer = buckets[0].buffer.config.use_distributed_optimizer
        if not self.use_distributed_optimizer and buckets[0].buffer.dp > 1 and \
                Fault.GROUP_TAKES_RUN_DISTOPT_FLAG in self.faults:
            self.use_distributed_optimizer = True  # the run's DistOpt setting, not the buffer's (s2.3)
        self.group = buckets[0].buffer.group
        self.dp = buckets[0].buffer.dp
        self.params = [p for b in buckets for p in b.params]
        # Reports of grad readiness on the last microbatch, per param (a param used twice reports
        # twice). The first step learns how many each param makes; from then on the reduction is
        # launched once the reports equal those (docs/spec/megatron.md s1.3 step 3).
        self.ready_counts: dict[int, int] = {}
        self.expected_counts: dict[int, int] | None = None
        self.grad_reduces: list[str] = []  # one entry per reduction launched: BACKWARD or AT_FINISH
        self.grad_handles = None
        self.rs_outputs = None
        self.scaling = buckets[0].buffer.config.gradient_scaling_factor
        self.is_layer_wise = any(b.buffer.key.is_layer_wise for b in buckets)
        # Overlapped param gather state.
        self.param_gather_dispatched = False
        self.param_gather_handle = None    # the gather in flight (waited by finish_param_sync)
        self.param_gather_pending = False  # a gather was launched and not yet copied back
        self.next_param_gather_group = None
        self.param_gathers: list[str] = []  # one entry per landed gather: PRE_HOOK or FORCE_SYNC

    # -- gradients -------------------------------------------------------------------------
    def _scaled_reductions(self) -> tuple[list, list]:
        """Scale every bucket's grads by 1/dp; returns the reductions they need: the grads to
        all-reduce and the (bucket, output shard) pairs to reduce-scatter into (none when dp == 1)."""
        all_reduce, reduce_scatter = [], []
        for b in self.buckets:
            b.grad_data.mul_(self.scaling)
            if self.dp == 1:
                continue
            if self.use_distributed_optimizer:
                out = empty(b.numel // self.dp, dtype=b.grad_data.dtype, device=b.grad_data.device)
                reduce_scatter.append((b, out))
            elif Fault.GRAD_REDUCE_INTO_COPY in self.faults:
                all_reduce.append(b.grad_data.clone())  # the sums land in a copy nobody reads
            else:
                all_reduce.append(b.grad_data)
        return all_reduce, reduce_scatter

    def start_grad_sync(self, async_op: bool = False):
        all_reduce, reduce_scatter = self._scaled_reductions()
        handles = [all_reduce_sum(t, self.group, async_op=async_op) for t in all_reduce]
        handles += [reduce_scatter_sum(out, b.grad_data, self.group, async_op=async_op) for b, out in reduce_scatter]
        self.grad_handles, self.rs_outputs = handles, reduce_scatter

    def finish_grad_sync(self):
        """Wait for this group's reductions (started by the backward hooks under overlap, else
        by :func:`start_grad_syncs_coalesced`), then place the reduce-scattered shards."""
        for h in self.grad_handles:
            if h is not None:
                h.wait()
        r = dist.get_rank(self.group) if self.dp > 1 else 0
        for b, out in self.rs_outputs:
            shard = b.numel // self.dp
            b.grad_data[r * shard:(r + 1) * shard].copy_(out)
        self.grad_handles, self.rs_outputs = None, None
        # Re-arm the deferred param gather: the next forward's pre-hooks gather the new values
        # (the fault leaves a dispatched group marked dispatched).
        self.param_gather_dispatched = (self.param_gather_dispatched
                                        and Fault.NO_REARM_IN_FINISH_GRAD_SYNC in self.faults)

    def register_grad_ready(self, p):
        """Under overlap_grad_reduce, on the last microbatch: count the report, and launch the
        reduction once every param reported as often as in the first step."""
        self.ready_counts[id(p)] = self.ready_counts.get(id(p), 0) + 1
        if self.expected_counts is not None and self.ready_counts == self.expected_counts:
            self.start_grad_sync(async_op=True)
            self.grad_reduces.append(BACKWARD)

    def reset(self):
        """At the start of a step (zero_grad_buffer): after the first step, record the reports
        it made as the expected ones; every param must have reported (upstream asserts)."""
        if self.expected_counts is None and self.ready_counts:
            if len(self.ready_counts) != len(self.params):
                raise RuntimeError(f"bucket group of {len(self.params)} params: only {len(self.ready_counts)} "
                                   f"reported their grads in the first step")
            self.expected_counts = self.ready_counts
        self.ready_counts = {}

    # -- param gather (overlap_param_gather) -----------------------------------------------
    @property
    def holds_fp8_distopt(self) -> bool:
        """Whether a bucket of this group holds FP8 DistOpt params: their gather is an optimizer
        step (requantize from the gathered bf16 masters), which the optimizer does right after its
        step, not a forward pre-hook (docs/spec/megatron.md s2.16)."""
        return any(b.buffer.key.param_dtype == torch.uint8 and b.buffer.config.use_distributed_optimizer
                   for b in self.buckets)

    @property
    def gathers_params(self) -> bool:
        """Whether a param sync of this group moves data: at DP > 1 every one of its params has
        one owner in the group, so a gather always carries some. Decided by the group alone, not
        by the owner lists the LayerWise optimizer hands its buckets (a bug that hands none must
        show as a gather missing: docs/spec/megatron.md s5 item 18)."""
        return self.dp > 1

    def start_param_sync(self) -> None:
        """Launch this group's param gather asynchronously and mark it dispatched."""
        if self.param_gather_handle is not None:
            raise AssertionError("a param gather of this bucket group is already in flight")
        self.param_gather_dispatched = True
        if self.dp == 1:
            return
        works = []
        if self.use_distributed_optimizer:
            works = [b.start_param_data_gather() for b in self.buckets]
        else:
            my = dist.get_rank(self.group)
            for b in self.buckets:
                if b.layerwise_lists is None:
                    continue
                b.layerwise_fp8_staged = param_sync.is_fp8_staged(b.params, self.faults)
                dtype = param_sync.transport_dtype(b.layerwise_fp8_staged, b.params)
                # Grads are idle between the optimizer step and the next backward: the grad
                # buffer is the receive buffer.
                flat, sizes, work = param_sync.gather_lists(
                    b.layerwise_lists, self.group, my, b.grad_data.view(dtype), b.layerwise_fp8_staged,
                    dtype, b.grad_data.device, self.faults, async_op=True)
                if flat is not None:
                    b.gather_slots = (flat, sizes)
                    works.append(work)
        if works:
            self.param_gather_handle = WorkList(works)
            self.param_gather_pending = True

    def wait_param_sync(self) -> None:
        if self.param_gather_handle is not None:
            self.param_gather_handle.wait()
            self.param_gather_handle = None

    def finish_param_sync(self, source: str) -> None:
        """Wait for the gather, copy it back into the params (LayerWise: every rank's slot is
        requantized when FP8-staged), zero the grad buffer it was staged in, record it."""
        self.wait_param_sync()
        if not self.param_gather_pending:
            return
        if not self.use_distributed_optimizer:
            my = dist.get_rank(self.group)
            for b in self.buckets:
                if b.gather_slots is None:
                    continue
                flat, sizes = b.gather_slots
                staged = b.layerwise_fp8_staged
                if Fault.STAGING_NOT_PERSISTED in self.faults:
                    staged = not staged
                param_sync.copy_back_all(b.layerwise_lists, flat, sizes, staged, my, self.faults)
                b.gather_slots = None
                if not _keep_payload(self.faults, source, b.layerwise_fp8_staged):
                    b.grad_data.zero_()
        for b in self.buckets:
            b.gather_send = None
        self.param_gather_pending = False
        self.param_gathers.append(source)

    def drop_param_sync(self) -> None:
        """Wait for the gather in flight and forget it: no copy-back, no zeroing (the force_sync
        fault's behaviour)."""
        self.wait_param_sync()
        for b in self.buckets:
            b.gather_slots = b.gather_send = None
        self.param_gather_pending = False


def _keep_payload(faults, source, fp8_staged) -> bool:
    return (Fault.GATHER_PAYLOAD_NOT_ZEROED in faults
            or (fp8_staged and Fault.FP8_STAGED_PAYLOAD_NOT_ZEROED in faults)
            or (source == FORCE_SYNC and Fault.FORCE_SYNC_PAYLOAD_NOT_ZEROED in faults))


def start_grad_syncs_coalesced(groups: list[BucketGroup]) -> None:
    """The grad reductions of ``groups`` (none in flight: no overlap), coalesced per process
    group (:func:`parity.distributed.collectives.sums_coalesced`), as a group call coalesces
    NCCL collectives. Every bucket keeps the bits of its own collective; ``finish_grad_sync``
    then finds them done."""
    by_group: dict[int, tuple] = {}
    for g in groups:
        g.grad_reduces.append(AT_FINISH)
        all_reduce, reduce_scatter = g._scaled_reductions()
        g.grad_handles, g.rs_outputs = [], reduce_scatter
        if all_reduce or reduce_scatter:
            pg, ar, rs = by_group.setdefault(id(g.group), (g.group, [], []))
            ar += all_reduce
            rs += [(out, b.grad_data) for b, out in reduce_scatter]
    for pg, ar, rs in by_group.values():
        sums_coalesced(ar, rs, pg)


def partition_buckets(buffers: list[ParamAndGradBuffer], *, faults=FaultSet()) -> list[BucketGroup]:
    """Bucket groups (docs/spec/megatron.md s2.4). Without a ``uint8`` DistOpt buffer: one group
    per bucket. With one: each FP8 DistOpt bucket is a group and the other DistOpt buckets join
    the last of them; LayerWise buckets keep one group each, because a group runs one collective
    type (s5 item 20)."""
    buckets = [b for buf in buffers for b in buf.buckets if b.params]
    groups = _uint8_groups(buckets, _is_fp8_distopt, _is_distopt)
    upstream_rule = Fault.UINT8_DISTOPT_BUFFER_NEXT_TO_LAYERWISE
    if faults.injected(upstream_rule):
        upstream = _uint8_groups(buckets, _is_uint8, lambda b: True)  # any uint8 bucket opens a group
        if _ids(upstream) != _ids(groups) and upstream_rule in faults:
            groups = upstream
    if len({_is_distopt(b) for b in buckets}) > 1 and Fault.MERGE_ALLREDUCE_AND_REDUCE_SCATTER_BUCKETS in faults:
        return [BucketGroup(buckets, check_agreement=False, faults=faults)]
    return [BucketGroup(g, faults=faults) for g in groups]


def _is_distopt(b: Bucket) -> bool:
    return b.buffer.config.use_distributed_optimizer


def _is_uint8(b: Bucket) -> bool:
    return b.buffer.key.param_dtype == torch.uint8


def _is_fp8_distopt(b: Bucket) -> bool:
    return _is_uint8(b) and _is_distopt(b)


def _ids(groups: list[list[Bucket]]) -> list[list[int]]:
    return [[id(b) for b in g] for g in groups]


def _uint8_groups(buckets: list[Bucket], is_fp8, joins) -> list[list[Bucket]]:
    """Each ``is_fp8`` bucket is a group; the last of them carries every other bucket that
    ``joins`` it; the rest stay alone."""
    fp8 = [b for b in buckets if is_fp8(b)]
    if not fp8:
        return [[b] for b in buckets]
    riders = [b for b in buckets if joins(b) and not is_fp8(b)]
    groups = []
    for b in buckets:
        if b is fp8[-1]:
            groups.append([b] + riders)
        elif is_fp8(b) or not joins(b):
            groups.append([b])
    return groups
