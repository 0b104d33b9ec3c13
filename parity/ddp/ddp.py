"""The DDP wrapper: buffers, grad hooks, grad reduction and the deferred LayerWise param gather."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from parity.ddp import param_sync
from parity.ddp.buffers import BufferConfig, ParamAndGradBuffer, partition_buckets
from parity.ddp.layout import (
    compact_layout,
    distopt_layout,
    group_params_for_buffers,
    padded_layer_wise_layout,
)
from parity.model.fp8_linear import FP8Linear
from parity.vocab import Fault

LAYOUTS = ("compact", "padded")


@dataclass(frozen=True)
class DDPConfig:
    """Data-parallel wrapper settings."""

    bucket_size: int | None = None
    """Elements per bucket (None: one bucket per buffer)."""
    overlap_grad_reduce: bool = False
    """Launch each bucket group's reduction as soon as all its grads are ready."""
    overlap_param_gather: bool = False
    """Defer the LayerWise param gather to the next forward's pre-hooks (needs overlap_grad_reduce)."""
    layout: str = "compact"
    """LayerWise buffers: 'compact' (decoupled, no padding) or 'padded' (shard-aligned DistOpt)."""
    merge_layerwise_fp8_grads: bool = True
    """Key FP8 LayerWise grads by their bf16 logical dtype (one all-reduce buffer, as OFF)."""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"ddp.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"ddp.bucket_size must be positive or None, got {self.bucket_size}")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("overlap_param_gather requires overlap_grad_reduce")


class DDP:
    def __init__(self, model, config: DDPConfig, *, dp_group, expt_dp_group, device, faults=frozenset()):
        self.model, self.config, self.faults = model, config, frozenset(faults)
        self.names = {p: n for n, p in model.named_parameters()}
        self.dp_group, self.expt_dp_group = dp_group, expt_dp_group
        groups = group_params_for_buffers(
            model.named_parameters(), merge_layerwise_fp8_grads=config.merge_layerwise_fp8_grads,
            honor_use_muon=Fault.ROUTING_PREDICATE_MISMATCH not in self.faults)
        self.buffers, self.expert_buffers = [], []
        for key, params in groups.items():
            group = expt_dp_group if key.is_expert else dp_group
            dp = dist.get_world_size(group)
            if key.is_layer_wise and config.layout == "compact":
                lay, cfg = compact_layout(params, config.bucket_size), BufferConfig(False)
            elif key.is_layer_wise:
                lay, cfg = padded_layer_wise_layout(params, config.bucket_size, dp), BufferConfig(True)
            else:
                lay, cfg = distopt_layout(params, config.bucket_size, dp), BufferConfig(True)
            buf = ParamAndGradBuffer(key, params, lay, cfg, group, device)
            (self.expert_buffers if key.is_expert else self.buffers).append(buf)
        merge = Fault.MERGE_ALLREDUCE_AND_REDUCE_SCATTER_BUCKETS in self.faults
        self.bucket_groups = []
        for bufs in (self.buffers, self.expert_buffers):
            if bufs:
                self.bucket_groups += partition_buckets(bufs, single_group=merge,
                                                        check_agreement=not merge, faults=self.faults)
        # Gathers run in forward order: the reverse of bucket (backprop) order.
        for later, earlier in zip(self.bucket_groups[1:], self.bucket_groups[:-1]):
            later.next_param_gather_group = earlier
        self.group_of = {id(p): g for g in self.bucket_groups for p in g.params}
        self._install_grad_hooks()
        self._pre_hooks = []
        self.pre_hooks_enabled = False
        if config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # -- buffers ---------------------------------------------------------------------------
    def all_buffers(self):
        return self.buffers + self.expert_buffers

    def buffer_report(self) -> list[dict]:
        return [b.report() for b in self.all_buffers()]

    def zero_grad_buffer(self):
        for b in self.all_buffers():
            b.grad_data.zero_()
        for g in self.bucket_groups:
            g.ready.clear()

    # -- gradients -------------------------------------------------------------------------
    def _install_grad_hooks(self):
        fp8_weights = {id(m.weight) for m in self.model.modules() if isinstance(m, FP8Linear)}
        for p in self.names:
            if id(p) in fp8_weights:
                p.grad_ready_hook = self._grad_ready
            else:
                p.register_post_accumulate_grad_hook(self._accumulate_and_ready)

    def _accumulate_and_ready(self, p):
        p.main_grad.add_(p.grad)
        p.grad = None
        self._grad_ready(p)

    def _grad_ready(self, p):
        self.group_of[id(p)].register_grad_ready(p, self.config.overlap_grad_reduce)

    def start_grad_sync(self):
        for g in self.bucket_groups:
            if g.grad_handles is None:
                g.start_grad_sync(async_op=False)

    def finish_grad_sync(self):
        for g in self.bucket_groups:
            g.finish_grad_sync()

    # -- deferred LayerWise param gather (docs/spec/megatron.md s2.10-2.11) ----------------------------
    def enable_forward_pre_hook(self):
        if self._pre_hooks:
            return
        for m in self.model.modules():
            own = [p for p in m.parameters(recurse=False)]
            groups = []
            for p in own:
                g = self.group_of.get(id(p))
                if g is not None and g.is_layer_wise and not g.use_distributed_optimizer and g not in groups:
                    groups.append(g)
            if groups:
                self._pre_hooks.append(m.register_forward_pre_hook(self._make_pre_hook(groups)))
        self.pre_hooks_enabled = True

    def disable_forward_pre_hook(self, param_sync: bool = True):
        for h in self._pre_hooks:
            h.remove()
        self._pre_hooks = []
        self.pre_hooks_enabled = False
        if param_sync:
            self.start_param_sync(force_sync=True)

    def _make_pre_hook(self, groups):
        def hook(module, args):
            for g in groups:
                self.finish_param_sync(g)
        return hook

    def layer_wise_overlap_groups(self):
        return [g for g in self.bucket_groups if g.is_layer_wise and not g.use_distributed_optimizer]

    def armed(self) -> bool:
        """Every deferred-gather group will gather in the next forward (none left dispatched)."""
        return all(not g.param_gather_dispatched for g in self.layer_wise_overlap_groups())

    def start_param_sync(self, force_sync: bool = False, group=None):
        if not self.config.overlap_param_gather:  # s5 item 19: the bucket path is overlap-only
            raise AssertionError("LayerWise bucket param sync needs overlap_param_gather; without "
                                 "overlap the optimizer gathers params itself (allgather_params)")
        groups = [group] if group is not None else self.layer_wise_overlap_groups()
        for g in groups:
            if force_sync and g.param_gather_handle is not None:
                # A gather is pending: finish it now, or params stay stale and the payload
                # stays in grad_data (the force_sync fix).
                if Fault.FORCE_SYNC_STALE in self.faults:
                    g.param_gather_handle = None  # waited, but no copy-back and no zeroing
                    for b in g.buckets:
                        b.gather_slots = None
                else:
                    self._finalize(g)
                continue
            self._dispatch(g)
            if force_sync:
                self._finalize(g)

    def finish_param_sync(self, g):
        if not g.param_gather_dispatched:
            self._dispatch(g)
        nxt = g.next_param_gather_group
        if nxt is not None and not nxt.param_gather_dispatched:
            self._dispatch(nxt)
        if g.param_gather_handle is not None:
            self._finalize(g)

    def reset_param_sync_dispatch_state(self):
        for g in self.layer_wise_overlap_groups():
            if g.param_gather_handle is not None:
                raise AssertionError("cannot re-arm a bucket group with a gather in flight")
            g.param_gather_dispatched = False

    def _dispatch(self, g):
        g.param_gather_dispatched = True
        if g.dp == 1:
            return
        my = dist.get_rank(g.group)
        pending = False
        for b in g.buckets:
            if b.layerwise_lists is None:
                continue
            b.layerwise_fp8_staged = param_sync.is_fp8_staged(b.params, self.faults)
            dtype = param_sync.transport_dtype(b.layerwise_fp8_staged, b.params)
            recv = b.grad_data.view(dtype)
            flat, sizes = param_sync.gather_lists(b.layerwise_lists, g.group, my, recv,
                                                  b.layerwise_fp8_staged, dtype, recv.device, self.faults)
            if flat is not None:
                b.gather_slots = (flat, sizes)
                pending = True
        # gloo collectives here are synchronous; what stays pending is the copy-back.
        g.param_gather_handle = True if pending else None

    def _finalize(self, g):
        my = dist.get_rank(g.group) if g.dp > 1 else 0
        for b in g.buckets:
            if b.gather_slots is None:
                continue
            flat, sizes = b.gather_slots
            staged = b.layerwise_fp8_staged
            if Fault.STAGING_NOT_PERSISTED in self.faults:
                staged = not staged
            param_sync.copy_back_all(b.layerwise_lists, flat, sizes, staged, my)
            b.gather_slots = None
            if Fault.GATHER_PAYLOAD_NOT_ZEROED not in self.faults:
                b.grad_data.zero_()
        g.param_gather_handle = None
