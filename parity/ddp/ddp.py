"""The DDP wrapper: buffers, grad hooks, grad reduction (with no_sync for gradient accumulation)
and the overlapped param gather done by forward pre-hooks (docs/spec/megatron.md s1.3, s2.10-2.11)."""

from __future__ import annotations

from contextlib import contextmanager

import torch.distributed as dist

from parity.ddp.buffers import (
    FORCE_SYNC,
    IN_FLIGHT,
    ON_DEMAND,
    PRE_HOOK,
    BufferConfig,
    ParamAndGradBuffer,
    partition_buckets,
    start_grad_syncs_coalesced,
)
from parity.ddp.config import DDPConfig
from parity.ddp.layout import (
    compact_layout,
    distopt_layout,
    group_params_for_buffers,
    padded_layer_wise_layout,
)
from parity.model.fp8_linear import FP8Linear
from parity.vocab import Fault, FaultSet


class DDP:
    def __init__(self, model, config: DDPConfig, *, dp_group, expt_dp_group, device, faults=frozenset()):
        self.model, self.config, self.faults = model, config, FaultSet(faults)
        self.names = {p: n for n, p in model.named_parameters()}
        if Fault.WRAPPER_PREFIXED_NAMES in self.faults:  # as a wrapper module's named_parameters() gives them
            self.names = {p: f"module.{n}" for p, n in self.names.items()}
        self.dp_group, self.expt_dp_group = dp_group, expt_dp_group
        opted_out = any(getattr(p, "use_muon", True) is False for p in model.parameters())  # a 2-D Adam param
        groups = group_params_for_buffers(
            model.named_parameters(), merge_layerwise_fp8_grads=config.merge_layerwise_fp8_grads,
            honor_use_muon=not (opted_out and Fault.ROUTING_PREDICATE_MISMATCH in self.faults))
        self.buffers, self.expert_buffers = [], []
        data_parallel = dist.get_world_size(dp_group)
        for key, params in groups.items():
            group = expt_dp_group if key.is_expert else dp_group
            dp = dist.get_world_size(group)
            # 1/DP for expert grads too: through the all-to-all, the expert-DP group's ranks
            # together already hold every DP rank's tokens (docs/spec/megatron.md s1.3 step 4).
            scale = 1.0 / data_parallel
            if dp != data_parallel and Fault.EXPERT_GRADS_SCALED_BY_EXPERT_DP in self.faults:
                scale = 1.0 / dp  # the size of the group that sums them
            if key.is_layer_wise and config.layout == "compact":
                lay, cfg = compact_layout(params, config.layout_bucket_size), BufferConfig(False, scale)
            elif key.is_layer_wise:
                lay, cfg = padded_layer_wise_layout(params, config.layout_bucket_size, dp), BufferConfig(True, scale)
            else:
                lay, cfg = distopt_layout(params, config.layout_bucket_size, dp), BufferConfig(True, scale)
            buf = ParamAndGradBuffer(key, params, lay, cfg, group, device)
            (self.expert_buffers if key.is_expert else self.buffers).append(buf)
        self.bucket_groups, self.chains = [], []
        for bufs in (self.buffers, self.expert_buffers):
            if not bufs:
                continue
            chain = partition_buckets(bufs, faults=self.faults)
            # Gathers run in forward order, the reverse of bucket (backprop) order: each group's
            # pre-hook launches the next group's gather. Dense and expert groups chain apart.
            for later, earlier in zip(chain[1:], chain[:-1]):
                later.next_param_gather_group = earlier
            self.bucket_groups += chain
            self.chains.append(chain)
        self.group_of = {id(p): g for g in self.bucket_groups for p in g.params}
        self._install_grad_hooks()
        self.is_last_microbatch = True
        self._pre_hooks = []
        self.pre_hooks_enabled = False
        self.pre_hook_waits: list[tuple] = []  # (group, IN_FLIGHT or ON_DEMAND) per pre-hook that waited
        if config.overlap_param_gather:
            self.enable_forward_pre_hook()

    # -- buffers ---------------------------------------------------------------------------
    def all_buffers(self):
        return self.buffers + self.expert_buffers

    def buffer_report(self) -> list[dict]:
        return [b.report() for b in self.all_buffers()]

    def zero_grad_buffer(self):
        buffers = self.all_buffers()
        if self.buffers and Fault.ZERO_GRAD_SKIPS_DENSE_BUFFERS in self.faults:
            buffers = self.expert_buffers  # the dense ones keep the last step's reduced grads
        for b in buffers:
            b.grad_data.zero_()
        for g in self.bucket_groups:
            g.reset()

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
        if self.is_last_microbatch and self.config.overlap_grad_reduce:
            self.group_of[id(p)].register_grad_ready(p)

    @contextmanager
    def no_sync(self):
        """Gradient accumulation: grads of the microbatches run inside accumulate in main_grad
        and launch no reduction; the last microbatch runs outside and triggers them."""
        self.is_last_microbatch = False
        try:
            yield
        finally:
            self.is_last_microbatch = True

    def finish_grad_sync(self):
        if self.config.overlap_grad_reduce:
            # The backward hooks launched each group's reduction once its params reported as
            # often as in the first step; groups that have not learned that yet (the first step,
            # or no param of theirs ever reported) reduce now. A group that learned it and was
            # not launched is an error, as upstream asserts (docs/spec/megatron.md s1.3 step 3).
            start_grad_syncs_coalesced([g for g in self.bucket_groups if g.expected_counts is None])
            late = [g for g in self.bucket_groups if g.grad_handles is None]
            if late:
                g = late[0]
                raise RuntimeError(f"grad reduction of bucket group {self.bucket_groups.index(g)} "
                                   f"({self.names[g.params[0]]}, ...) never issued by the backward hooks: "
                                   f"{len(g.ready_counts)}/{len(g.params)} params reported their grads "
                                   f"({len(late)} group(s) late)")
        else:  # no group has started: all their reductions go out coalesced
            start_grad_syncs_coalesced(self.bucket_groups)
        for g in self.bucket_groups:
            g.finish_grad_sync()

    # -- overlapped param gather (docs/spec/megatron.md s2.10-2.11) ----------------------------
    def param_gather_groups(self):
        """Groups whose param gather the forward pre-hooks do under overlap_param_gather: every
        group (LayerWise all-reduce groups on the compact layout, DistOpt groups otherwise) but
        those holding FP8 DistOpt params, which are requantized from gathered bf16 masters: an
        optimizer step a pre-hook cannot do (docs/spec/megatron.md s2.16)."""
        if not self.config.overlap_param_gather:
            return []
        groups = [g for g in self.bucket_groups if not g.holds_fp8_distopt]
        if any(_is_expert(g) and g.gathers_params for g in groups) and Fault.PREHOOKS_SKIP_EXPERT_GROUPS in self.faults:
            groups = [g for g in groups if not _is_expert(g)]  # the expert chain left out
        return groups

    def eager_gather_buckets(self) -> set:
        """Buckets the optimizer gathers right after its step even under overlap (see above)."""
        if not self.config.overlap_param_gather:
            return set()
        return {b for g in self.bucket_groups if g.holds_fp8_distopt for b in g.buckets}

    def enable_forward_pre_hook(self):
        if self.pre_hooks_enabled:  # as upstream asserts: a second enable is a caller's bug
            raise AssertionError("forward pre-hooks are already enabled")
        skipped = None
        if self.faults.injected(Fault.PREHOOKS_NOT_REGISTERED):
            first = self._first_gathered_layer_wise_group()
            if first is not None and Fault.PREHOOKS_NOT_REGISTERED in self.faults:
                skipped = first
        hooked = self.param_gather_groups()  # not the groups the optimizer gathers right after its step
        if any(g.holds_fp8_distopt for g in self.bucket_groups) and Fault.PREHOOKS_ON_EAGER_GROUPS in self.faults:
            hooked = self.bucket_groups  # their raw FP8 bytes re-gathered: the unmodelled byte route
        for m in self.model.modules():
            groups = []
            for p in m.parameters(recurse=False):
                g = self.group_of.get(id(p))
                if g is not None and g in hooked and g not in groups and g is not skipped:
                    groups.append(g)
            if groups:
                # Prepended: the params are current before any other pre-hook looks at them.
                self._pre_hooks.append(m.register_forward_pre_hook(self._make_pre_hook(groups), prepend=True))
        self.pre_hooks_enabled = True

    def disable_forward_pre_hook(self, param_sync: bool = True):
        if not self.pre_hooks_enabled:  # as upstream asserts: nothing to remove is a caller's bug
            raise AssertionError("forward pre-hooks are not enabled")
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

    def _first_gathered_layer_wise_group(self):
        """The first group a chain's pre-hooks gather (in forward order), where it is a gathered
        LayerWise group: no other pre-hook launches its gather (the PREHOOKS_NOT_REGISTERED fault
        drops its hooks)."""
        hooked = self.param_gather_groups()
        for chain in self.chains:
            first = next((g for g in reversed(chain) if g in hooked), None)
            if first is not None and first.is_layer_wise and first.dp > 1:
                return first
        return None

    def start_param_sync(self, force_sync: bool = False):
        """Launch every group's gather (async); with ``force_sync`` finish them all now,
        including gathers already in flight (the force_sync fix: wait AND copy back)."""
        if not self.config.overlap_param_gather:  # s5 item 19: the bucket path is overlap-only
            raise AssertionError("bucket param sync needs overlap_param_gather; without overlap "
                                 "the optimizers gather params themselves")
        for g in self.param_gather_groups():
            if force_sync and g.param_gather_handle is not None:
                if Fault.FORCE_SYNC_STALE in self.faults:
                    g.drop_param_sync()  # waited, but no copy-back and no zeroing
                else:
                    g.finish_param_sync(FORCE_SYNC)
                continue
            g.start_param_sync()
            if force_sync:
                g.finish_param_sync(FORCE_SYNC)

    def finish_param_sync(self, g):
        """A forward pre-hook's work for one group: launch its gather if nobody did, wait on it,
        launch the next group's gather, then copy this group's payload back. Records, in order,
        whether the gather it waits on was already in flight when it came to it (the overlap)."""
        arrival = IN_FLIGHT if g.param_gather_dispatched else ON_DEMAND
        if not g.param_gather_dispatched:
            g.start_param_sync()
        if g.param_gather_handle is None:
            return  # landed already (or nothing to gather)
        self.pre_hook_waits.append((g, arrival))
        g.wait_param_sync()
        nxt = g.next_param_gather_group
        if nxt is not None and not nxt.param_gather_dispatched:
            if Fault.NEXT_GATHER_NOT_PREFETCHED not in self.faults:  # else its own hook launches it
                nxt.start_param_sync()
        if nxt is not None and Fault.WAIT_WRONG_HANDLE in self.faults:
            g = nxt  # the copy-back reads the gather this hook just launched
        g.finish_param_sync(PRE_HOOK)

    def reset_param_sync_dispatch_state(self):
        """Mark every bucket group's gather not dispatched, for the next forward's pre-hooks (all
        groups, as upstream; a group whose gather is still in flight may not be re-armed)."""
        for g in self.bucket_groups:
            if g.param_gather_handle is not None:
                raise AssertionError("cannot re-arm a bucket group with a gather in flight")
            g.param_gather_dispatched = False


def _is_expert(g) -> bool:
    return g.buckets[0].buffer.key.is_expert  # a group never mixes expert and dense buckets
