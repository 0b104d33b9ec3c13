"""fp32 masters and the master -> model copy (docs/spec/megatron.md s2.7-2.8)."""

from __future__ import annotations

import torch

from parity.ddp.param_sync import master_to_bf16, write_fp8
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
        src = master if Fault.FP32_MASTER_DIRECT_TO_FP8 in faults else master_to_bf16(master, faults)
        write_fp8(p.qt, src, faults)
        p.qt.post_all_gather_processing()
    else:
        p.data.copy_(master_to_bf16(master, faults))
