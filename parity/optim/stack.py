"""One training stack (model + DDP + LayerWise Muon + DistOpt Adam) and its step, in phases.

The harness drives two of these in lockstep. The stack reports each phase with
``on_phase(step, phase, tensors, complete=True)``: ``tensors`` maps names to the LIVE tensors of
that phase (so an injected fault propagates like a real bug; the caller clones what it keeps).
A phase may come in parts (``complete=False``) and is closed by a call with ``complete=True``.

When params are captured (`param_sync`): param_sync of step N is what step N+1's first microbatch
consumes, captured per module as its forward is about to use it (after its pre-hooks ran, and for
an FP8 weight the very FP8 tensor the forward quantized or took from its cache). With
overlap_param_gather this is the only place the params are current: the one gather between two
optimizer steps is the one the forward pre-hooks do. Without overlap the eager gathers made them
current already, but only the forward knows which FP8 bytes a bf16 weight is used as. After the
last step, ``flush`` runs one more forward for that.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
from torch.nn.modules.module import register_module_forward_pre_hook

from parity.ddp.buffers import FORCE_SYNC, OPTIMIZER, PRE_HOOK
from parity.ddp.config import DDPConfig
from parity.ddp.ddp import DDP
from parity.ddp.layout import merge_rule_matters
from parity.model import GPT, is_quantized_param
from parity.model.data import batch
from parity.model.fp8_linear import FP8Linear
from parity.optim.clip import counted_grads, global_norm, grad_stats, held_grads
from parity.optim.config import StackConfig
from parity.optim.distopt import DistributedOptimizer
from parity.optim.layerwise import LayerWiseOptimizer
from parity.vocab import Fault, Phase

FP8_PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


@dataclass
class GatherWindow:
    """The param gathers of every bucket group between step ``step``'s optimizer and the next
    one, as the groups themselves recorded them (``BucketGroup.param_gathers``)."""

    step: int
    start: dict
    """group -> len(group.param_gathers) when the window opened."""
    source: str = PRE_HOOK
    """How this window's gathers must be finished: by the pre-hooks, or by a forced sync."""
    first_use: dict = field(default_factory=dict)
    """group -> (first param of the group a forward used, the gathers landed by then)."""
    total: dict = field(default_factory=dict)
    """group -> every gather landed in the window (set when it closes)."""
    wait_start: int = 0
    """len(ddp.pre_hook_waits) when the window opened."""
    waits: list = field(default_factory=list)
    """(group, IN_FLIGHT or ON_DEMAND) for each pre-hook wait in the window, in order (set when it closes)."""


class Stack:
    def __init__(self, cfg: StackConfig, groups, device):
        self.cfg, self.groups, self.device = cfg, groups, device
        faults = cfg.faults
        fp8_param = cfg.fp8_param_gather
        if fp8_param and Fault.FP8_PARAMS_NOT_BUILT in faults:
            fp8_param = False  # the knob not passed on: the stack under test runs the reference's code
        self.model = GPT(cfg.model, recipe=cfg.recipe, fp8_param=fp8_param, seed=cfg.seed,
                         device=device, ep_size=groups.ep, ep_rank=groups.ep_rank,
                         ep_group=groups.ep_group, faults=faults)
        ddp_cfg = cfg.ddp
        split = Fault.SPLIT_GRAD_BUFFERS
        if cfg.fp8_param_gather and ddp_cfg.merge_layerwise_fp8_grads and faults.injected(split) and \
                merge_rule_matters(self.model.named_parameters()) and split in faults:
            ddp_cfg = DDPConfig(**{**ddp_cfg.__dict__, "merge_layerwise_fp8_grads": False})
        self.ddp = DDP(self.model, ddp_cfg, dp_group=groups.dp_group,
                       expt_dp_group=groups.expt_dp_group, device=device, faults=faults)
        self.names = self.ddp.names
        self.params = list(self.names)
        self.layerwise = LayerWiseOptimizer(self.ddp, dp_group=groups.dp_group,
                                     expt_dp_group=groups.expt_dp_group,
                                     muon_kwargs=cfg.optim.muon_kwargs(), device=device, faults=faults)
        self.distopt = DistributedOptimizer(self.ddp.all_buffers(), self.names, cfg.optim.adam_kwargs(),
                                            faults=faults)
        self.definition_order = {p: i for i, p in enumerate(self.params)}
        self.last_grad_stats = None  # this step's GradStats (set after the grad reduce)
        self.last_step_stats = {}    # lr and the grad stats as plain numbers, for the step report
        self.fp8_linears = {m.weight: m for m in self.model.modules() if isinstance(m, FP8Linear)}
        for m in [self.model, *self.fp8_linears.values()]:
            m.faults = faults
        self.overlap = self.ddp.config.overlap_param_gather
        self.grad_buffer_clean = None  # after each forced sync: LayerWise grad_data at DP > 1 all zero?
        # param_sync is captured when the next forward consumes the params
        deferred = self.overlap and (groups.dp > 1 or groups.expt_dp > 1)  # a gather to sample before
        self.capture_at_consumption = not (deferred and Fault.SAMPLE_BEFORE_DEFERRED_GATHER in faults)
        self.window: GatherWindow | None = None  # under overlap: the gathers since the last step
        self.closed_windows: list[GatherWindow] = []
        self.pending_sync: int | None = None  # the step whose param_sync the next forward captures
        self._capture = None  # (on_phase, sync step, forward step) while a forward captures param_sync
        self._capturing_modules = set()
        self.timer = None
        """Set by the harness: called as ``timer(step, phase)`` where the stack's work for ``phase``
        of ``step`` ends between two reports (the eager gathers; inside a capturing forward, around
        each module's pre-hooks), so the time is charged to the phase that spent it."""
        if self.overlap:
            # The training loop keeps the pre-hooks off for the first iteration (the params
            # from init or a checkpoint are already in place) and turns them on after it.
            self.ddp.disable_forward_pre_hook(param_sync=False)
        self._install_param_capture()

    # -- one step ----------------------------------------------------------------------------
    def step(self, step: int, on_phase) -> None:
        cfg, ddp = self.cfg, self.ddp
        n = cfg.microbatches
        self.grad_buffer_clean = None  # set again if this step ends with a forced sync
        ddp.zero_grad_buffer()
        losses = []
        for mb in range(n):
            if mb > 0 and Fault.PAYLOAD_IN_GRAD_DURING_ACCUMULATION in cfg.faults:
                ddp.reset_param_sync_dispatch_state()  # the next gather lands in accumulating grads
            with ddp.no_sync() if mb < n - 1 else nullcontext():
                loss, logits = self._forward(step, mb, on_phase)
                losses.append(loss.detach())
                if n == 1:
                    on_phase(step, Phase.FORWARD, {"loss": loss.detach().reshape(1), "output": logits.detach()})
                else:
                    on_phase(step, Phase.FORWARD, {f"loss.mb{mb}": loss.detach().reshape(1),
                                                   f"output.mb{mb}": logits.detach()}, complete=False)
                    if mb == n - 1:  # the reported loss: the mean over microbatches
                        on_phase(step, Phase.FORWARD, {"loss": (torch.stack(losses).sum() / n).reshape(1)})
                (loss / n).backward()
        if not ddp.config.overlap_grad_reduce:
            on_phase(step, Phase.GRAD_LOCAL, self.main_grads())
        ddp.finish_grad_sync()
        on_phase(step, Phase.GRAD_REDUCE, self.main_grads())
        self._close_gather_window()
        self.clip_grads()
        self.set_lr(step)
        self.layerwise.step()
        self.distopt.step()
        if step == 0 or Fault.OPTIMIZER_REPORTED_ONCE not in cfg.faults:
            on_phase(step, Phase.OPTIMIZER, self.optimizer_state())
        if self.overlap:
            self.window = GatherWindow(step, {g: len(g.param_gathers) for g in ddp.bucket_groups},
                                       wait_start=len(ddp.pre_hook_waits))
            eager = ddp.eager_gather_buckets()
            self.distopt.gather(only=eager)
            for g in ddp.bucket_groups:  # recorded as the groups record a pre-hook's gather
                if g.gathers_params and any(b in eager for b in g.buckets):
                    g.param_gathers.append(OPTIMIZER)
            if cfg.force_sync_each_step:
                ddp.start_param_sync()  # gathers launched (e.g. by a schedule's param-sync call)
                self.force_param_sync()
            if not ddp.pre_hooks_enabled:  # once, after the first iteration
                ddp.enable_forward_pre_hook()
        else:
            self.layerwise.sync()
            self.distopt.gather()
        self._mark(step, Phase.PARAM_SYNC)
        if self.capture_at_consumption:
            self.pending_sync = step
        else:
            on_phase(step, Phase.PARAM_SYNC, self.param_tensors())

    def flush(self, on_phase) -> None:
        """After the last step: one more forward (no backward) consumes the params, which
        captures the last step's param_sync and (under overlap) lands and closes its gathers."""
        last = self.pending_sync
        if last is None and self.window is not None:  # sampled early (a fault): the gathers still land
            last = self.window.step
        if last is not None:
            with torch.no_grad():
                self._forward(last + 1, 0, on_phase)
        self._close_gather_window()

    def _forward(self, step: int, mb: int, on_phase):
        cfg = self.cfg
        tokens, labels = batch(cfg.seed, step, self.groups.dp_rank, cfg.model.micro_batch,
                               cfg.model.seq_len, cfg.model.vocab_size, self.device, microbatch=mb)
        for m in self.fp8_linears.values():
            m.is_first_microbatch = mb == 0
        capture, self.pending_sync = self.pending_sync, None  # set by the last step: this is mb 0
        if capture is None:
            return self.model(tokens, labels)
        self._capture = (on_phase, capture, step)
        # Global pre-hooks run before a module's own: this marks where its DDP pre-hooks begin.
        timed = self.timer is not None and self.ddp.pre_hooks_enabled
        marks = register_module_forward_pre_hook(self._mark_forward) if timed else None
        try:
            out = self.model(tokens, labels)
        finally:
            self._capture = None
            if marks is not None:
                marks.remove()
        self._mark(step, Phase.FORWARD)
        on_phase(capture, Phase.PARAM_SYNC, {})
        return out

    def _mark(self, step: int, phase: Phase) -> None:
        if self.timer is not None:
            self.timer(step, phase)

    def _mark_forward(self, module, args):
        if self._capture is not None and module in self._capturing_modules:
            self._mark(self._capture[2], Phase.FORWARD)  # the forward so far; its pre-hooks: param_sync

    def force_param_sync(self) -> None:
        """Under overlap, make the params current now, as training does before an evaluation or
        a checkpoint save: disable the pre-hooks with param_sync=True (finishing any gather in
        flight), then enable them again; in the first iteration, while they are still off, the
        forced param sync alone. The next forward's pre-hooks then have nothing to do until
        finish_grad_sync re-arms them."""
        ddp = self.ddp
        hooks_on = ddp.pre_hooks_enabled
        if hooks_on:
            ddp.disable_forward_pre_hook(param_sync=True)
        else:
            ddp.start_param_sync(force_sync=True)
        # The compact LayerWise buffers receive the gather in grad_data: empty once it landed. At
        # DP 1 nothing is gathered and the reduced grads stay until the next step zeroes them.
        # (None, not a vacuous True, where there are none: the padded layout gathers into param_data.)
        compact = [b for buf in ddp.all_buffers() if buf.key.is_layer_wise
                   and not buf.config.use_distributed_optimizer and buf.dp > 1 for b in buf.buckets]
        self.grad_buffer_clean = all(int(torch.count_nonzero(b.grad_data)) == 0 for b in compact) \
            if compact else None
        if self.window is not None:
            self.window.source = FORCE_SYNC
        if hooks_on:
            ddp.enable_forward_pre_hook()

    # -- param capture at consumption -------------------------------------------------------
    def _install_param_capture(self):
        """Observation hooks: registered after (and run after) the DDP's prepended pre-hooks,
        so they see each module's params as its forward is about to use them (and, under
        overlap, which gathers had landed by each group's first use)."""
        for m in self.model.modules():
            own = [p for p in m.parameters(recurse=False) if p in self.names]
            if own:
                m.register_forward_pre_hook(self._capture_hook(own))
                self._capturing_modules.add(m)
        for m in self.fp8_linears.values():
            m.weight_observer = self._observe_fp8_weight

    def _capture_hook(self, own):
        def hook(module, args):
            if self.window is not None:
                for p in own:
                    g = self.ddp.group_of.get(id(p))
                    if g in self.window.start and g not in self.window.first_use:
                        self.window.first_use[g] = (self.names[p], g.param_gathers[self.window.start[g]:])
            if self._capture is not None:
                on_phase, step, forward_step = self._capture
                # since the last mark: this module's pre-hooks (the gather), else the forward so far
                if not self.ddp.pre_hooks_enabled:
                    self._mark(forward_step, Phase.FORWARD)
                live = {self.names[p]: p.data for p in own if not self._reported_as_quantized(p)}
                if live:
                    on_phase(step, Phase.PARAM_SYNC, live, complete=False)
                else:
                    self._mark(step, Phase.PARAM_SYNC)
        return hook

    def _observe_fp8_weight(self, module, qw):
        if self._capture is not None:
            on_phase, step, forward_step = self._capture
            if not is_quantized_param(module.weight):
                self._mark(forward_step, Phase.FORWARD)  # OFF quantized its weight: forward work
            on_phase(step, Phase.PARAM_SYNC, fp8_parts(self.names[module.weight], qw), complete=False)

    def _close_gather_window(self):
        w = self.window
        if w is None:
            return
        w.total = {g: g.param_gathers[w.start[g]:] for g in w.start}
        w.waits = self.ddp.pre_hook_waits[w.wait_start:]
        self.closed_windows.append(w)
        self.window = None
        # Read: the records start over, so that a long run keeps one window's worth of them.
        for g in w.start:
            g.param_gathers.clear()
        self.ddp.pre_hook_waits.clear()

    def gather_report(self, w: GatherWindow) -> list[dict]:
        """Per bucket group of a closed window: what it gathered, how, and before which use.
        The expectation is read from the group's own buckets, not from the DDP's choice of the
        groups it hooks (a wrong choice would set its own expectation): a group with something to
        gather lands exactly one gather, by the optimizer when it holds FP8 DistOpt params
        (docs/spec/megatron.md s2.16), else by the window's way (pre-hook or force_sync)."""
        rows = []
        for i, g in enumerate(self.ddp.bucket_groups):
            first, before = w.first_use.get(g, (None, []))
            rows.append({"group": i, "first_param": first or self.names[g.params[-1]],
                         "used": first is not None, "by": OPTIMIZER if g.holds_fp8_distopt else w.source,
                         "expect": 1 if g.gathers_params else 0,
                         "before_first_use": list(before), "total": list(w.total.get(g, []))})
        return rows

    def prefetch_report(self, w: GatherWindow) -> list[dict]:
        """The pre-hook waits of a closed window, in the order the forward made them: the group
        (its index in bucket order), where its gather was then, and the group whose pre-hook is
        to launch it ahead: the next one in bucket order of the same kind, dense or expert, as
        gathers run in reverse bucket order and the two kinds chain apart (docs/spec/megatron.md
        s2.4). Read from the bucket order, not from the groups' links."""
        groups = self.ddp.bucket_groups
        index, launcher, later = {}, {}, {}  # later: kind -> the nearest group after, in bucket order
        for i in reversed(range(len(groups))):
            g, kind = groups[i], groups[i].buckets[0].buffer.key.is_expert
            index[g], launcher[g], later[kind] = i, later.get(kind), i
        return [{"group": index[g], "first_param": self.names[g.params[-1]], "arrival": arrival,
                 "launcher": launcher[g]} for g, arrival in w.waits]

    def set_lr(self, step: int) -> None:
        """Both optimizers take this step's lr from the schedule (docs/spec/megatron.md s2.15)."""
        lr = self.cfg.optim.lr_at(step)
        for opt in (self.layerwise.muon, self.distopt.optimizer):
            for group in opt.param_groups if opt is not None else ():
                if opt is self.distopt.optimizer and group["lr"] != lr and \
                        Fault.LR_SCHEDULE_SKIPS_DISTOPT in self.cfg.faults:
                    continue  # the schedule reaches the LayerWise child only: Adam keeps its lr
                group["lr"] = lr
        self.last_step_stats["lr"] = lr

    def clip_grads(self) -> None:
        """Grad norm, clipping and zeros over the reduced grads, before the optimizers step
        (docs/spec/megatron.md s1.3 step 5, s2.14)."""
        g = self.groups
        clip = self.cfg.optim.clip_grad
        held = held_grads(self.layerwise, self.distopt, self.cfg.faults) if clip > 0 else []
        st = grad_stats(self._counted_grads(), held, dp_group=g.dp_group, expt_dp_group=g.expt_dp_group,
                        ep_group=g.ep_group, clip_grad=clip, device=self.device, faults=self.cfg.faults)
        self.last_grad_stats = st
        self.last_step_stats.update(grad_norm=float(st.norm), num_zeros=int(st.num_zeros),
                                    clip_coef=None if st.clip_coef is None else float(st.clip_coef))

    def stepped_grad_norm(self) -> torch.Tensor:
        """The global norm of the grads the optimizers step with, as they are now (after any
        clipping), counted as :meth:`clip_grads` counts them. Collective: every rank calls it."""
        g = self.groups
        return global_norm(self._counted_grads(), dp_group=g.dp_group, expt_dp_group=g.expt_dp_group,
                           ep_group=g.ep_group, device=self.device)

    def _counted_grads(self):
        return counted_grads(self.layerwise, self.distopt, self.definition_order, self.cfg.faults)

    # -- captured tensors ------------------------------------------------------------------
    def main_grads(self) -> dict:
        return {self.names[p]: p.main_grad for p in self.params}

    def optimizer_state(self) -> dict:
        out = dict(self.layerwise.state_tensors())
        out.update(self.distopt.state_tensors())
        st = self.last_grad_stats
        if st is not None:  # compared every step, recorded in goldens with the optimizer phase
            out.update({"grad_norm": st.norm, "num_zeros": st.num_zeros})
            if st.clip_coef is not None:
                out["clip_coef"] = st.clip_coef
        return out

    def master_pairs(self):
        """(name, param values, master) for every fp32 master this rank steps whose param holds
        its rounding (docs/spec/megatron.md s2.8): LayerWise masters and DistOpt shard pieces."""
        yield from self.layerwise.master_pairs()
        yield from self.distopt.master_pairs()

    def _reported_as_quantized(self, p) -> bool:
        """Whether ``p`` is reported by its FP8 parts (not by its own data) at param_sync."""
        # the fault probes `dequantize`, which every torch tensor has
        return is_quantized_param(p) or (Fault.QUANTIZED_CLASSIFIER_ALWAYS_TRUE in self.cfg.faults
                                         and hasattr(p, "dequantize"))

    def param_tensors(self) -> dict:
        """The params as they are now, not as a forward uses them (an FP8 weight of a bf16 param
        is quantized here): param_sync reads them only under the sample-before-deferred-gather
        fault; checkpoint tests read them after a load."""
        out = {}
        for p in self.params:
            name = self.names[p]
            if self._reported_as_quantized(p):
                qt = p.qt if is_quantized_param(p) else None  # a misclassified bf16 param reports nothing
            else:
                out[name] = p.data
                m = self.fp8_linears.get(p)
                qt = m.fp8_weight() if m is not None else None
            if qt is not None:
                out.update(fp8_parts(name, qt))
        return out

    def persistent_bytes(self) -> dict:
        """Bytes the Muon matrices persist as model weights (FP8 parts or bf16/fp32 storage)."""
        stored, fp8_copy = 0, 0
        for b in self.layerwise.lw_buffers:
            for p in b.params:
                if is_quantized_param(p):
                    stored += p.qt.nbytes
                else:
                    stored += p.numel() * p.element_size()
                    m = self.fp8_linears.get(p)
                    if m is not None:  # OFF also holds an FP8 copy of this weight per forward
                        fp8_copy += m.fp8_weight().nbytes
        return {"muon_param_bytes": stored, "off_fp8_weight_copy_bytes": fp8_copy,
                "muon_total_bytes": stored + fp8_copy}


def fp8_parts(name: str, qt) -> dict:
    """The raw parts of an FP8 weight, keyed as param_sync names them."""
    out = {}
    for part in FP8_PARTS:
        t = getattr(qt, part, None)
        if t is not None:
            out[f"{name}.fp8.{part}"] = t
    return out
