"""fp32 masters and the master -> model copy (docs/spec/megatron.md s2.7-2.8)."""

from __future__ import annotations

import torch

from parity.model import is_quantized_param
from parity.vocab import Fault, FaultSet


def is_native_fp32(p) -> bool:
    """fp32 params (kept in fp32, like `ape`) are their own master and travel in fp32."""
    return not is_quantized_param(p) and p.dtype == torch.float32


def make_master(p, device, faults=frozenset()) -> torch.Tensor:
    """fp32 master of a bf16 or FP8 param. An FP8 param's master comes from its preserved
    high-precision init, not from the lossy dequantization of its FP8 bytes: then ON's master
    equals OFF's (clone of the same bf16 init) before any update."""
    if is_quantized_param(p):
        hp = p.get_high_precision_init_val()
        if hp is None or Fault.MASTER_FROM_FP8_DEQUANT in faults:
            master = p.qt.dequantize(torch.float32).clone()
        else:
            master = hp.to(device=device, dtype=torch.float32, copy=True)
        p.clear_high_precision_init_val()
    else:
        master = p.detach().to(torch.float32, copy=True)
    # Muon reads the fused QKV layout from the tensor it steps, which is this master, not p.
    split = getattr(p, "qkv_split_shapes", None)
    master.qkv_split_shapes = None if split is not None and Fault.MASTER_LOSES_QKV_SPLIT in faults else split
    return master


def copy_master_to_param(p, master, faults=FaultSet()) -> None:
    """bf16 params get bf16(master) (round to nearest even); FP8 params get Q(bf16(master)),
    exactly what OFF's forward quantizes from its bf16 weight, subnormal scale_inv included
    (a tiny block's 2^-127, docs/spec/te.md s1.2)."""
    if is_quantized_param(p):
        src = master if Fault.FP32_MASTER_DIRECT_TO_FP8 in faults else master.to(torch.bfloat16)
        stale, ftz = Fault.STALE_SCALE_INV, Fault.FTZ_SUBNORMAL_SCALE_INV
        if faults.injected(stale) and _scales_move(p.qt, src) and stale in faults:
            _write_bytes_only(p.qt, src)
        else:
            p.qt.requantize_(src)
        s = p.qt.rowwise_scale_inv
        if p.qt.recipe == "blockwise" and faults.injected(ftz) and _subnormal(s).any() and ftz in faults:
            s.masked_fill_(_subnormal(s), 0.0)  # as a flush-to-zero (fast-math) kernel does
        p.qt.post_all_gather_processing()
    else:
        p.data.copy_(master)


def _subnormal(t: torch.Tensor) -> torch.Tensor:
    """Where fp32 ``t`` holds a subnormal (docs/spec/te.md s1.7: what a flush-to-zero kernel
    zeroes; the stack's own path keeps them)."""
    return (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)


def _scales_move(qt, src) -> bool:
    """Whether quantizing ``src`` gives ``qt`` another scale_inv grid than the one it holds."""
    fresh = qt.clone().requantize_(src)
    grids = [(getattr(qt, k), getattr(fresh, k)) for k in ("rowwise_scale_inv", "columnwise_scale_inv")]
    return any(a is not None and not torch.equal(_bits(a), _bits(b)) for a, b in grids)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t  # E8M0 scales are bytes already


def _write_bytes_only(qt, src) -> None:
    """A write that forgets the scales (a fault): fresh FP8 bytes, the old scale_inv grid kept."""
    fresh = qt.clone().requantize_(src)
    qt.rowwise_data.copy_(fresh.rowwise_data)
    if qt.recipe == "mxfp8":  # its columnwise bytes are quantized, not transposed (docs/spec/te.md s2.4)
        qt.columnwise_data.copy_(fresh.columnwise_data)
