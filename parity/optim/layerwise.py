"""LayerWise optimizer: whole-matrix ownership, Muon on owned masters, whole-param gather
(docs/spec/megatron.md s2.6-2.11)."""

from __future__ import annotations

import random

import torch
import torch.distributed as dist

from parity.ddp import param_sync
from parity.model import is_expert_param, is_layer_wise_managed, is_quantized_param
from parity.optim.mixed_precision import (
    copy_master_to_param,
    is_native_fp32,
    make_master,
)
from parity.optim.muon import Muon
from parity.vocab import Fault, FaultSet


def ping_pong(n: int, size: int) -> list[int]:
    """Owners 0,1,..,D-1,D-1,..,1,0,0,1,..: count-balanced whole-matrix ownership."""
    seq = list(range(size)) + list(range(size - 1, -1, -1))
    return [seq[i % len(seq)] for i in range(n)]


class LayerWiseOptimizer:
    def __init__(self, ddp, *, dp_group, expt_dp_group, muon_kwargs: dict, device, faults=frozenset()):
        self.ddp, self.faults, self.device = ddp, FaultSet(faults), device
        self.dp_group, self.expt_dp_group = dp_group, expt_dp_group
        self.dp, self.expt_dp = dist.get_world_size(dp_group), dist.get_world_size(expt_dp_group)
        self.dp_rank, self.expt_dp_rank = dist.get_rank(dp_group), dist.get_rank(expt_dp_group)
        self.names = ddp.names
        self.padded = ddp.config.layout == "padded"
        bufs = ddp.buffers + ddp.expert_buffers
        # Canonical identity from construction: (chunk, buffer index, global start).
        self.identity = {}
        for bi, buf in enumerate(bufs):
            for p in buf.params:
                self.identity[p] = (0, bi, buf.layout.index[p][0])
        self.lw_buffers = [b for b in bufs if b.key.is_layer_wise]
        # The optimizer's own routing predicate: only Muon-eligible params of LayerWise buffers.
        params = [p for b in self.lw_buffers for p in b.params if is_layer_wise_managed(p)]
        dense = [p for p in params if not is_expert_param(p)]
        expert = [p for p in params if is_expert_param(p)]
        self.dense_lists = self._assign(dense, self.dp)
        self.expert_lists = self._assign(expert, self.expt_dp)
        self.owned = self.dense_lists[self.dp_rank] + self.expert_lists[self.expt_dp_rank]
        self.gathered = set()
        for lists, size in ((self.dense_lists, self.dp), (self.expert_lists, self.expt_dp)):
            if size > 1:
                self.gathered.update(id(p) for lst in lists for p in lst)
        self.use_fp8_param_sync = any(is_quantized_param(p) for p in params)
        owned_ids = {id(p) for p in self.owned}
        self.masters = {}
        for p in self.owned:
            if is_native_fp32(p):
                self.masters[p] = p  # its own master
            else:
                m = make_master(p, device, self.faults)
                p.main_param = m
                self.masters[p] = m
        # Non-owned params drop their high-precision init copy too; only owners consume it.
        for p in params:
            if id(p) not in owned_ids and is_quantized_param(p) and Fault.KEEP_NONOWNED_INIT_COPY not in self.faults:
                p.clear_high_precision_init_val()
        masters = list(self.masters.values())
        if masters and Fault.MUON_NORMALIZE_WITHOUT_EPS in self.faults:  # X / ||X||: a zero update is 0/0
            muon_kwargs = {**muon_kwargs, "eps": 0.0}
        self.muon = Muon(masters, **muon_kwargs) if masters else None
        gathers = self.dp > 1 or self.expt_dp > 1  # at DP 1 the pre-hooks gather nothing anyway
        if ddp.config.overlap_param_gather and not self.padded and \
                not (gathers and Fault.LAYERWISE_OVERLAP_FLAG_OFF in self.faults):
            self._set_bucket_lists()

    # -- ownership -------------------------------------------------------------------------
    def _assign(self, params, size) -> list[list]:
        if self.padded:
            lists = [[] for _ in range(size)]
            for buf in self.lw_buffers:
                for p in buf.params:
                    if any(p is q for q in params):
                        lists[buf.layout.shard_owner[p]].append(p)
            return lists
        if size > 1 and Fault.NUMEL_ONLY_OWNERSHIP in self.faults:
            # A stable sort on numel alone ties by local insertion order, which differs per rank.
            local = list(params)
            random.Random(dist.get_rank()).shuffle(local)
            order = sorted(local, key=lambda p: p.numel())
        else:
            order = sorted(params, key=lambda p: (p.numel(),) + self.identity[p])
        lists = [[] for _ in range(size)]
        for p, r in zip(order, ping_pong(len(order), size)):
            lists[r].append(p)
        return lists

    def ownership_table(self, expert: bool | None = None) -> list[tuple[str, int]]:
        """(param name, owner) rows; dense and expert tables agree within their own DP groups."""
        rows = []
        for is_exp, lists in ((False, self.dense_lists), (True, self.expert_lists)):
            if expert is not None and expert != is_exp:
                continue
            for r, lst in enumerate(lists):
                rows += [(self.names[p], r) for p in lst]
        return sorted(rows)

    def _set_bucket_lists(self):
        for buf in self.lw_buffers:
            lists = self.expert_lists if buf.key.is_expert else self.dense_lists
            for b in buf.buckets:
                members = {id(p) for p in b.params}
                b.layerwise_lists = [[p for p in lst if id(p) in members] for lst in lists]

    # -- step ------------------------------------------------------------------------------
    def step(self):
        for p, m in self.masters.items():
            m.grad = p.main_grad
        if self.muon is not None:
            self.muon.step()
        for p, m in self.masters.items():
            m.grad = None
            if m is p:
                continue
            if is_quantized_param(p) and id(p) in self.gathered:
                continue  # the gather's requantize writes it
            copy_master_to_param(p, m, self.faults)

    def sync(self):
        """Eager param sync after the step (without overlap_param_gather; with it, the DDP's
        forward pre-hooks gather the LayerWise buckets instead)."""
        if self.padded:
            self._gather_padded()
        else:
            self.allgather_params()

    def allgather_params(self):
        for lists, group, size, my in ((self.dense_lists, self.dp_group, self.dp, self.dp_rank),
                                       (self.expert_lists, self.expt_dp_group, self.expt_dp, self.expt_dp_rank)):
            if size == 1 or not any(lists):
                continue
            if any(is_native_fp32(p) for lst in lists for p in lst) and Fault.FP32_VIA_BF16 in self.faults:
                staged, native = lists, [[] for _ in lists]
            else:
                staged = [[p for p in lst if not is_native_fp32(p)] for lst in lists]
                native = [[p for p in lst if is_native_fp32(p)] for lst in lists]
            for part, fp8 in ((staged, self.use_fp8_param_sync), (native, False)):
                if not any(part):
                    continue
                if not part[0] and Fault.RANK0_EMPTY_SLOT in self.faults:
                    dtype = part[0][0].dtype  # the head of rank 0's list: IndexError when empty
                else:
                    dtype = next(lst[0] for lst in part if lst).dtype
                if fp8:
                    dtype = torch.bfloat16
                flat, sizes, _ = param_sync.gather_lists(part, group, my, None, fp8, dtype, self.device,
                                                         self.faults)
                if flat is not None:
                    param_sync.copy_back_all(part, flat, sizes, fp8, my, self.faults)

    def _gather_padded(self):
        for buf in self.lw_buffers:
            buf.gather_param_data()

    def master_pairs(self):
        """(name, param, master) of every master this rank holds for a param that is neither FP8
        (compared as its FP8 bytes instead) nor the master itself (a native fp32 param)."""
        for p, m in self.masters.items():
            if m is not p and not is_quantized_param(p):
                yield self.names[p], p.data, m

    def state_tensors(self) -> dict:
        out = {}
        for p, m in self.masters.items():
            name = self.names[p]
            out[f"{name}.master"] = m
            st = self.muon.state.get(m, {}) if self.muon else {}
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"{name}.{k}"] = v
        return out
