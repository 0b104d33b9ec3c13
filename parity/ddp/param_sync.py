"""Whole-param LayerWise gather: staging, copy-back, and the deferred (overlapped) bucket path.

Shared by the optimizer's eager ``allgather_params`` and the forward-pre-hook path, so the two
cannot disagree on what is staged or how the payload is read back (docs/spec/megatron.md s2.9-2.12).
"""

from __future__ import annotations

import torch

from parity.distributed.collectives import all_gather_uneven_into
from parity.distributed.determinism import empty
from parity.model import is_quantized_param
from parity.vocab import Fault, FaultSet


def write_fp8(qt, src, faults=FaultSet()) -> None:
    """Requantize a persisted FP8 param from high-precision ``src``: bytes and scale_inv grids
    together, a tiny block's subnormal scale_inv kept (docs/spec/te.md s1.2). The one write of
    every path that lands values in FP8 params: the master copy at DP 1, the LayerWise gather's
    copy-back, the DistOpt copy-back."""
    stale, ftz, mx_col = Fault.STALE_SCALE_INV, Fault.FTZ_SUBNORMAL_SCALE_INV, Fault.MXFP8_COLUMNWISE_FROM_ROWWISE
    fresh = qt.clone().requantize_(src) if faults.injected(stale) else None
    if fresh is not None and _scales_differ(qt, fresh) and stale in faults:
        _copy_bytes_only(qt, fresh)
    else:
        qt.requantize_(src)
    if qt.recipe == "mxfp8" and qt.columnwise_data is not None and faults.injected(mx_col) \
            and not torch.equal(qt.columnwise_data, qt.rowwise_data) and mx_col in faults:
        qt.columnwise_data.copy_(qt.rowwise_data)  # the same [M, K] layout, other blocks (docs/spec/te.md s2.4)
    if qt.recipe == "blockwise" and faults.injected(ftz):
        tiny = _subnormal(qt.rowwise_scale_inv)
        if tiny.any() and ftz in faults:
            qt.rowwise_scale_inv.masked_fill_(tiny, 0.0)  # as a flush-to-zero (fast-math) kernel does


def master_to_bf16(master: torch.Tensor, faults=FaultSet()) -> torch.Tensor:
    """bf16(master), rounded to nearest even: the one rounding of an fp32 LayerWise master that
    every bf16 param and every bf16 staging of the gather holds (docs/spec/megatron.md s2.8)."""
    if Fault.LAYERWISE_BF16_TRUNCATES in faults:
        master = (master.view(torch.int32) & -(1 << 16)).view(torch.float32)  # toward zero: low bits dropped
    return master.to(torch.bfloat16)


def _subnormal(t: torch.Tensor) -> torch.Tensor:
    """Where fp32 ``t`` holds a subnormal (docs/spec/te.md s1.7: what a flush-to-zero kernel
    zeroes; the stack's own path keeps them)."""
    return (t != 0) & (t.abs() < torch.finfo(torch.float32).tiny)


def _scales_differ(qt, fresh) -> bool:
    """Whether ``fresh`` (a requantization of ``qt``) has another scale_inv grid than ``qt`` holds."""
    grids = [(getattr(qt, k), getattr(fresh, k)) for k in ("rowwise_scale_inv", "columnwise_scale_inv")]
    return any(a is not None and not torch.equal(_bits(a), _bits(b)) for a, b in grids)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t  # E8M0 scales are bytes already


def _copy_bytes_only(qt, fresh) -> None:
    """A write that forgets the scales (a fault): ``fresh``'s FP8 bytes, the old scale_inv grid kept."""
    qt.rowwise_data.copy_(fresh.rowwise_data)
    if qt.recipe == "mxfp8":  # its columnwise bytes are quantized, not transposed (docs/spec/te.md s2.4)
        qt.columnwise_data.copy_(fresh.columnwise_data)


def transport_dtype(fp8_staged: bool, params) -> torch.dtype:
    if fp8_staged:
        return torch.bfloat16
    return params[0].dtype


def is_fp8_staged(params, faults=frozenset()) -> bool:
    """Stage a bucket through bf16-from-master iff ANY of its params is FP8 (a bucket can hold
    FP8 matrices next to bf16 ones, e.g. the router)."""
    if not params:
        return False
    staged = any(is_quantized_param(p) for p in params)
    if staged != is_quantized_param(params[0]) and Fault.MIXED_BUCKET_HEAD in faults:
        return is_quantized_param(params[0])  # decided by the head alone
    return staged


def stage(params, out: torch.Tensor, fp8_staged: bool, faults=frozenset()) -> None:
    """Write my owned params, in list order, into the flat send slot ``out``."""
    off = 0
    for p in params:
        n = p.numel()
        if fp8_staged:
            master = getattr(p, "main_param", None)
            if master is None and p.dtype == torch.float32 and not is_quantized_param(p):
                master = p.data  # a native fp32 param is its own master (bf16 transport drops bits)
            if master is None or master.numel() != n:
                raise RuntimeError("fp8-staged gather needs every owned param's fp32 master")
            src = master_to_bf16(master, faults)
        else:
            if is_quantized_param(p):
                raise RuntimeError("cannot flatten an FP8 parameter on the raw (non-staged) path")
            src = p.data
        out[off:off + n].copy_(src.reshape(-1))
        off += n


def copy_back(params, flat: torch.Tensor, fp8_staged: bool, owned: bool, faults=FaultSet()) -> list:
    """Read one rank's slot back into its params. fp8-staged: every slot (own included) is
    requantized, so every rank holds Q(bf16(master)); raw: only non-owned params are written
    (owned ones already hold bf16(master)). Returns the FP8 params written."""
    written, off = [], 0
    for p in params:
        n = p.numel()
        src = flat[off:off + n].view(p.shape)
        off += n
        if fp8_staged:
            if is_quantized_param(p):
                write_fp8(p.qt, src, faults)
                written.append(p)
            else:
                p.data.copy_(src)
        elif not owned:
            p.data.copy_(src)
    return written


def gather_lists(lists: list[list], group, my_rank: int, out_flat: torch.Tensor | None,
                 fp8_staged: bool, dtype: torch.dtype, device, faults=frozenset(), async_op: bool = False):
    """Uneven all-gather of per-rank owned params: (flat receive buffer, sizes, handle). The
    handle is None unless ``async_op``; then the slots hold the payload only after its wait."""
    sizes = [sum(p.numel() for p in lst) for lst in lists]
    if sum(sizes) == 0:
        return None, sizes, None
    if out_flat is None:
        out_flat = empty(sum(sizes), dtype=dtype, device=device)
    if out_flat.numel() < sum(sizes):
        raise AssertionError(f"gather receive buffer holds {out_flat.numel()} elements, needs {sum(sizes)}")
    start = sum(sizes[:my_rank])
    mine = out_flat[start:start + sizes[my_rank]]
    stage(lists[my_rank], mine, fp8_staged, faults)
    handle = all_gather_uneven_into(out_flat[:sum(sizes)], mine, sizes, group, async_op=async_op)
    return out_flat, sizes, (handle if async_op else None)


def copy_back_all(lists, flat, sizes, fp8_staged: bool, my_rank: int, faults=FaultSet()) -> None:
    written, off = [], 0
    for r, lst in enumerate(lists):
        if (my_rank, r) == (1, 0) and Fault.RANK1_SKIPS_RANK0_SLOT in faults:
            lst = []  # rank 0's params stay stale on rank 1
        written += copy_back(lst, flat[off:off + sizes[r]], fp8_staged, owned=(r == my_rank), faults=faults)
        off += sizes[r]
    for p in written:
        p.qt.post_all_gather_processing()
