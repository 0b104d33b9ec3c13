"""A stack's settings: optimizer hyper-parameters and what defines one side of a lockstep pair
(no torch: scenario files are checked before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parity.ddp.config import DDPConfig
from parity.model.config import ModelConfig
from parity.optim.schedule import DECAY_STYLES, lr_at
from parity.vocab import FaultSet


MUON_SCALE_MODES = ("spectral", "shape_scaling", "unit_rms_norm")


@dataclass(frozen=True)
class OptimConfig:
    """Optimizer hyper-parameters (Muon for matrices, Adam for the rest)."""

    lr: float = 1e-3
    """Learning rate of both optimizers (1e-3 amplifies any mismatch)."""
    weight_decay: float = 0.01
    """Decoupled weight decay."""
    muon_momentum: float = 0.9
    """Muon beta."""
    muon_nesterov: bool = False
    """Nesterov momentum for Muon."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations."""
    muon_coefficients: str = "quintic"
    """Newton-Schulz coefficient set: 'quintic' or 'simple'."""
    muon_scale_mode: str = "spectral"
    """How Muon scales the orthogonalized update by the matrix shape: 'spectral' (sqrt of the
    larger dim), 'shape_scaling' (sqrt(max(1, rows/cols))) or 'unit_rms_norm' (sqrt(rows/cols))."""
    muon_extra_scale_factor: float = 1.0
    """Extra factor on Muon's shape scale (upstream's functional test uses 0.2)."""
    muon_split_qkv: bool = True
    """Orthogonalize the fused QKV matrix per q/k/v piece."""
    adam_betas: tuple = (0.9, 0.999)
    """Adam betas."""
    adam_eps: float = 1e-8
    """Adam epsilon."""
    clip_grad: float = 0.0
    """Clip the grads to this global L2 norm (0: off; the norm and zeros are computed anyway)."""
    lr_decay_style: str = "constant"
    """'constant' (lr every step) or 'cosine' (from lr down to lr_min over lr_decay_steps)."""
    lr_warmup_steps: int = 0
    """Linear warmup from 0 to lr over this many steps (step 0 runs at lr 0 when > 0)."""
    lr_decay_steps: int | None = None
    """Steps, warmup included, after which the cosine reaches lr_min (needed for 'cosine')."""
    lr_min: float = 0.0
    """Floor of the cosine decay."""
    num_distributed_optimizer_instances: int = 1
    """DistOpt instances over the DP group; the LayerWise split allows only 1 (s5 item 15)."""

    def __post_init__(self):
        if not self.lr > 0:
            raise ValueError(f"optim.lr must be > 0, got {self.lr}")
        if not self.weight_decay >= 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not 0 <= self.muon_momentum < 1:
            raise ValueError(f"optim.muon_momentum must be in [0, 1), got {self.muon_momentum}")
        if self.muon_ns_steps < 1:
            raise ValueError(f"optim.muon_ns_steps must be >= 1, got {self.muon_ns_steps}")
        if self.muon_scale_mode not in MUON_SCALE_MODES:
            raise ValueError(f"optim.muon_scale_mode must be one of {MUON_SCALE_MODES}, got {self.muon_scale_mode!r}")
        if not self.muon_extra_scale_factor > 0:
            raise ValueError(f"optim.muon_extra_scale_factor must be > 0, got {self.muon_extra_scale_factor}")
        if len(self.adam_betas) != 2 or not all(0 <= b < 1 for b in self.adam_betas):
            raise ValueError(f"optim.adam_betas must be two numbers in [0, 1), got {list(self.adam_betas)}")
        if not self.adam_eps > 0:
            raise ValueError(f"optim.adam_eps must be > 0, got {self.adam_eps}")
        if self.muon_coefficients not in ("quintic", "simple"):
            raise ValueError(f"optim.muon_coefficients must be 'quintic' or 'simple', got {self.muon_coefficients!r}")
        if not self.clip_grad >= 0:
            raise ValueError(f"optim.clip_grad must be >= 0 (0: off), got {self.clip_grad}")
        if self.lr_decay_style not in DECAY_STYLES:
            raise ValueError(f"optim.lr_decay_style must be one of {DECAY_STYLES}, "
                             f"got {self.lr_decay_style!r}")
        if self.lr_warmup_steps < 0:
            raise ValueError(f"optim.lr_warmup_steps must be >= 0, got {self.lr_warmup_steps}")
        if not 0 <= self.lr_min <= self.lr:
            raise ValueError(f"optim.lr_min must be in [0, lr={self.lr}], got {self.lr_min}")
        if self.lr_decay_style == "cosine" and (self.lr_decay_steps is None
                                               or self.lr_decay_steps <= self.lr_warmup_steps):
            raise ValueError(f"optim.lr_decay_steps must be > lr_warmup_steps ({self.lr_warmup_steps}) "
                             f"for the cosine schedule, got {self.lr_decay_steps}")
        if self.num_distributed_optimizer_instances != 1:
            raise ValueError(
                f"optim.num_distributed_optimizer_instances={self.num_distributed_optimizer_instances}: the "
                f"LayerWise optimizer needs exactly 1 (as upstream's validation): it all-reduces Muon grads "
                f"and assigns owners over the whole DP group, while several DistOpt instances would "
                f"reduce grads within one instance only (docs/spec/megatron.md s5 item 15)")

    def lr_at(self, step: int) -> float:
        """The lr of training step ``step`` (parity.optim.schedule)."""
        return lr_at(step, lr=self.lr, lr_min=self.lr_min, warmup_steps=self.lr_warmup_steps,
                     decay_steps=self.lr_decay_steps, decay_style=self.lr_decay_style)

    def muon_kwargs(self) -> dict:
        return dict(lr=self.lr, momentum=self.muon_momentum, nesterov=self.muon_nesterov,
                    weight_decay=self.weight_decay, steps=self.muon_ns_steps,
                    coefficient_type=self.muon_coefficients, scale_mode=self.muon_scale_mode,
                    extra_scale_factor=self.muon_extra_scale_factor, fp32_matmul_prec="medium",
                    split_qkv=self.muon_split_qkv)

    def adam_kwargs(self) -> dict:
        return dict(lr=self.lr, betas=tuple(self.adam_betas), eps=self.adam_eps,
                    weight_decay=self.weight_decay)


@dataclass(frozen=True)
class StackConfig:
    """Everything that defines one side of a lockstep pair."""

    model: ModelConfig
    recipe: str
    fp8_param_gather: bool
    ddp: DDPConfig = field(default_factory=DDPConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    seed: int = 1234
    microbatches: int = 1
    """Microbatches per step (gradient accumulation): forward and backward each, grads
    accumulate in main_grad, the reduce runs after the last."""
    force_sync_each_step: bool = False
    """Under overlap: leave the next gather pending after the step and finish it with force_sync
    (instead of the forward pre-hook)."""
    faults: frozenset = frozenset()
    """Catalogued faults this stack runs with (parity.harness.faults), held as a FaultSet, which
    records the ones whose deviation runs."""

    def __post_init__(self):
        object.__setattr__(self, "faults", FaultSet(self.faults))
        validate_stack(self)


def validate_stack(c: StackConfig) -> None:
    if not isinstance(c.microbatches, int) or c.microbatches < 1:
        raise ValueError(f"microbatches must be an integer >= 1, got {c.microbatches!r}")
    if c.recipe not in ("blockwise", "mxfp8"):
        if c.recipe in ("nvfp4", "fp4"):
            raise ValueError("fp4 param gather is not supported on the LayerWise path (rejected outright)")
        raise ValueError(f"recipe must be 'blockwise' or 'mxfp8', got {c.recipe!r}")
    if c.fp8_param_gather and c.ddp.layout != "compact":
        raise ValueError("fp8 param gather is supported only on the compact (decoupled) layout, "
                         "not on the padded LayerWise layout")
    if c.recipe == "mxfp8":
        bad = [d for d in c.model.matrix_dims() if d % 32]
        if bad:
            raise ValueError(f"mxfp8 needs every matrix dimension divisible by 32; got {bad}")
