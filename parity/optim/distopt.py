"""DistributedOptimizer: byte-range shards of DistOpt buffers, fp32 master shards, Adam on
shards, all-gather of the param buffer (the sibling params' path, docs/spec/megatron.md s1.2)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from parity.optim.adam import Adam


class ShardPiece:
    """The part of one param that lies in this rank's shard of its bucket."""

    def __init__(self, param, name, buf, lo, hi):
        self.param, self.name, self.buf, self.lo, self.hi = param, name, buf, lo, hi
        self.master = buf.param_data[lo:hi].to(torch.float32, copy=True)
        self.grad = buf.grad_data[lo:hi]


class DistributedOptimizer:
    def __init__(self, buffers, names: dict, adam_kwargs: dict, make_optimizer=None):
        self.buffers = [b for b in buffers if b.config.use_distributed_optimizer and not b.key.is_layer_wise]
        self.pieces: list[ShardPiece] = []
        for buf in self.buffers:
            r = dist.get_rank(buf.group) if buf.dp > 1 else 0
            for b in buf.buckets:
                shard = b.numel // buf.dp
                s0, s1 = b.start + r * shard, b.start + (r + 1) * shard
                for p in b.params:
                    ps, pe, _ = buf.layout.index[p]
                    lo, hi = max(ps, s0), min(pe, s1)
                    if lo < hi:
                        piece = ShardPiece(p, f"{names[p]}[{lo - ps}:{hi - ps}]", buf, lo, hi)
                        self.pieces.append(piece)
        masters = [pc.master for pc in self.pieces]
        self.optimizer = (make_optimizer or (lambda ms: Adam(ms, **adam_kwargs)))(masters) if masters else None

    def step(self):
        for pc in self.pieces:
            pc.master.grad = pc.grad
        if self.optimizer is not None:
            self.optimizer.step()
        for pc in self.pieces:
            pc.buf.param_data[pc.lo:pc.hi].copy_(pc.master)
            pc.master.grad = None

    def gather(self):
        for buf in self.buffers:
            buf.gather_param_data()

    def state_tensors(self) -> dict:
        out = {}
        for pc in self.pieces:
            out[f"{pc.name}.master"] = pc.master
            st = self.optimizer.state.get(pc.master, {}) if self.optimizer else {}
            for k, v in st.items():
                if torch.is_tensor(v):
                    out[f"{pc.name}.{k}"] = v
        return out
