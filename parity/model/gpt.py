"""A small GPT whose parameters cover every routing case of the Muon FP8 param-gather stack.

| parameter | kind | optimizer | storage with fp8 param gather ON |
|---|---|---|---|
| embed.weight, head.weight | embedding / output | Adam (DistOpt) | bf16 (head: FP8 with fp8_head) |
| *.norm*.weight | 1-D | Adam (DistOpt) | bf16 |
| ape | 2-D, kept in fp32 | Muon (native fp32 gather) | fp32 |
| attn.qkv / attn.proj / mlp.fc1 / mlp.fc2 | 2-D | Muon | FP8 |
| mlp.router.weight | 2-D | Muon | bf16 (never quantized) |
| mlp.experts.E.fc1/fc2 | 2-D, expert-parallel | Muon (expert-DP) | FP8 |
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn

from parity.model import matmul
from parity.model.config import ModelConfig
from parity.model.edges import edit_init
from parity.model.fp8_linear import FP8Linear
from parity.model.moe import MoE, SwiGLU
from parity.vocab import Fault


def init_value(seed: int, name: str, shape, std: float) -> torch.Tensor:
    """fp32 init drawn on the CPU from a generator keyed by the parameter's name, so every rank,
    device and EP layout draws the same value for the same parameter."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(*shape, generator=g) * std


class RMSNorm(nn.Module):
    def __init__(self, dim: int, device):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.bfloat16, device=device))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight.float()).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, qkv: FP8Linear, proj: FP8Linear):
        super().__init__()
        self.cfg, self.qkv, self.proj = cfg, qkv, proj
        # Megatron's fused-QKV row layout: per query group [q, k, v] rows; Muon splits on it.
        d = cfg.head_dim
        qkv.weight.qkv_split_shapes = [d, d, d]

    def forward(self, x):
        B, S, H = x.shape
        nh, d = self.cfg.num_heads, self.cfg.head_dim
        q, k, v = self.qkv(x).reshape(B, S, nh, 3, d).float().unbind(dim=3)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        mask = torch.ones(S, S, dtype=torch.bool, device=x.device).triu(1)
        p = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        out = (p @ v).transpose(1, 2).reshape(B, S, H).to(x.dtype)
        return self.proj(out)


class Block(nn.Module):
    def __init__(self, attn_norm, attn, mlp_norm, mlp):
        super().__init__()
        self.attn_norm, self.attn, self.mlp_norm, self.mlp = attn_norm, attn, mlp_norm, mlp

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, *, recipe: str, fp8_param: bool, seed: int,
                 device="cpu", ep_size: int = 1, ep_rank: int = 0, ep_group=None, faults=frozenset()):
        super().__init__()
        self.faults = faults
        if cfg.moe and cfg.num_experts % ep_size:
            raise ValueError(f"num_experts ({cfg.num_experts}) must be divisible by ep ({ep_size})")
        H, std = cfg.hidden, cfg.init_std

        edges = cfg.edges
        dead_expert = cfg.num_experts - 1 if edges.dead_expert else None

        def lin(name, out_f, in_f, layer=0, dead=False, expert=False):
            init = init_value(seed, name, (out_f, in_f), std)
            if edges.enabled():  # before ON persists FP8 bytes and before any master exists
                init = edit_init(init, name, edges, recipe, seed, layer=layer, dead=dead)
            fp8 = fp8_param
            if expert and Fault.EXPERT_FP8_PARAMS_NOT_BUILT in faults:
                fp8 = False  # the knob reaches the dense layers only
            return FP8Linear(in_f, out_f, recipe, init.to(device), fp8)

        self.embed = nn.Embedding(cfg.vocab_size, H)
        self.embed.weight = nn.Parameter(
            init_value(seed, "embed.weight", (cfg.vocab_size, H), std).to(device, torch.bfloat16))
        # A native-fp32 2-D parameter (kept in fp32, like DeepSeek-V4's CSA `ape`): its dtype is
        # what the optimizer reads (parity.optim.mixed_precision.is_native_fp32).
        self.ape = nn.Parameter(init_value(seed, "ape", (cfg.seq_len, H), std).to(device))
        layers = []
        for i in range(cfg.num_layers):
            p = f"layers.{i}"
            attn = Attention(cfg, lin(f"{p}.attn.qkv.weight", 3 * H, H, i), lin(f"{p}.attn.proj.weight", H, H, i))
            if cfg.is_moe_layer(i):
                per = cfg.num_experts // ep_size
                F_ = cfg.moe_ffn_hidden
                experts = {
                    e: SwiGLU(lin(f"{p}.mlp.experts.{e}.fc1.weight", 2 * F_, H, i, e == dead_expert, expert=True),
                              lin(f"{p}.mlp.experts.{e}.fc2.weight", H, F_, i, e == dead_expert, expert=True))
                    for e in range(ep_rank * per, (ep_rank + 1) * per)
                }
                router = init_value(seed, f"{p}.mlp.router.weight", (cfg.num_experts, H), std).to(device)
                mlp = MoE(router, experts, cfg.num_experts, cfg.moe_topk, ep_size, ep_rank, ep_group,
                          dead_experts=() if dead_expert is None else (dead_expert,), faults=faults)
                for e in experts.values():
                    for w in (e.fc1.weight, e.fc2.weight):
                        w.allreduce = False  # expert-parallel: reduced over expert-DP only
            else:
                mlp = SwiGLU(lin(f"{p}.mlp.fc1.weight", 2 * cfg.ffn_hidden, H, i),
                             lin(f"{p}.mlp.fc2.weight", H, cfg.ffn_hidden, i))
            layers.append(Block(RMSNorm(H, device), attn, RMSNorm(H, device), mlp))
        self.layers = nn.ModuleList(layers)
        self.final_norm = RMSNorm(H, device)
        self.head = None  # tied: the output layer reads embed.weight
        if cfg.fp8_head:  # an FP8 matrix Adam steps: the DistOpt sibling holds FP8 params
            self.head = lin("head.weight", cfg.vocab_size, H)
        elif not cfg.tie_embeddings:
            self.head = matmul.Linear(H, cfg.vocab_size, bias=False)
            self.head.weight = nn.Parameter(
                init_value(seed, "head.weight", (cfg.vocab_size, H), std).to(device, torch.bfloat16))
        self.embed.weight.is_embedding_or_output = True
        if self.head is not None:
            self.head.weight.is_embedding_or_output = True
        self.mix = None
        if cfg.adam_matrix:
            self.mix = nn.Parameter(init_value(seed, "mix", (H, H), std).to(device, torch.bfloat16))
            self.mix.use_muon = False

    def forward(self, tokens, labels):
        S = tokens.shape[1]
        x = (self.embed(tokens).float() + self.ape[:S]).to(torch.bfloat16)
        if self.mix is not None:
            x = x + matmul.linear(x, self.mix)
        for layer in self.layers:
            x = layer(x)
        norm = self.final_norm.forward if Fault.FINAL_NORM_PAST_HOOKS in self.faults else self.final_norm
        h = norm(x)
        logits = matmul.linear(h, self.embed.weight) if self.head is None else self.head(h)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss, logits


def is_layer_wise_managed(param, *, honor_use_muon: bool = True) -> bool:
    """Muon / LayerWise routing predicate: 2-D, not an embedding or output matrix, and not
    excluded with ``use_muon = False``. Buffer routing and optimizer routing must both use it."""
    if param.dim() != 2 or getattr(param, "is_embedding_or_output", False):
        return False
    return not honor_use_muon or getattr(param, "use_muon", True)


def is_expert_param(param) -> bool:
    return not getattr(param, "allreduce", True)


def is_weight_decayed(param, name: str) -> bool:
    """Whether weight decay applies: not to biases nor to 1-D params (the norms' weights), as
    upstream's default param groups give those a weight-decay multiplier of 0
    (docs/spec/megatron.md s2.17)."""
    return not (name.endswith(".bias") or param.dim() == 1)
