"""DistributedOptimizer: byte-range shards of DistOpt buffers, fp32 master shards, Adam on
shards, all-gather of the param buffer (the sibling params' path, docs/spec/megatron.md s1.2).

FP8 params (a ``uint8`` buffer, e.g. an FP8 output projection, s2.16) take the route the LayerWise
FP8 gather takes (s2.9, s2.12): each rank's shard master is cast to bf16 and all-gathered, and every
rank requantizes the whole param from the gathered bf16 values, so every rank holds
``Q(bf16(master))``: what OFF's forward quantizes from its bf16 weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from parity.distributed.collectives import all_gather_into
from parity.distributed.determinism import empty
from parity.ddp.param_sync import write_fp8
from parity.model import is_quantized_param, is_weight_decayed
from parity.optim.adam import Adam
from parity.vocab import Fault, FaultSet


class ShardPiece:
    """The part of one param that lies in this rank's shard of its bucket."""

    def __init__(self, param, name, buf, lo, hi, faults=frozenset()):
        self.param, self.name, self.buf, self.lo, self.hi = param, name, buf, lo, hi
        self.grad = buf.grad_data[lo:hi]
        if is_quantized_param(param):
            # Seed from the preserved high-precision init, as the LayerWise masters are (s2.7):
            # ON's FP8 bytes dequantize to Q(init), not to the init OFF's master starts from.
            ps = buf.layout.index[param][0]
            hp = param.get_high_precision_init_val()
            if hp is None or Fault.MASTER_FROM_FP8_DEQUANT in faults:
                hp = param.qt.dequantize(torch.float32)
            self.master = hp.reshape(-1)[lo - ps:hi - ps].to(buf.grad_data.device, torch.float32, copy=True)
        else:
            self.master = buf.param_data[lo:hi].to(torch.float32, copy=True)


class DistributedOptimizer:
    def __init__(self, buffers, names: dict, adam_kwargs: dict, faults=frozenset()):
        self.faults = FaultSet(faults)
        self.buffers = [b for b in buffers if b.config.use_distributed_optimizer and not b.key.is_layer_wise]
        self.pieces: list[ShardPiece] = []
        for buf in self.buffers:
            r = dist.get_rank(buf.group) if buf.dp > 1 else 0
            if buf.dp > 1 and Fault.DISTOPT_SHARDS_REVERSED in self.faults:
                r = buf.dp - 1 - r  # not the shard the reduce-scatter fills and the all-gather sends
            for b in buf.buckets:
                shard = b.numel // buf.dp
                s0, s1 = b.start + r * shard, b.start + (r + 1) * shard
                if Fault.SHARD_END_EXCLUDED in self.faults:
                    s1 -= 1  # an exclusive bound taken as inclusive: each shard's last element
                for p in b.params:
                    ps, pe, _ = buf.layout.index[p]
                    lo, hi = max(ps, s0), min(pe, s1)
                    if lo < hi:
                        piece = ShardPiece(p, f"{names[p]}[{lo - ps}:{hi - ps}]", buf, lo, hi, self.faults)
                        self.pieces.append(piece)
        # Every rank drops the init copies once the shard masters exist, owner of a piece or not.
        for buf in self.buffers:
            for p in buf.params:
                if is_quantized_param(p):
                    p.clear_high_precision_init_val()
        # Two param groups, as upstream's weight-decay multipliers make them: the decayed params,
        # and the biases and 1-D params at weight decay 0 (an empty group is left out).
        def decayed(pc) -> bool:
            if is_weight_decayed(pc.param, names[pc.param]):
                return True
            return Fault.WEIGHT_DECAY_ON_NORMS in self.faults  # the norms decayed too

        decays = [decayed(pc) for pc in self.pieces]
        groups = [{"params": [pc.master for pc, d in zip(self.pieces, decays) if d]},
                  {"params": [pc.master for pc, d in zip(self.pieces, decays) if not d], "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        self.optimizer = Adam(groups, **adam_kwargs) if groups else None

    def step(self):
        for pc in self.pieces:
            pc.master.grad = pc.grad
        if self.optimizer is not None:
            self.optimizer.step()
        for pc in self.pieces:
            if not is_quantized_param(pc.param):  # FP8 pieces travel as bf16 in gather()
                pc.buf.param_data[pc.lo:pc.hi].copy_(pc.master)
            pc.master.grad = None

    def gather(self, only=None):
        """Param sync after the step: every bucket of my buffers (or only the buckets in ``only``)."""
        for buf in self.buffers:
            for b in buf.buckets:
                if only is not None and b not in only:
                    continue
                if buf.key.param_dtype == torch.uint8:
                    self._gather_fp8(buf, b)
                else:
                    b.start_param_data_gather().wait()
                    b.gather_send = None

    def _gather_fp8(self, buf, b):
        """All-gather the bucket's bf16(master) shards, then requantize each FP8 param from its
        gathered bf16 values (every rank, own shard included)."""
        r = dist.get_rank(buf.group) if buf.dp > 1 else 0
        shard = b.numel // buf.dp
        s0 = b.start + r * shard
        send = torch.zeros(shard, dtype=torch.bfloat16, device=buf.grad_data.device)
        for pc in self.pieces:
            if pc.buf is buf and b.start <= pc.lo < b.end:
                send[pc.lo - s0:pc.hi - s0].copy_(pc.master)
        full = send
        if buf.dp > 1:
            full = empty(b.numel, dtype=torch.bfloat16, device=send.device)
            all_gather_into(full, send, buf.group)
        if Fault.DISTOPT_FP8_NOT_REQUANTIZED in self.faults:
            return  # the gathered values never reach the FP8 bytes
        for p in b.params:
            ps, pe, _ = buf.layout.index[p]
            write_fp8(p.qt, full[ps - b.start:pe - b.start].view(p.shape), self.faults)
            p.qt.post_all_gather_processing()

    def master_pairs(self):
        """(name, param values, master) of every shard piece whose param is not FP8: once the
        params are synced the values are the master rounded to the param dtype (FP8 pieces are
        requantized from the whole gathered param, not from a piece)."""
        for pc in self.pieces:
            if not is_quantized_param(pc.param):
                yield pc.name, pc.buf.param_data[pc.lo:pc.hi], pc.master

    def state_tensors(self) -> dict:
        out = {}
        for pc in self.pieces:
            out[f"{pc.name}.master"] = pc.master
            st = self.optimizer.state.get(pc.master, {}) if self.optimizer else {}
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"{pc.name}.{k}"] = v
        return out
