"""The DDP wrapper's settings (no torch: scenario files are checked before torch is imported)."""

from __future__ import annotations

from dataclasses import dataclass

LAYOUTS = ("compact", "padded")


@dataclass(frozen=True)
class DDPConfig:
    """Data-parallel wrapper settings."""

    bucket_size: int | None = None
    """Elements per bucket (None: one bucket per buffer); used only with overlap_grad_reduce
    (see :attr:`layout_bucket_size`)."""
    overlap_grad_reduce: bool = False
    """Launch each bucket group's reduction as soon as all its grads are ready."""
    overlap_param_gather: bool = False
    """Defer every bucket group's param gather to the next forward's pre-hooks (needs
    overlap_grad_reduce)."""
    layout: str = "compact"
    """LayerWise buffers: 'compact' (decoupled, no padding) or 'padded' (shard-aligned DistOpt)."""
    merge_layerwise_fp8_grads: bool = True
    """Key FP8 LayerWise grads by their bf16 logical dtype (one all-reduce buffer, as OFF)."""

    @property
    def layout_bucket_size(self) -> int | None:
        """The bucket size the buffers are laid out with: ``bucket_size`` under
        overlap_grad_reduce, else None (one bucket per buffer), as upstream's DDP sets it: without
        overlap nothing is gained from smaller collectives (docs/spec/megatron.md s2.5)."""
        return self.bucket_size if self.overlap_grad_reduce else None

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"ddp.layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.bucket_size is not None and self.bucket_size <= 0:
            raise ValueError(f"ddp.bucket_size must be positive or None, got {self.bucket_size}")
        if self.overlap_param_gather and not self.overlap_grad_reduce:
            raise ValueError("overlap_param_gather requires overlap_grad_reduce")
