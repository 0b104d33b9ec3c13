"""Model configuration."""

from __future__ import annotations

from dataclasses import dataclass

from parity.vocab import Recipe

RECIPES = tuple(Recipe)


@dataclass(frozen=True)
class ModelConfig:
    """A small GPT/MoE whose parameter set covers every path of the FP8 param-gather stack."""

    vocab_size: int = 128
    """Vocabulary size; also the output head's rows (a sibling param, Adam)."""
    hidden: int = 128
    """Model width. Multiples of 128 exercise whole 128x128 blocks; 192 gives partial ones."""
    ffn_hidden: int = 256
    """SwiGLU inner width of the dense MLP."""
    num_heads: int = 4
    """Attention heads (one query group per head, so split-QKV pieces are [d, d, d])."""
    num_layers: int = 2
    """Transformer layers."""
    seq_len: int = 64
    """Tokens per sequence; also the rows of the fp32 `ape` matrix."""
    micro_batch: int = 2
    """Sequences per rank per step."""
    moe: bool = False
    """Replace the dense MLP of every odd layer (and of layer 0 when num_layers == 1) by an MoE."""
    num_experts: int = 8
    """Experts per MoE layer (split over the expert-parallel group)."""
    moe_topk: int = 2
    """Experts per token."""
    moe_ffn_hidden: int = 128
    """SwiGLU inner width of each expert."""
    init_std: float = 0.02
    """Std of the normal init of matrices."""
    adam_matrix: bool = False
    """Add a 2-D matrix excluded from Muon (``use_muon = False``, like Mamba's in_proj), trained by
    Adam: the case where buffer routing and optimizer routing could disagree."""
    fp8_head: bool = False
    """Make the output projection an FP8 linear. It stays an Adam (DistOpt) param, so with fp8 param
    gather ON it is an FP8 param in a ``uint8`` DistOpt buffer next to the LayerWise buckets
    (docs/spec/megatron.md s5 item 20); OFF quantizes its bf16 weight on the fly."""

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ValueError(f"model: {msg}")

        for name in ("vocab_size", "hidden", "ffn_hidden", "num_heads", "num_layers", "seq_len",
                     "micro_batch", "num_experts", "moe_topk", "moe_ffn_hidden"):
            need(isinstance(getattr(self, name), int) and getattr(self, name) > 0,
                 f"{name} must be a positive integer, got {getattr(self, name)!r}")
        need(self.hidden % self.num_heads == 0,
             f"hidden ({self.hidden}) must be divisible by num_heads ({self.num_heads})")
        need(self.moe_topk <= self.num_experts,
             f"moe_topk ({self.moe_topk}) must be <= num_experts ({self.num_experts})")
        need(self.init_std > 0, "init_std must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads

    def is_moe_layer(self, i: int) -> bool:
        return self.moe and (i % 2 == 1 or self.num_layers == 1)

    def matrix_dims(self) -> list[int]:
        """Every dimension of an FP8 matrix (the recipe's divisibility rules apply to these)."""
        dims = [self.hidden, 3 * self.hidden, 2 * self.ffn_hidden, self.ffn_hidden]
        if self.moe:
            dims += [2 * self.moe_ffn_hidden, self.moe_ffn_hidden]
        if self.fp8_head:
            dims.append(self.vocab_size)
        return dims
