"""Whole-param LayerWise gather: staging, copy-back, and the deferred (overlapped) bucket path.

Shared by the optimizer's eager ``allgather_params`` and the forward-pre-hook path, so the two
cannot disagree on what is staged or how the payload is read back (docs/spec/megatron.md s2.9-2.12).
"""

from __future__ import annotations

import torch

from parity.distributed.collectives import all_gather_uneven_into
from parity.distributed.determinism import empty
from parity.model import is_quantized_param
from parity.vocab import Fault


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
            src = master
        else:
            if is_quantized_param(p):
                raise RuntimeError("cannot flatten an FP8 parameter on the raw (non-staged) path")
            src = p.data
        out[off:off + n].copy_(src.reshape(-1))
        off += n


def copy_back(params, flat: torch.Tensor, fp8_staged: bool, owned: bool) -> list:
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
                p.qt.requantize_(src)
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


def copy_back_all(lists, flat, sizes, fp8_staged: bool, my_rank: int, faults=frozenset()) -> None:
    written, off = [], 0
    for r, lst in enumerate(lists):
        if (my_rank, r) == (1, 0) and Fault.RANK1_SKIPS_RANK0_SLOT in faults:
            lst = []  # rank 0's params stay stale on rank 1
        written += copy_back(lst, flat[off:off + sizes[r]], fp8_staged, owned=(r == my_rank))
        off += sizes[r]
    for p in written:
        p.qt.post_all_gather_processing()
