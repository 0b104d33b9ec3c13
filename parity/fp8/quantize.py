"""Blockwise (1x128 / 128x128) and MXFP8 (1x32) quantizers, bit-exact to TE's kernels.

Spec: docs/spec/te.md sections 1 (blockwise) and 2 (MXFP8). The public entry point is
:func:`quantize`; the ``_*_parts`` helpers produce the storage tensors (already in TE's GEMM-ready
layout) and are shared with :meth:`QuantizedTensor.requantize_`.

Storage layout (M = prod(shape[:-1]), K = shape[-1], Mb = ceil(M/128), Kb = ceil(K/128)):

=====================  =========================  ==========================  ===========================
tensor                 blockwise 1x128            blockwise 128x128           mxfp8 (1x32 / 32x1)
=====================  =========================  ==========================  ===========================
rowwise_data           [M, K] uint8               [M, K]                      [M, K]
rowwise_scale_inv      fp32 [Kb, pad4(M)]  [kb,m] fp32 [Mb, pad4(Kb)] [mb,kb] E8M0 [pad128(M), pad4(K/32)]
columnwise_data        [K, M] (x^T)               [K, M] (x^T)                [M, K] (not transposed)
columnwise_scale_inv   fp32 [Mb, pad4(K)]  [mb,k] fp32 [Kb, pad4(Mb)] [kb,mb] E8M0 [pad4(M/32), pad128(K)]
=====================  =========================  ==========================  ===========================

(data tensors keep the logical N-D shape; columnwise blockwise data is ``(d_last, d0, d1, ...)``).
Scale-grid padding is written as zeros (TE leaves it uninitialised).
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn.functional as F

from parity.vocab import Recipe

from .formats import (
    FP8_MAX,
    FP8_MAX_BYTE,
    FP8_NAN_BYTE,
    FP8_RCP_MAX,
    FP8_TORCH_DTYPE,
    canonical_fp8_dtype,
    e8m0_from_fp32,
    e8m0_quant_scale,
    input_dtype_max,
)
from .tensor import QuantizedTensor

__all__ = [
    "RECIPES",
    "BLOCKWISE_BLOCKS",
    "quantize",
    "canonical_recipe",
    "blockwise_scale_from_amax",
    "mxfp8_e8m0_from_amax",
    "nan_ignoring_abs",
]

BLOCK_LEN = 128
MX_BLOCK_LEN = 32
RECIPES = tuple(Recipe)
BLOCKWISE_BLOCKS = ("1x128", "128x128")
_HP_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SIGN_EXP_MASK = -8388608  # 0xFF800000 as int32: keep sign + exponent, clear 23 mantissa bits

#: CUDA inputs go to the Triton kernels of parity/fp8/triton_quantize.py (byte-identical, one pass)
#: whenever triton imports; this torch code is the fallback and the reference. Set
#: PARITY_TRITON_QUANTIZE=0 before import (or assign False at run time) to force the torch path.
USE_TRITON = os.environ.get("PARITY_TRITON_QUANTIZE", "1").strip() != "0"

_BLOCK_ALIASES = {
    "1x128": "1x128", "1": "1x128", "1d": "1x128", "128x1": "1x128",
    "128x128": "128x128", "2": "128x128", "2d": "128x128",
    "1x32": "1x32", "32": "1x32",
}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _pad_to(n: int, m: int) -> int:
    return _ceil_div(n, m) * m


def canonical_recipe(recipe: str, block=None) -> tuple[str, str]:
    """Validate (recipe, block) and fill the default block: blockwise -> "128x128", mxfp8 -> "1x32"."""
    if not isinstance(recipe, str) or recipe.lower() not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; expected one of {RECIPES}")
    recipe = recipe.lower()
    if block is not None:
        key = str(block).strip().lower()
        if key not in _BLOCK_ALIASES:
            raise ValueError(f"unknown block {block!r} for recipe {recipe!r}")
        block = _BLOCK_ALIASES[key]
    if recipe == "blockwise":
        block = block or "128x128"
        if block not in BLOCKWISE_BLOCKS:
            raise ValueError(f"blockwise recipe supports blocks {BLOCKWISE_BLOCKS}, got {block!r}")
    else:
        block = block or "1x32"
        if block != "1x32":
            raise ValueError(f"mxfp8 recipe supports block '1x32' (32x1 columnwise) only, got {block!r}")
    return recipe, block


# ------------------------------------------------------------------------------------------------
# scale math (docs/spec/te.md 1.2 and 2.2)
# ------------------------------------------------------------------------------------------------

def nan_ignoring_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN replaced by 0, so that a max over it behaves like CUDA's fmaxf (NaN ignored)."""
    a = x.abs()
    return a.masked_fill_(torch.isnan(a), 0.0)


@functools.lru_cache(maxsize=64)
def _as_fp32(x: float) -> float:
    """x rounded to the nearest fp32 value (as torch rounds it)."""
    return float(torch.tensor(x, dtype=torch.float32))


@functools.lru_cache(maxsize=64)
def _fp32_const(x: float, device: torch.device) -> torch.Tensor:
    """A 0-dim fp32 tensor holding x, made once per device (the scale math below is a dozen ops
    on a few block amaxes, so a fresh full_like / scalar tensor per op is a measurable share)."""
    return torch.tensor(x, dtype=torch.float32, device=device)


def blockwise_scale_from_amax(amax: torch.Tensor, fp8_dtype, input_dtype: torch.dtype, *,
                              pow2_scales: bool = True, eps: float = 0.0):
    """(scale, scale_inv) fp32 tensors from NaN-free fp32 block amaxes, exactly as TE (docs/spec/te.md 1.2).

    1. a < eps -> a = eps;  2. a in {0, +inf, NaN} -> scale 1;  3. s = RN32(fp8max / a) (IEEE div);
    4. s == inf -> s = Vinf (max of the *input* dtype);  5. pow2: clear the mantissa bits;
    scale_inv = RN32(1 / scale).
    """
    if amax.dtype != torch.float32:
        raise TypeError(f"amax must be float32, got {amax.dtype}")
    dev = amax.device
    one = _fp32_const(1.0, dev)
    a = amax
    eps32 = _as_fp32(eps)
    if eps32 > 0.0:
        a = torch.where(a < eps32, _fp32_const(eps32, dev), a)
    regular = (a > 0.0) & (a < math.inf)  # not 0, +inf or NaN: those take scale 1
    # torch.div(fmax, a) of two tensors, NOT `fmax / a`: Tensor.__rtruediv__ computes
    # reciprocal(a) * fmax, which is not the correctly rounded quotient (docs/spec/te.md 3).
    s = torch.div(_fp32_const(FP8_MAX[canonical_fp8_dtype(fp8_dtype)], dev), a)
    s = torch.where(s == math.inf, _fp32_const(input_dtype_max(input_dtype), dev), s)
    if pow2_scales:
        s = (s.view(torch.int32) & _SIGN_EXP_MASK).view(torch.float32)
    s = torch.where(regular, s, one)
    scale_inv = torch.div(one, s)  # IEEE division: correctly rounded, subnormals kept
    return s, scale_inv


def mxfp8_e8m0_from_amax(amax: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """E8M0 bytes of ``RN32(amax * RN32(1/fp8max))`` rounded up to a power of two (docs/spec/te.md 2.2)."""
    if amax.dtype != torch.float32:
        raise TypeError(f"amax must be float32, got {amax.dtype}")
    v = amax * FP8_RCP_MAX[canonical_fp8_dtype(fp8_dtype)]  # a multiply by the rounded reciprocal
    return e8m0_from_fp32(v)


# ------------------------------------------------------------------------------------------------
# per-direction kernels on a 2-D [M, K] view
# ------------------------------------------------------------------------------------------------

def _block_amax(xb: torch.Tensor, dims: tuple):
    """NaN-ignoring amax (fp32) of ``xb`` over ``dims``, plus whether any NaN was seen.

    Fast path: max(-min, max) (exact; no |x| temporary). torch's min/max propagate NaN, so a NaN
    amax flags a block with NaN, and only then the NaN-masked |x| is reduced instead. (On a GPU the
    test costs a host sync; measured on an H200 that is still cheaper than the extra passes of an
    always-masked reduction.)
    """
    mx = xb.amax(dim=dims)
    mn = xb.amin(dim=dims)
    amax = torch.maximum(mx, -mn).float().abs()  # abs: an all -0.0 block gives +0
    if not bool(torch.isnan(amax).any()):
        return amax, False
    return nan_ignoring_abs(xb).amax(dim=dims).float(), True


def _scale_cast(xf: torch.Tensor, scale: torch.Tensor, fp8: str, has_nan: bool, inplace: bool) -> torch.Tensor:
    """Q(RN32(x * scale)) with the block scales broadcast against xf (fp32); uint8 bits out.

    The saturating clamp always runs: on these small blocks one clamp costs less than proving
    that no block can saturate. NaN bytes are canonicalised only when a NaN was seen.
    """
    fmax = FP8_MAX[fp8]
    y = xf.mul_(scale) if inplace else xf * scale
    y.clamp_(-fmax, fmax)  # keeps NaN and -0.0
    q = y.to(FP8_TORCH_DTYPE[fp8]).view(torch.uint8)
    if has_nan:
        q.masked_fill_((q & 0x7F) > FP8_MAX_BYTE[fp8], FP8_NAN_BYTE)
    return q


def _widen(x: torch.Tensor):
    """(fp32 tensor, owned): a fresh fp32 copy for bf16/fp16 (exact), the input itself for fp32."""
    if x.dtype == torch.float32:
        return x, False
    return x.float(), True


def _rows_1x128(xf: torch.Tensor, owned: bool, src_dtype, fp8, pow2: bool, eps: float):
    """1x128 blocks along the last dim of fp32 xf [R, C]: (data uint8 [R, C], scale_inv fp32 [R, Cb])."""
    R, C = xf.shape
    Cb = _ceil_div(C, BLOCK_LEN)
    if C != Cb * BLOCK_LEN:  # zero padding never raises the amax and is sliced off below
        xf, owned = F.pad(xf, (0, Cb * BLOCK_LEN - C)), True
    xb = xf.view(R, Cb, BLOCK_LEN)
    amax, has_nan = _block_amax(xb, (2,))
    scale, scale_inv = blockwise_scale_from_amax(amax, fp8, src_dtype, pow2_scales=pow2, eps=eps)
    q = _scale_cast(xb, scale.unsqueeze(-1), fp8, has_nan, owned).view(R, Cb * BLOCK_LEN)
    if Cb * BLOCK_LEN != C:
        q = q[:, :C].contiguous()
    return q, scale_inv


def _cols_1x128(xf: torch.Tensor, owned: bool, src_dtype, fp8, pow2: bool, eps: float):
    """128x1 blocks down the columns of fp32 xf [M, K] (= 1x128 blocks of x^T):
    (data uint8 [K, M] transposed, scale_inv fp32 [Mb, K]).

    Same blocks and arithmetic as quantizing ``x.t()`` row by row, but reduced in place and only
    the uint8 result is transposed (cheaper than transposing the high-precision input).
    """
    M, K = xf.shape
    Mb = _ceil_div(M, BLOCK_LEN)
    if M != Mb * BLOCK_LEN:
        xf, owned = F.pad(xf, (0, 0, 0, Mb * BLOCK_LEN - M)), True
    xb = xf.view(Mb, BLOCK_LEN, K)
    amax, has_nan = _block_amax(xb, (1,))
    scale, scale_inv = blockwise_scale_from_amax(amax, fp8, src_dtype, pow2_scales=pow2, eps=eps)
    q = _scale_cast(xb, scale.unsqueeze(1), fp8, has_nan, owned).view(Mb * BLOCK_LEN, K)
    return q[:M].t().contiguous(), scale_inv


def _quantize_128x128(x2: torch.Tensor, fp8, pow2: bool, eps: float):
    """128x128 tiles of x2 [M, K]: (data uint8 [M, K], scale_inv fp32 [Mb, Kb])."""
    M, K = x2.shape
    Mb, Kb = _ceil_div(M, BLOCK_LEN), _ceil_div(K, BLOCK_LEN)
    Mp, Kp = Mb * BLOCK_LEN, Kb * BLOCK_LEN
    xf, owned = _widen(x2)
    if (Mp, Kp) != (M, K):
        xf, owned = F.pad(xf, (0, Kp - K, 0, Mp - M)), True
    xb = xf.view(Mb, BLOCK_LEN, Kb, BLOCK_LEN)
    amax, has_nan = _block_amax(xb, (1, 3))
    scale, scale_inv = blockwise_scale_from_amax(amax, fp8, x2.dtype, pow2_scales=pow2, eps=eps)
    q = _scale_cast(xb, scale.view(Mb, 1, Kb, 1), fp8, has_nan, owned).view(Mp, Kp)
    if (Mp, Kp) != (M, K):
        q = q[:M, :K].contiguous()
    return q, scale_inv


def _quantize_mx_rows(xf: torch.Tensor, owned: bool, fp8):
    """1x32 blocks along K of fp32 xf [M, K]: (data uint8 [M, K], E8M0 uint8 [M, K/32])."""
    M, K = xf.shape
    xb = xf.view(M, K // MX_BLOCK_LEN, MX_BLOCK_LEN)
    amax, has_nan = _block_amax(xb, (2,))
    e = mxfp8_e8m0_from_amax(amax, fp8)
    q = _scale_cast(xb, e8m0_quant_scale(e).unsqueeze(-1), fp8, has_nan, owned)
    return q.view(M, K), e


def _quantize_mx_cols(xf: torch.Tensor, owned: bool, fp8):
    """32x1 blocks along M of fp32 xf [M, K]: (data uint8 [M, K] untransposed, E8M0 uint8 [M/32, K])."""
    M, K = xf.shape
    xb = xf.view(M // MX_BLOCK_LEN, MX_BLOCK_LEN, K)
    amax, has_nan = _block_amax(xb, (1,))
    e = mxfp8_e8m0_from_amax(amax, fp8)
    q = _scale_cast(xb, e8m0_quant_scale(e).unsqueeze(1), fp8, has_nan, owned)
    return q.view(M, K), e


def _padded(grid: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """grid placed top-left in a zero tensor [rows, cols]. A grid that is that shape already
    (aligned dims) and no view of another tensor's storage is returned as it is."""
    if grid.shape == (rows, cols) and grid.is_contiguous() and grid._base is None:
        return grid
    out = grid.new_zeros((rows, cols))
    out[: grid.shape[0], : grid.shape[1]] = grid
    return out


def _transpose_2d_parts(row_data: torch.Tensor, row_scale: torch.Tensor, M: int, K: int):
    """Columnwise parts of a 128x128 tensor from its rowwise parts (exact byte/grid transpose)."""
    Mb, Kb = _ceil_div(M, BLOCK_LEN), _ceil_div(K, BLOCK_LEN)
    col_data = row_data.reshape(M, K).t().contiguous()
    col_scale = _padded(row_scale[:Mb, :Kb].t(), Kb, _pad_to(Mb, 4))
    return col_data, col_scale


def _quantize_parts(x2: torch.Tensor, recipe: str, block: str, fp8: str, pow2: bool, eps: float,
                    rowwise: bool, columnwise: bool) -> dict:
    """Storage tensors of a 2-D input (data 2-D: rowwise [M, K]; columnwise [K, M] or mxfp8 [M, K])."""
    if USE_TRITON and x2.is_cuda and x2.numel() > 0:
        from . import triton_quantize as _tq  # late: optional dependency

        if _tq.triton_available():
            return _tq.triton_parts(x2.contiguous(), recipe, block, fp8, pow2, eps, rowwise, columnwise)
    M, K = x2.shape
    parts = {}
    if recipe == "mxfp8":
        xf, owned = _widen(x2)
        if rowwise:
            # the columnwise pass still needs xf, so the rowwise multiply may not overwrite it
            q, e = _quantize_mx_rows(xf, owned and not columnwise, fp8)
            parts["rowwise_data"] = q
            parts["rowwise_scale_inv"] = _padded(e, _pad_to(M, 128), _pad_to(K // MX_BLOCK_LEN, 4))
        if columnwise:
            q, e = _quantize_mx_cols(xf, owned, fp8)
            parts["columnwise_data"] = q
            parts["columnwise_scale_inv"] = _padded(e, _pad_to(M // MX_BLOCK_LEN, 4), _pad_to(K, 128))
        return parts
    Mb, Kb = _ceil_div(M, BLOCK_LEN), _ceil_div(K, BLOCK_LEN)
    if block == "1x128":
        xf, owned = _widen(x2)
        if rowwise:
            q, s = _rows_1x128(xf, owned and not columnwise, x2.dtype, fp8, pow2, eps)  # s: [M, Kb]
            parts["rowwise_data"] = q
            parts["rowwise_scale_inv"] = _padded(s.t(), Kb, _pad_to(M, 4))
        if columnwise:
            q, s = _cols_1x128(xf, owned, x2.dtype, fp8, pow2, eps)  # q: [K, M], s: [Mb, K]
            parts["columnwise_data"] = q
            parts["columnwise_scale_inv"] = _padded(s, Mb, _pad_to(K, 4))
        return parts
    # 128x128: quantize once; the columnwise copy is the exact transpose (docs/spec/te.md 1.4)
    q, s = _quantize_128x128(x2, fp8, pow2, eps)
    row_scale = _padded(s, Mb, _pad_to(Kb, 4))
    if rowwise:
        parts["rowwise_data"] = q
        parts["rowwise_scale_inv"] = row_scale
    if columnwise:
        parts["columnwise_data"], parts["columnwise_scale_inv"] = _transpose_2d_parts(q, row_scale, M, K)
    return parts


def _check_input(x: torch.Tensor):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _HP_DTYPES:
        raise TypeError(f"quantize expects a bfloat16/float16/float32 tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize expects a tensor with at least one dimension, got a 0-d tensor")


def _as_2d(x: torch.Tensor) -> torch.Tensor:
    K = x.shape[-1]
    M = math.prod(x.shape[:-1])
    return x.detach().contiguous().view(M, K)


def _check_mx_shape(M: int, K: int):
    if M % MX_BLOCK_LEN or K % MX_BLOCK_LEN:
        raise ValueError(
            f"mxfp8 needs both dims of the 2-D view divisible by {MX_BLOCK_LEN}: got M={M} "
            f"(product of leading dims), K={K} (last dim)")


def quantize(x: torch.Tensor, recipe: str, *, block=None, fp8_dtype="e4m3", pow2_scales: bool = True,
             eps: float = 0.0, rowwise: bool = True, columnwise: bool = True) -> QuantizedTensor:
    """Quantize ``x`` (bf16/fp16/fp32, any N-D shape viewed as [M, K]) the way TE does.

    recipe "blockwise": ``block`` "1x128" or "128x128" (default), ``pow2_scales`` and ``eps`` as TE's
    ``force_pow_2_scales`` / ``amax_epsilon``. recipe "mxfp8": 1x32 rowwise and 32x1 columnwise blocks
    with E8M0 scales; M and K must be multiples of 32; scales are always powers of two and there is
    no epsilon (pow2_scales=False or eps != 0 are refused).
    """
    x2, recipe, block, fp8, eps = prepare_args(x, recipe, block, fp8_dtype, pow2_scales, eps,
                                               rowwise, columnwise)
    parts = _quantize_parts(x2, recipe, block, fp8, bool(pow2_scales), eps, rowwise, columnwise)
    return wrap_parts(x, parts, recipe, block, fp8, pow2_scales, eps, rowwise, columnwise)


def prepare_args(x, recipe, block, fp8_dtype, pow2_scales, eps, rowwise, columnwise):
    """Validate and canonicalise quantize() arguments (shared by every quantizer backend).
    Returns (x viewed as [M, K], recipe, block, fp8 dtype name, eps as float)."""
    _check_input(x)
    recipe, block = canonical_recipe(recipe, block)
    fp8 = canonical_fp8_dtype(fp8_dtype)
    if not (rowwise or columnwise):
        raise ValueError("at least one of rowwise/columnwise must be True")
    eps = float(eps)
    if not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative number, got {eps}")
    x2 = _as_2d(x)
    M, K = x2.shape
    if recipe == "mxfp8":
        _check_mx_shape(M, K)
        if not pow2_scales:
            raise ValueError("mxfp8 scales are E8M0 powers of two; pow2_scales=False is not supported")
        if eps != 0.0:
            raise ValueError("mxfp8 has no amax epsilon; eps must be 0")
    return x2, recipe, block, fp8, eps


def wrap_parts(x, parts, recipe, block, fp8, pow2_scales, eps, rowwise, columnwise) -> QuantizedTensor:
    """A QuantizedTensor over raw parts; data take the logical (row) / transposed (col) shapes."""
    shape = torch.Size(x.shape)
    col_shape = shape if recipe == "mxfp8" else torch.Size((shape[-1],) + tuple(shape[:-1]))
    return QuantizedTensor(
        shape=shape,
        dtype=x.dtype,
        recipe=recipe,
        block=block,
        fp8_dtype=fp8,
        pow2_scales=bool(pow2_scales),
        eps=eps,
        rowwise_data=parts["rowwise_data"].view(shape) if rowwise else None,
        rowwise_scale_inv=parts.get("rowwise_scale_inv"),
        columnwise_data=parts["columnwise_data"].view(col_shape) if columnwise else None,
        columnwise_scale_inv=parts.get("columnwise_scale_inv"),
    )
