"""Model configuration."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from parity.vocab import Recipe

RECIPES = tuple(Recipe)


@dataclass(frozen=True)
class InitEdges:
    """Edits of the init that put FP8 at its numeric edges within the first steps.

    Applied deterministically to the high-precision init (parity/model/edges.py), before the ON
    side persists its FP8 weights and before any master exists, so both sides start from the same
    bits. Blocks are the weight blocks of the recipe: 128x128 tiles (blockwise), 1x32 / 32x1
    (mxfp8).
    """

    zero_blocks: bool = False
    """Blocks exactly zero in both orientations: a stripe of dead units in every SwiGLU (128 units,
    whole 128x128 tiles, when it has 256 or more; its fc1 gate and up rows and its fc2 columns,
    which get zero grads and stay zero) and the first 128x128 tile of every attn.proj (filled by
    the first update)."""
    pow2_edge: bool = False
    """Every block of every FP8 matrix (but the zero and tiny ones) scaled so its amax sits at a
    pow2 scale boundary ``448 * 2^k``: one bf16 ULP below it, on it (the largest amax of the larger
    scale) or one ULP above it (the smallest amax of the smaller scale), cycled over the blocks;
    the first update flips scales."""
    tiny_values: bool = False
    """The last block of every attn.qkv holds values near the bottom of fp32/bf16, by layer: amax
    ``448 * 2^-127`` (scale at the 2^127 cap, scale_inv subnormal), ``2^-123`` (scale from the
    Vinf clamp), all bf16 subnormals (amax ``2^-127``), and so on; the dead expert's last fc2 block
    is all subnormal. Every one gets E8M0 0 under mxfp8."""
    dead_expert: bool = False
    """The last expert of every MoE layer is never routed (a -inf selection bias, Megatron's expert
    bias frozen) and its fc1 is zero-initialised: zero grads, all-zero blocks every step, and its
    fc2 only decays (so the tiny and edge blocks in it persist)."""

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    @classmethod
    def from_names(cls, names) -> "InitEdges":
        """From a list of option names; ValueError naming the allowed ones for anything else."""
        bad = [n for n in names if n not in cls.names()]
        if bad:
            raise ValueError(f"unknown stress option(s) {bad}; allowed: {', '.join(cls.names())}")
        return cls(**{n: True for n in names})

    def enabled(self) -> tuple[str, ...]:
        return tuple(n for n in self.names() if getattr(self, n))


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
    tie_embeddings: bool = False
    """The output layer reads the embedding matrix (upstream's default unless
    ``--untie-embeddings-and-output-weights``): one Adam param used twice, whose grad sums both
    uses before its grad-ready hook fires. Excludes ``fp8_head``."""
    edges: InitEdges = field(default_factory=InitEdges)
    """Numeric-edge edits of the init (the scenario key ``stress``)."""

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
        need(not (self.tie_embeddings and self.fp8_head),
             "tie_embeddings and fp8_head exclude each other (a tied output layer reads the bf16 embedding)")
        need(isinstance(self.edges, InitEdges), f"edges must be an InitEdges, got {self.edges!r}")
        if self.edges.dead_expert:
            need(self.moe, "stress option 'dead_expert' needs moe = true")
            need(self.num_experts > self.moe_topk,
                 f"stress option 'dead_expert' needs num_experts ({self.num_experts}) > "
                 f"moe_topk ({self.moe_topk}): the router must still find moe_topk live experts")

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
