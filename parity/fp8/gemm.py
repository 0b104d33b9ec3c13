"""Block-scaled FP8 GEMM: ``a @ b^T`` on canonical operands, emulated or through torch's scaled_mm.

The emulated backend is a model of cuBLAS's block-scaled GEMM (docs/spec/te.md section 4): for each K block,
in increasing order,

    p = RN32(exact dot product of the fp8 values over the block)
    1D x 1D operands (1x128 x 1x128, mxfp8):   y = fma32(RN32(p * s_a), s_b, y)
    a 128x128-tiled operand on either side:    y = fma32(p, RN32(s_a * s_b), y)

(y starts at +0), and finally ``y`` is rounded to ``out_dtype``. With ``accumulate_into`` the
result is ``y.to(out_dtype) + accumulate_into`` (cuBLAS converts to the output dtype first),
written back into ``accumulate_into``.

The scale rule was measured on an H200 (torch 2.11 + cuBLAS 13.0, ``F.scaled_mm``), feeding the
model the hardware's own per-block partials: with non-power-of-two scales the 1Dx1D rule above and
the scale-product rule for 1Dx2D / 2Dx1D reproduced every output bit, while TE's reference order
(``fma(RN32(p*s_1D), s_other, y)``, docs/spec/te.md 4) did not for the 2D pairs (~50% of fp32 outputs
differed). With power-of-two scales (TE's default and the only setting TE's exact GEMM test uses)
all orders give the same bits.

What the model does NOT reproduce is the hardware's per-block dot product: Hopper's FP8 tensor
cores accumulate a 128-long dot in reduced precision (products aligned to the largest one, about
14 fraction bits kept), so ``p`` differs from the correctly rounded exact dot in almost every
element (measured: ~99% of partials; relative to the largest product, errors up to ~2^-7). The
emulation is therefore a deterministic, device-independent *model*, not a bit-exact replay of a
GPU: emulated and ``scaled_mm`` outputs agree to about 2^-10 relative, not bitwise.

Every step of the model is rounded once to fp32: computed exactly in float64 and then rounded
(see ``_round_to_f32``), or, where that gives the same single rounding, as one IEEE fp32 operation
(a product; an addition of an exact product). So its result is a pure function of the operands: it
does not depend on the thread count, the BLAS library or the device.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .formats import E4M3, E5M2, FP8_MAX, FP8_TORCH_DTYPE, canonical_fp8_dtype

__all__ = ["Operand", "fp8_gemm", "scaled_mm_supported", "accumulate_blocks", "BACKENDS"]

BACKENDS = ("auto", "emulated", "scaled_mm")


@dataclass
class Operand:
    """One GEMM operand, contraction along its last dim.

    data: uint8 fp8 bits [R, K]; fp8_dtype: "e4m3"/"e5m2"; scale_inv: fp32 [R, ceil(K/block_len)]
    (scale of row r, K block kb); block_len: K block length (128 blockwise, 32 mxfp8);
    tile_2d: for operands of 128x128-tiled tensors, the raw TE scale grid [ceil(R/128), pad4(Kb)]
    (element [row tile, k tile]; padding zero), else None.
    """

    data: torch.Tensor
    fp8_dtype: str
    scale_inv: torch.Tensor
    block_len: int
    tile_2d: Optional[torch.Tensor] = None

    def __post_init__(self):
        self.fp8_dtype = canonical_fp8_dtype(self.fp8_dtype)
        if self.data.dtype != torch.uint8 or self.data.dim() != 2:
            raise ValueError(f"Operand.data must be a 2-D uint8 tensor, got {self.data.dtype} {tuple(self.data.shape)}")
        if self.scale_inv.dtype != torch.float32 or self.scale_inv.dim() != 2:
            raise ValueError(f"Operand.scale_inv must be a 2-D float32 tensor, got {self.scale_inv.dtype} "
                             f"{tuple(self.scale_inv.shape)}")
        R, K = self.data.shape
        self.block_len = int(self.block_len)
        if self.block_len <= 0:
            raise ValueError(f"block_len must be positive, got {self.block_len}")
        want = (R, -(-K // self.block_len))
        if tuple(self.scale_inv.shape) != want:
            raise ValueError(f"Operand.scale_inv shape {tuple(self.scale_inv.shape)} != {want} for data "
                             f"{(R, K)} and block_len {self.block_len}")
        if self.tile_2d is not None:
            if self.block_len != 128:
                raise ValueError("tile_2d is only meaningful for 128x128 blockwise operands")
            if self.tile_2d.dtype != torch.float32 or self.tile_2d.dim() != 2:
                raise ValueError("Operand.tile_2d must be a 2-D float32 tensor")
            kb = want[1]
            if self.tile_2d.shape[0] != -(-R // 128) or self.tile_2d.shape[1] < kb:
                raise ValueError(f"Operand.tile_2d shape {tuple(self.tile_2d.shape)} does not fit data {(R, K)}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


# ------------------------------------------------------------------------------------------------
# exact float64 helpers
# ------------------------------------------------------------------------------------------------

def _two_sum(a: torch.Tensor, b: torch.Tensor):
    """Knuth's TwoSum: s + err == a + b exactly, s = RN64(a + b) (no overflow assumed).

    Each line is a separate eager op, so nothing is reassociated or contracted into an FMA.
    """
    s = a + b
    bv = s - a
    av = s - bv
    err = (a - av) + (b - bv)
    return s, err


def _round_to_f32(hi: torch.Tensor, lo: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Correctly rounded fp32 (RNE) of the exact value hi + lo, where hi = RN64(hi + lo).

    Rounding hi alone could round twice (a float64 that lies exactly on an fp32 midpoint while the
    true value does not). Rounding hi + lo to float64 *to odd* first (move hi one ulp towards lo
    when lo != 0 and hi's last bit is even) and then to fp32 is a single correct rounding, because
    53 >= 24 + 2 (Boldo & Melquiond's round-to-odd property); this also holds for fp32 subnormal
    results, whose grid is coarser still.
    """
    if lo is None:
        return hi.to(torch.float32)  # hi is exact: one rounding
    even = (hi.view(torch.int64) & 1) == 0
    toward = torch.where(lo > 0, math.inf, -math.inf).to(hi.dtype)
    odd = torch.where((lo != 0) & even, torch.nextafter(hi, toward), hi)
    return odd.to(torch.float32)


def _fma32(t: torch.Tensor, s: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 fma(t, s, y) for fp32 tensors (broadcasting t*s against y).

    t*s is exact in float64 (24+24 significant bits <= 53; fp32 exponents stay far inside float64's
    range, subnormals included). Where every product is also an fp32 value (the usual case: the
    scales are powers of two), the fma is one fp32 addition, which IEEE rounds once (signed zeros
    included); otherwise TwoSum makes the addition exact as hi + lo, rounded once to fp32.
    """
    prod = t.double() * s.double()
    prod32 = prod.to(torch.float32)
    if torch.equal(prod32.double(), prod):
        return prod32 + y
    hi, lo = _two_sum(prod, y.double().expand_as(prod))
    return _round_to_f32(hi, lo)


def _mul32(p: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """RN32(p * s): IEEE fp32 multiplication is one correct rounding of the exact product
    (gradual underflow included; torch leaves flush-to-zero off)."""
    return p * s


# Exactness of the per-block dot products in float64.
#
# Write every fp8 value as n * 2^q with an integer n:
#   E4M3: q = -9 (the smallest subnormal), |n| <= 448 * 2^9 < 2^18;
#   E5M2 with |v| <  1: q = -16, |n| < 2^16;
#   E5M2 with |v| >= 1: q = -2 (2 mantissa bits, exponent >= 0), |n| <= 57344 * 2^2 < 2^18.
# A product of two such values is an integer of < 2^(bits_a + bits_b) times a fixed power of two, and
# a sum of L products (and every partial sum, in any order) is an integer of
# < 2^(bits_a + bits_b + ceil(log2 L)) times that power. For L <= 128 that is <= 18 + 18 + 7 = 43 bits
# for every pairing of the pieces above, well inside float64's 53: the float64 matmul is exact no
# matter how the BLAS orders, blocks or fuses (FMA) its sums. An unsplit E5M2 operand would need up
# to 32 bits (2^-16 .. 57344), i.e. 57 or 71 bits with E4M3/E5M2 - not exact - so E5M2 operands are
# split by magnitude at 1.0 into two disjoint pieces and the (at most 4) exact partial dots are
# added with TwoSum (the accumulated TwoSum errors are multiples of 2^-32 below 2^-10, exact too).
_PIECE_BITS = {E4M3: (18,), E5M2: (16, 18)}


def _pieces(v: torch.Tensor, fp8: str):
    if fp8 == E4M3:
        return [v]
    big = v.abs() >= 1.0
    return [torch.where(big, 0.0, v), torch.where(big, v, 0.0)]


def _check_exact_bits(a_fp8: str, b_fp8: str, block_len: int):
    worst = max(_PIECE_BITS[a_fp8]) + max(_PIECE_BITS[b_fp8]) + math.ceil(math.log2(max(block_len, 2)))
    if worst > 53:
        raise ValueError(f"block_len {block_len} too large for an exact float64 block dot product")


_F64_TABLES: dict = {}


def _as_float64(codes: torch.Tensor, fp8: str) -> torch.Tensor:
    """The float64 values of fp8 codes, by table lookup: the same bits as ``.view(fp8).to(float64)``
    (the table is made that way), about 5x faster on CPU than torch's element-wise fp8 cast."""
    key = (fp8, codes.device)
    table = _F64_TABLES.get(key)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=codes.device)
        table = _F64_TABLES[key] = table.view(FP8_TORCH_DTYPE[fp8]).to(torch.float64)
    return torch.index_select(table, 0, codes.reshape(-1).int()).view(codes.shape)


def _exact_bmm(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x @ y for float64 [nb, M, L] x [nb, L, N] whose sums are exact (see above), so any kernel
    gives the same bits. On CPU numpy's BLAS runs it: the MKL pin that fixes torch's fp32 GEMM
    bits across CPUs (parity.distributed.determinism.CPU_PINS) also puts torch's float64 GEMMs on
    MKL's slowest path (3-4x slower, tools/bench_block_dot.py). Strided views need no copy."""
    if x.device.type == "cpu":
        return torch.from_numpy(np.matmul(x.numpy(), y.numpy()))
    return torch.bmm(x, y)


def _block_dots(a: Operand, b: Operand, kb0: int, kb1: int) -> torch.Tensor:
    """p[kb, m, n] = RN32(exact sum over K block kb of a[m, k] * b[n, k]) for kb in [kb0, kb1)."""
    blk = a.block_len
    K = a.data.shape[1]
    k0, k1 = kb0 * blk, min(kb1 * blk, K)
    nb = kb1 - kb0

    def blocks(op: Operand, transpose: bool):
        v = _as_float64(op.data[:, k0:k1], op.fp8_dtype)
        if k1 - k0 != nb * blk:
            v = torch.nn.functional.pad(v, (0, nb * blk - (k1 - k0)))
        v = v.view(v.shape[0], nb, blk)
        v = v.permute(1, 2, 0) if transpose else v.permute(1, 0, 2)  # [nb, blk, R] / [nb, R, blk]
        return _pieces(v, op.fp8_dtype)

    partials = [_exact_bmm(pa, pb) for pa in blocks(a, False) for pb in blocks(b, True)]
    if len(partials) == 1:
        return _round_to_f32(partials[0])
    s, err = partials[0], torch.zeros_like(partials[0])
    for p in partials[1:]:
        s, e = _two_sum(s, p)
        err = err + e
    hi, lo = _two_sum(s, err)
    return _round_to_f32(hi, lo)


def _scale_product_rule(a: Operand, b: Operand) -> bool:
    """True when a 128x128-tiled operand is involved: y = fma(p, RN32(s_a * s_b), y)."""
    return a.tile_2d is not None or b.tile_2d is not None


# The smallest nonzero |fp8 value| is 2^q: a nonzero exact block dot is a multiple of 2^(q_a + q_b).
_QUANTUM_EXP = {E4M3: -9, E5M2: -16}
_FP32_MIN_NORMAL = 2.0 ** -126
_FP32_OVERFLOW = 2.0 ** 128


def _f32(bits: int) -> float:
    """The fp32 value of int32 ``bits``."""
    return struct.unpack("<f", struct.pack("<i", bits))[0]


def _pow2_range(s: torch.Tensor) -> Optional[tuple[float, float]]:
    """None if an element of fp32 ``s`` has a mantissa bit (not +-2^e, +-0 or +-inf), else the
    elements with the smallest and the largest int32 bits: min and max when all are >= +0 (the
    caller's range check refuses a zero, subnormal, negative or infinite one).

    Read on the host with numpy: a GEMM has a few hundred scales, on which torch's fixed cost per
    op is most of the time (and on a GPU the answer is needed on the host anyway)."""
    bits = s.cpu().numpy().view(np.int32)
    if (bits & 0x7FFFFF).any():
        return None
    return _f32(int(bits.min())), _f32(int(bits.max()))  # non-negative floats order like their bits


def _fp32_steps_exact(a: Operand, b: Operand, sa: torch.Tensor, sb: torch.Tensor) -> bool:
    """Whether every fma of the epilogue below is one fp32 addition, because its product is an fp32
    value: the scales are normal powers of two and p * s_a * s_b stays in fp32's normal range for
    every nonzero |p| in [2^(q_a + q_b), 2 * block_len * max_a * max_b] (RN32 of the exact block dot
    stays in that range). Multiplying by a power of two then only moves the exponent. (Both paths
    round s_a * s_b, or p * s_a, alike; only the product in the fma must be exact.)"""
    ra, rb = _pow2_range(sa), _pow2_range(sb)
    if ra is None or rb is None:
        return False
    p_lo = 2.0 ** (_QUANTUM_EXP[a.fp8_dtype] + _QUANTUM_EXP[b.fp8_dtype])
    p_hi = 2.0 * a.block_len * FP8_MAX[a.fp8_dtype] * FP8_MAX[b.fp8_dtype]
    # powers of two: the products are exact in Python floats
    return p_lo * ra[0] * rb[0] >= _FP32_MIN_NORMAL and p_hi * ra[1] * rb[1] < _FP32_OVERFLOW


def _exact_fp32_products(partials, a: Operand, b: Operand, sa, sb, product_rule: bool):
    """The products of the epilogue's fma steps, RN32(p * RN32(s_a * s_b)) or RN32(p * s_a) * s_b, as
    fp32 values if every one of them is exact in fp32, else None. Proven from the scales alone
    where possible (an inf or NaN partial then gives the same inf or NaN either way), else checked
    against the float64 products (e.g. the E8M0 scale 2^-127 of an all-zero MXFP8 block)."""
    t, s = (partials, _mul32(sa, sb)) if product_rule else (_mul32(partials, sa), sb)
    if _fp32_steps_exact(a, b, sa, sb):
        return t * s
    exact = t.double() * s.double()  # exact: 24 + 24 significant bits
    prod = exact.to(torch.float32)
    return prod if torch.equal(prod.double(), exact) else None


def accumulate_blocks(partials, a: Operand, b: Operand, out_dtype: torch.dtype, kb0: int = 0,
                      y: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scale-and-accumulate epilogue of the model for fp32 block partials ``partials[kb, m, n]``
    (blocks kb0, kb0+1, ... in order), continuing from ``y`` (fp32 [M, N], default +0).

    Returns fp32 ``y`` when ``out_dtype`` is None, else ``y.to(out_dtype)``. Public so the
    epilogue can be checked against hardware-computed partials on a GPU.
    """
    if y is None:
        y = torch.zeros(a.data.shape[0], b.data.shape[0], dtype=torch.float32, device=a.data.device)
    product_rule = _scale_product_rule(a, b)
    nb = partials.shape[0]
    sa = a.scale_inv[:, kb0 : kb0 + nb].t().unsqueeze(2)  # [nb, M, 1]
    sb = b.scale_inv[:, kb0 : kb0 + nb].t().unsqueeze(1)  # [nb, 1, N]
    prod = _exact_fp32_products(partials, a, b, sa, sb, product_rule)
    if prod is not None:  # each fma is one fp32 addition
        for i in range(nb):
            y = prod[i] + y
        return y if out_dtype is None else y.to(out_dtype)
    for i in range(nb):
        if product_rule:
            y = _fma32(partials[i], _mul32(sa[i], sb[i]), y)
        else:
            y = _fma32(_mul32(partials[i], sa[i]), sb[i], y)
    return y if out_dtype is None else y.to(out_dtype)


def _emulated(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    _check_exact_bits(a.fp8_dtype, b.fp8_dtype, a.block_len)
    M = a.data.shape[0]
    N = b.data.shape[0]
    Kb = a.scale_inv.shape[1]
    y = torch.zeros(M, N, dtype=torch.float32, device=a.data.device)
    # bound the float64 workspace (pieces x chunk x M x N) to ~64 MiB
    pieces = len(_PIECE_BITS[a.fp8_dtype]) * len(_PIECE_BITS[b.fp8_dtype])
    chunk = max(1, (64 << 20) // max(1, 8 * pieces * M * N))
    for c0 in range(0, Kb, chunk):  # fixed, increasing K order
        c1 = min(Kb, c0 + chunk)
        y = accumulate_blocks(_block_dots(a, b, c0, c1), a, b, None, kb0=c0, y=y)
    return y.to(out_dtype)


# ------------------------------------------------------------------------------------------------
# torch.nn.functional.scaled_mm (CUDA, sm90, E4M3 blockwise)
# ------------------------------------------------------------------------------------------------

def _scaling_types():
    F = torch.nn.functional
    st = getattr(F, "ScalingType", None)
    if st is None or not hasattr(F, "scaled_mm"):
        return None
    if not (hasattr(st, "BlockWise1x128") and hasattr(st, "BlockWise128x128")):
        return None
    return st


def scaled_mm_supported(a: Operand, b: Operand) -> bool:
    """Whether the ``scaled_mm`` backend can run this pair (checked, not attempted)."""
    if _scaling_types() is None or not torch.cuda.is_available():
        return False
    if a.data.device.type != "cuda" or b.data.device.type != "cuda":
        return False
    if a.fp8_dtype != E4M3 or b.fp8_dtype != E4M3 or a.block_len != 128 or b.block_len != 128:
        return False
    if a.tile_2d is not None and b.tile_2d is not None:
        return False  # 128x128 x 128x128 is not a supported pair
    if torch.cuda.get_device_capability(a.data.device)[0] != 9:
        return False
    M, K = a.data.shape
    N = b.data.shape[0]
    # cuBLASLt alignment: 16-byte aligned leading dims for fp8, bf16/fp32 output rows
    return K % 16 == 0 and M % 16 == 0 and N % 16 == 0


def _scaled_mm(a: Operand, b: Operand, out_dtype: torch.dtype) -> torch.Tensor:
    st = _scaling_types()
    F = torch.nn.functional
    M, K = a.data.shape
    N = b.data.shape[0]
    Kb = -(-K // 128)
    mat_a = a.data.view(torch.float8_e4m3fn)            # [M, K] row-major
    mat_b = b.data.view(torch.float8_e4m3fn).t()        # [K, N] column-major

    def scale_for(op: Operand, rows: int):
        if op.tile_2d is not None:
            # [pad4(Kb), rows/128] with strides (1, pad4(Kb)): the transposed TE grid [Rb, pad4(Kb)]
            grid = op.tile_2d.contiguous()
            kp = -(-Kb // 4) * 4
            if grid.shape[1] != kp:
                g = grid.new_zeros((grid.shape[0], kp))
                g[:, : min(kp, grid.shape[1])] = grid[:, :kp]
                grid = g
            return grid.t(), st.BlockWise128x128
        # [rows, Kb] with strides (1, rows): column-major copy of the per-row scales
        return op.scale_inv.t().contiguous().t(), st.BlockWise1x128

    sa, ra = scale_for(a, M)
    sb, rb = scale_for(b, N)
    return F.scaled_mm(mat_a, mat_b, sa, ra, sb, rb, output_dtype=out_dtype, use_fast_accum=False)


# ------------------------------------------------------------------------------------------------
# public entry point
# ------------------------------------------------------------------------------------------------

def fp8_gemm(a: Operand, b: Operand, *, out_dtype: torch.dtype, backend: str = "auto",
             accumulate_into: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``a @ b^T``: [M, K] x [N, K] -> [M, N] in ``out_dtype``.

    backend: "emulated" (the exact cuBLAS model above, any device), "scaled_mm" (CUDA sm90, E4M3
    blockwise operands, not both 128x128) or "auto" (scaled_mm when supported, else emulated).
    With ``accumulate_into`` ([M, N], ``out_dtype``), returns it after
    ``accumulate_into.copy_(result.to(out_dtype) + accumulate_into)``.
    """
    if not isinstance(a, Operand) or not isinstance(b, Operand):
        raise TypeError("fp8_gemm expects two Operand instances (see QuantizedTensor.gemm_operand)")
    if a.data.shape[1] != b.data.shape[1]:
        raise ValueError(f"contraction dims differ: a is {tuple(a.data.shape)}, b is {tuple(b.data.shape)}")
    if a.block_len != b.block_len:
        raise ValueError(f"operands have different K block lengths ({a.block_len} vs {b.block_len})")
    if a.data.device != b.data.device:
        raise ValueError(f"operands on different devices ({a.data.device} vs {b.data.device})")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    M, N = a.data.shape[0], b.data.shape[0]
    if accumulate_into is not None:
        if tuple(accumulate_into.shape) != (M, N) or accumulate_into.dtype != out_dtype:
            raise ValueError(f"accumulate_into must be [{M}, {N}] of {out_dtype}, got "
                             f"{tuple(accumulate_into.shape)} of {accumulate_into.dtype}")
    if backend == "scaled_mm" and not scaled_mm_supported(a, b):
        raise RuntimeError("scaled_mm backend unavailable for these operands (needs CUDA sm90, "
                           "torch.nn.functional.scaled_mm with blockwise scaling, E4M3 operands with "
                           "128-long blocks, not both 128x128, and M, N, K multiples of 16)")
    if M == 0 or N == 0:  # no output element: no kernel to run, no scales to check
        out = torch.zeros(M, N, dtype=out_dtype, device=a.data.device)
    else:
        use_scaled = backend == "scaled_mm" or (backend == "auto" and scaled_mm_supported(a, b))
        out = _scaled_mm(a, b, out_dtype) if use_scaled else _emulated(a, b, out_dtype)
    if accumulate_into is not None:
        accumulate_into.copy_(out + accumulate_into)
        return accumulate_into
    return out
