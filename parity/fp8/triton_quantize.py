"""Triton kernels for the blockwise (1x128 / 128x128) and MXFP8 quantizers, byte-identical to the
torch reference in :mod:`parity.fp8.quantize` (spec: docs/spec/te.md sections 1.2, 1.3, 2.2, 2.3).

One launch per call, and the input read from HBM once: a program loads one tile of ``x`` into
registers and writes, from those registers, the rowwise and/or the columnwise FP8 bytes and scales
(NaN-ignoring block amax, the scale rule of docs/spec/te.md 1.2 or the E8M0 exponent of docs/spec/te.md 2.2, the fp32
multiply, the saturating round-to-nearest-even cast and the canonical NaN byte 0x7F). For 1x128
with both usages (the common call) one tile is shared by small programs launched side by side,
some writing its rowwise bytes and some its columnwise bytes (``_bw_pair_kernel``): the tile
comes from HBM once and its second read from L2, and on an H200 that measured faster than one
program holding the whole tile (docs/measurements.md). Storage tensors have exactly the layout
and zero padding of :mod:`parity.fp8.quantize`.

    quantize_triton(x, recipe, *, block=None, fp8_dtype="e4m3", pow2_scales=True, eps=0.0,
                    rowwise=True, columnwise=True) -> QuantizedTensor
    triton_available() -> bool

``parity.fp8.quantize.quantize`` routes CUDA inputs here by default (``PARITY_TRITON_QUANTIZE=0``
keeps the torch path); tests/test_fp8_triton.py checks the bytes against the torch path.

Exactness notes (all must hold for bit-identical results):

* bf16/fp16 are widened to fp32 exactly. The block amax is a float maximum of |x| that skips NaN:
  Triton's ``tl.maximum`` and ``tl.max`` (NaN propagation off, the default) lower to PTX
  ``max.f32``, which returns the other operand when one is NaN and keeps subnormals (no ``.ftz``);
  an all-NaN block's maximum is NaN, and its amax is taken as 0, as in the torch path. One
  ``max`` per element (|x| is a free operand modifier), where an integer max over the bits of |x|
  with NaN mapped to 0 compiled to about six instructions per element. Triton's interpreter
  propagates NaN through maxima, so there NaN elements are zeroed first.
* Triton's ``/`` on fp32 lowers to the approximate ``div.full.f32``; the two divisions of the scale
  rule use ``div.rn.f32`` through inline PTX (math mode "asm", default), or ``tl.math.div_rn``
  (math mode "tl"). The multiply uses ``mul.rn.f32`` (no FMA contraction, no flush to zero:
  subnormal inputs and the subnormal E8M0 multiplier 2^-127 matter). Select the mode with the
  environment variable ``PARITY_TRITON_MATH=asm|tl`` or :func:`set_math_mode`.
* Kernels are launched with ``enable_fp_fusion=False`` and ``enable_reflect_ftz=False`` (dropped
  automatically if the installed Triton does not know these options).
* The fp8 cast is ``.to(tl.float8e4nv / tl.float8e5, fp_downcast_rounding="rtne")``. On sm_89+
  it is ``cvt.rn.satfinite``, which saturates and writes NaN as 0x7F by itself; elsewhere (and in
  the interpreter) the kernels clamp to +-fp8max first and force NaN inputs to byte 0x7F (x * scale
  is NaN exactly when x is: every scale is finite and non-zero).
* Triton 3.6 gave wrong columnwise 128x128 bytes for a scalar broadcast into a vector and then
  into the tile, and for the columnwise-only 128x128 variant on partial tiles; see _bw_kernel
  and triton_parts for the forms used instead (the tests catch both). It also gave wrong
  columnwise bytes for fp16 and fp32 inputs with ``_bw_pair_kernel`` at ``num_warps=1`` (and at
  RSUB 8, CBC 64): the configs in CONFIG passed the GPU tests, and tools/bench_quantize.py
  --sweep marks a config whose bytes differ from the torch path's in any input dtype.

Running the kernels under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors) is supported
for debugging; inline PTX cannot run there, so the interpreter always uses math mode "tl".
"""

from __future__ import annotations

import os

import torch

from .formats import FP8_MAX, FP8_RCP_MAX
from .quantize import (
    BLOCK_LEN,
    MX_BLOCK_LEN,
    _ceil_div,
    _pad_to,
    prepare_args,
    wrap_parts,
)
from .tensor import QuantizedTensor

__all__ = [
    "triton_available",
    "triton_unavailable_reason",
    "quantize_triton",
    "triton_parts",
    "set_math_mode",
    "get_math_mode",
    "MATH_MODES",
    "CONFIG",
]

try:  # triton is optional: this module must import (and report "unavailable") without it
    import triton
    import triton.language as tl

    _TRITON_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the environment
    triton = None
    tl = None
    _TRITON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"

MATH_MODES = ("asm", "tl")
_VINF_BITS = {torch.bfloat16: 0x7F7F0000, torch.float16: 0x477FE000, torch.float32: 0x7F7FFFFF}
_SIGN_EXP_MASK = -8388608  # 0xFF800000 as int32
_INT32_LIMIT = 2**31 - 1


#: Triton's interpreter (CPU tensors, for debugging); triton reads the variable at import too
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
#: numpy's maximum (the interpreter's) propagates NaN, PTX max.f32 skips it: zero NaN by hand there
_ZERO_NAN_BY_HAND = tl.constexpr(_INTERPRET) if tl is not None else _INTERPRET


_math_mode = os.environ.get("PARITY_TRITON_MATH", "asm").strip().lower() or "asm"
if _math_mode not in MATH_MODES:
    raise ValueError(f"PARITY_TRITON_MATH must be one of {MATH_MODES}, got {_math_mode!r}")


def set_math_mode(mode: str) -> None:
    """"asm": inline PTX div.rn.f32 / mul.rn.f32 (default); "tl": tl.math.div_rn and ``*``."""
    global _math_mode
    if mode not in MATH_MODES:
        raise ValueError(f"math mode must be one of {MATH_MODES}, got {mode!r}")
    _math_mode = mode


def get_math_mode() -> str:
    return "tl" if _INTERPRET else _math_mode


_cuda_ok = None  # torch.cuda.is_available(), asked once (it does not change within a process)


def triton_unavailable_reason():
    """None when the Triton path can run here, else a short reason."""
    global _cuda_ok
    if _TRITON_IMPORT_ERROR is not None:
        return f"triton is not importable ({_TRITON_IMPORT_ERROR})"
    if _INTERPRET:
        return None
    if _cuda_ok is None:
        _cuda_ok = torch.cuda.is_available()
    return None if _cuda_ok else "CUDA is not available"


def triton_available() -> bool:
    """True iff triton imports and a CUDA device is present (or TRITON_INTERPRET=1 is set)."""
    return triton_unavailable_reason() is None


# ------------------------------------------------------------------------------------------------
# kernels (defined only when triton imports)
# ------------------------------------------------------------------------------------------------

if triton is not None:

    @triton.jit
    def _div_rn(a, b, ASM: tl.constexpr):
        """IEEE fp32 a / b, round to nearest even, subnormals kept."""
        if ASM:
            r = tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            r = tl.math.div_rn(a, b)
        return r

    @triton.jit
    def _mul_rn(a, b, ASM: tl.constexpr):
        """IEEE fp32 a * b, round to nearest even, subnormals kept, never fused."""
        if ASM:
            r = tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                          dtype=tl.float32, is_pure=True, pack=1)
        else:
            r = a * b
        return r

    @triton.jit
    def _load(ptrs, mask, EVEN: tl.constexpr):
        """x as fp32 (masked-out elements 0); EVEN: the tile is full, no mask."""
        if EVEN:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=mask, other=0.0)
        return x.to(tl.float32)

    @triton.jit
    def _store(ptrs, v, mask, EVEN: tl.constexpr):
        if EVEN:
            tl.store(ptrs, v)
        else:
            tl.store(ptrs, v, mask=mask)

    @triton.jit
    def _abs(x):
        """|x|; NaN stays NaN (the maxima skip it), except in the interpreter (see above)."""
        a = tl.abs(x)
        if _ZERO_NAN_BY_HAND:
            a = tl.where(a != a, 0.0, a)
        return a

    @triton.jit
    def _amax(m):
        """A block amax from a NaN-skipping maximum of |x|: NaN (all elements NaN) -> +0."""
        return tl.where(m != m, 0.0, m)

    @triton.jit
    def _bw_scale(amax, eps, vinf_bits, FMAX: tl.constexpr, FEXP: tl.constexpr, FFRAC: tl.constexpr,
                  POW2: tl.constexpr, ASM: tl.constexpr):
        """(scale, scale_inv) fp32 from NaN-skipping maxima of |x| (docs/spec/te.md 1.2).

        eps: fp32 amax epsilon (0 is a no-op: amax >= +0); vinf_bits: fp32 bits of the input
        dtype's max, with POW2 (power-of-two scales) rounded down to a power of two (the scale
        where FMAX / amax overflows); FEXP, FFRAC: exponent and fraction bits of FMAX.
        """
        a = _amax(amax)
        a = tl.where(a < eps, eps, a)
        ab = a.to(tl.int32, bitcast=True)
        unit = (ab == 0x7F800000) | (ab == 0)  # a is never NaN and never -0 here
        if POW2:
            # The exponent of RN(FMAX / a), without dividing. With a = m * 2^ea and FMAX =
            # mf * 2^FEXP (m, mf in [1, 2)), FMAX / a = (mf / m) * 2^(FEXP - ea): its exponent is
            # FEXP - ea, less one where m > mf; and RN never carries it up to the next power of
            # two (mf / m <= mf < 2 where m <= mf; where m > mf, m >= mf + 2^-23, so mf / m stays
            # more than half an ulp below 1). An exponent >= 128 is the division's overflow to
            # inf, for which the scale is the input dtype's max. Subnormal a is first scaled
            # by 2^64 (exact) to read its exponent and fraction.
            sub = ab < 0x00800000
            nb = tl.where(sub, _mul_rn(a, 18446744073709551616.0, ASM), a).to(tl.int32, bitcast=True)
            ea = ((nb >> 23) & 0xFF) - 127 - tl.where(sub, 64, 0)
            e = FEXP - ea - ((nb & 0x7FFFFF) > FFRAC).to(tl.int32)
            sb = tl.where(e >= 128, vinf_bits, (e + 127) << 23)  # e >= -120 here
            # 1 / 2^es = 2^-es: a normal power of two, or 2^-127 (subnormal) for es = 127
            bi = 127 - ((sb >> 23) - 127)
            sib = tl.where(bi >= 1, bi << 23, 0x00400000)
            sb = tl.where(unit, 0x3F800000, sb)
            sib = tl.where(unit, 0x3F800000, sib)
            scale = sb.to(tl.float32, bitcast=True)
            scale_inv = sib.to(tl.float32, bitcast=True)
        else:
            s = _div_rn(FMAX, a, ASM)
            sb = s.to(tl.int32, bitcast=True)
            sb = tl.where(sb == 0x7F800000, vinf_bits, sb)
            sb = tl.where(unit, 0x3F800000, sb)
            scale = sb.to(tl.float32, bitcast=True)
            scale_inv = _div_rn(1.0, scale, ASM)
        return scale, scale_inv

    @triton.jit
    def _mx_scale(amax, RCP: tl.constexpr, ASM: tl.constexpr):
        """(E8M0 exponent int32, multiplier 2^(127-e) fp32) from NaN-skipping maxima of |x| (docs/spec/te.md 2.2)."""
        v = _mul_rn(_amax(amax), RCP, ASM)
        vb = v.to(tl.int32, bitcast=True)
        ex = (vb >> 23) & 0xFF
        man = vb & 0x7FFFFF
        up = (man > 0) & (ex != 254) & ((ex != 0) | (man > 0x400000))
        e = ex + up.to(tl.int32)
        e = tl.where(ex == 255, tl.where(man == 0, 254, 255), e)
        k = 254 - e
        sb = tl.where(k >= 1, k << 23, 0x00400000)
        sb = tl.where(k < 0, 0x7FC00000, sb)
        return e, sb.to(tl.float32, bitcast=True)

    @triton.jit
    def _fp8_bytes(x, s, FMAX: tl.constexpr, E5: tl.constexpr, SAT: tl.constexpr, ASM: tl.constexpr):
        """uint8 bits of Q(RN32(x * s)): saturate to +-fp8max, round to nearest even, NaN -> 0x7F.

        SAT: the hardware cast does all three (sm_89+: cvt.rn.satfinite, whose NaN is 0x7F);
        otherwise clamp first and set NaN bytes here (s is finite and > 0, so x * s is NaN
        exactly when x is)."""
        y = _mul_rn(x, s, ASM)
        if not SAT:
            nan = y != y
            y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        if E5:
            q = y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        else:
            q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
        if not SAT:
            q = tl.where(nan, 0x7F, q).to(tl.uint8)
        return q

    @triton.jit
    def _max4(a0, a1, a2, a3):
        return tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))

    @triton.jit
    def _bw_tile(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits, pr, pc,
                 FMAX: tl.constexpr, FEXP: tl.constexpr, FFRAC: tl.constexpr, POW2: tl.constexpr,
                 E5: tl.constexpr, TILE2D: tl.constexpr, DO_ROW: tl.constexpr,
                 DO_COL: tl.constexpr, SUB: tl.constexpr, BC: tl.constexpr, PACK: tl.constexpr,
                 EVEN: tl.constexpr, OFF64: tl.constexpr, SAT: tl.constexpr, ASM: tl.constexpr):
        """Blockwise 1x128 (TILE2D False) or 128x128 (TILE2D True) blocks of x [M, K], tile (pr, pc).

        Program (pr, pc) reads the tile x[pr*4*SUB : +4*SUB, pc*BC : +BC] once, as four row
        sub-tiles x_j = rows pr*4*SUB + 4i + j (i < SUB): every row of the tile is in one of
        them and each column is split over the four alike, so the four bytes of rows 4i..4i+3 of
        one column (adjacent in the transposed columnwise data) sit in one thread.

        1x128: the amax of a tile row is its 1x128 block (needs BC == 128 for DO_ROW), the amax
        of a tile column over all four sub-tiles its 128x1 block (needs 4*SUB == 128 for DO_COL).
        128x128: one amax and one scale for the tile (4*SUB == BC == 128), the same bytes in both
        usages, computed once per usage from the scale in that usage's lanes; needs DO_ROW
        (triton_parts transposes the rowwise bytes for a columnwise-only call).
        Rowwise data [M, K], scale_inv grid [Kb, rs_ld] element [kb, m] (1x128) or
        [Mb, rs_ld] element [mb, kb] (128x128); columnwise data transposed [K, M] (PACK: written
        as 32-bit words of four rows, cq_ptr then points to int32, M % 4 == 0), scale_inv grid
        [Mb, cs_ld] element [mb, k] (1x128) or [Kb, cs_ld] element [kb, mb] (128x128).
        """
        i = tl.arange(0, SUB)
        c = tl.arange(0, BC)
        if OFF64:
            i = i.to(tl.int64)
            c = c.to(tl.int64)
        row0 = pr * (4 * SUB)
        col0 = pc * BC
        rows = row0 + 4 * i  # first row of each group of four
        cmask = col0 + c < K
        m0 = (rows < M)[:, None] & cmask[None, :]
        m1 = (rows + 1 < M)[:, None] & cmask[None, :]
        m2 = (rows + 2 < M)[:, None] & cmask[None, :]
        m3 = (rows + 3 < M)[:, None] & cmask[None, :]
        tile = row0.to(tl.int64) * K + col0
        offs = (4 * i)[:, None] * K + c[None, :]  # sub-tile 0 in the tile; sub-tile j adds j*K
        x0 = _load(x_ptr + tile + offs, m0, EVEN)
        x1 = _load(x_ptr + tile + K + offs, m1, EVEN)
        x2 = _load(x_ptr + tile + 2 * K + offs, m2, EVEN)
        x3 = _load(x_ptr + tile + 3 * K + offs, m3, EVEN)
        a0 = _abs(x0)
        a1 = _abs(x1)
        a2 = _abs(x2)
        a3 = _abs(x3)

        # both reductions first: |x| need not outlive them
        if TILE2D:
            # the tile amax in the lanes of both usages, each lane computed by a reduction: a
            # scalar broadcast into the lanes (tl.zeros_like(v) + t) gave wrong columnwise
            # bytes with Triton 3.6 on an H200
            amr = tl.max(_max4(a0, a1, a2, a3), axis=1)  # row maxima [SUB]
            amc = tl.max(tl.broadcast_to(amr[:, None], (SUB, BC)), axis=0)  # [BC], each the tile max
            am0 = tl.max(tl.broadcast_to(amc[None, :], (SUB, BC)), axis=1)  # [SUB], each the tile max
            am1 = am0
            am2 = am0
            am3 = am0
        else:
            if DO_COL:
                amc = tl.max(_max4(a0, a1, a2, a3), axis=0)  # column maxima [BC]
            if DO_ROW:
                am0 = tl.max(a0, axis=1)  # row maxima [SUB] of each sub-tile
                am1 = tl.max(a1, axis=1)
                am2 = tl.max(a2, axis=1)
                am3 = tl.max(a3, axis=1)

        if DO_ROW:
            s0, si0 = _bw_scale(am0, eps, vinf_bits, FMAX, FEXP, FFRAC, POW2, ASM)
            s1, si1 = _bw_scale(am1, eps, vinf_bits, FMAX, FEXP, FFRAC, POW2, ASM)
            s2, si2 = _bw_scale(am2, eps, vinf_bits, FMAX, FEXP, FFRAC, POW2, ASM)
            s3, si3 = _bw_scale(am3, eps, vinf_bits, FMAX, FEXP, FFRAC, POW2, ASM)
            if TILE2D:
                tl.store(rs_ptr + pr * rs_ld + pc, tl.max(si0.to(tl.int32, bitcast=True), axis=0)
                         .to(tl.float32, bitcast=True))
            else:
                sp = rs_ptr + pc * rs_ld + rows
                tl.store(sp, si0, mask=rows < M)
                tl.store(sp + 1, si1, mask=rows + 1 < M)
                tl.store(sp + 2, si2, mask=rows + 2 < M)
                tl.store(sp + 3, si3, mask=rows + 3 < M)
            qp = rq_ptr + tile + offs
            _store(qp, _fp8_bytes(x0, tl.broadcast_to(s0[:, None], (SUB, BC)), FMAX, E5, SAT, ASM), m0, EVEN)
            _store(qp + K, _fp8_bytes(x1, tl.broadcast_to(s1[:, None], (SUB, BC)), FMAX, E5, SAT, ASM), m1, EVEN)
            _store(qp + 2 * K, _fp8_bytes(x2, tl.broadcast_to(s2[:, None], (SUB, BC)), FMAX, E5, SAT, ASM),
                   m2, EVEN)
            _store(qp + 3 * K, _fp8_bytes(x3, tl.broadcast_to(s3[:, None], (SUB, BC)), FMAX, E5, SAT, ASM),
                   m3, EVEN)
        if DO_COL:
            sc, sic = _bw_scale(amc, eps, vinf_bits, FMAX, FEXP, FFRAC, POW2, ASM)
            if TILE2D:
                tl.store(cs_ptr + pc * cs_ld + pr, tl.max(sic.to(tl.int32, bitcast=True), axis=0)
                         .to(tl.float32, bitcast=True))
            else:
                tl.store(cs_ptr + pr * cs_ld + col0 + c, sic, mask=cmask)
            sc = tl.broadcast_to(sc[None, :], (SUB, BC))
            q0 = _fp8_bytes(x0, sc, FMAX, E5, SAT, ASM)
            q1 = _fp8_bytes(x1, sc, FMAX, E5, SAT, ASM)
            q2 = _fp8_bytes(x2, sc, FMAX, E5, SAT, ASM)
            q3 = _fp8_bytes(x3, sc, FMAX, E5, SAT, ASM)
            tmask = cmask[:, None] & (rows < M)[None, :]
            if PACK:  # word (k, g) of the int32 view holds rows 4g..4g+3 of column k, little-endian
                w = (q0.to(tl.uint32) | (q1.to(tl.uint32) << 8) | (q2.to(tl.uint32) << 16)
                     | (q3.to(tl.uint32) << 24)).to(tl.int32, bitcast=True)
                M4 = M // 4
                _store(cq_ptr + (col0.to(tl.int64) * M4 + row0 // 4) + (c[:, None] * M4 + i[None, :]),
                       tl.trans(w), tmask, EVEN)
            else:
                cp = cq_ptr + (col0.to(tl.int64) * M + row0) + (c[:, None] * M + (4 * i)[None, :])
                _store(cp, tl.trans(q0), tmask, EVEN)
                _store(cp + 1, tl.trans(q1), cmask[:, None] & (rows + 1 < M)[None, :], EVEN)
                _store(cp + 2, tl.trans(q2), cmask[:, None] & (rows + 2 < M)[None, :], EVEN)
                _store(cp + 3, tl.trans(q3), cmask[:, None] & (rows + 3 < M)[None, :], EVEN)

    @triton.jit(do_not_specialize=["rs_ld", "cs_ld", "eps", "vinf_bits"])
    def _bw_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits,
                   FMAX: tl.constexpr, FEXP: tl.constexpr, FFRAC: tl.constexpr, POW2: tl.constexpr,
                   E5: tl.constexpr, TILE2D: tl.constexpr, DO_ROW: tl.constexpr,
                   DO_COL: tl.constexpr, SUB: tl.constexpr, BC: tl.constexpr, PACK: tl.constexpr,
                   EVEN: tl.constexpr, OFF64: tl.constexpr, SAT: tl.constexpr, ASM: tl.constexpr):
        """Program (pr, pc) quantizes tile (pr, pc) in the usages asked for."""
        _bw_tile(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits,
                 tl.program_id(0), tl.program_id(1), FMAX, FEXP, FFRAC, POW2, E5, TILE2D, DO_ROW, DO_COL, SUB, BC, PACK,
                 EVEN, OFF64, SAT, ASM)

    @triton.jit(do_not_specialize=["rs_ld", "cs_ld", "eps", "vinf_bits"])
    def _bw_pair_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits, n_tc,
                        FMAX: tl.constexpr, FEXP: tl.constexpr, FFRAC: tl.constexpr, POW2: tl.constexpr,
                        E5: tl.constexpr, RSUB: tl.constexpr, CBC: tl.constexpr,
                        PACK: tl.constexpr, EVEN: tl.constexpr, OFF64: tl.constexpr, SAT: tl.constexpr,
                        ASM: tl.constexpr):
        """1x128, both usages, by small programs that share a 128x128 tile: of the NR + NC programs
        of tile t (n_tc tiles per tile row), the first NR = 32 / RSUB write its rowwise bytes
        (4*RSUB rows x 128 columns each), the other NC = 128 / CBC its columnwise bytes (128 rows
        x CBC columns each). They run side by side, so the tile comes from HBM once and its second
        read from L2, and no program holds the whole tile in registers."""
        NR: tl.constexpr = 32 // RSUB
        NC: tl.constexpr = 128 // CBC
        p = tl.program_id(0)
        t = p // (NR + NC)
        j = p % (NR + NC)
        tr = t // n_tc
        tc = t % n_tc
        if j < NR:
            _bw_tile(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits,
                     tr * NR + j, tc, FMAX, FEXP, FFRAC, POW2, E5, False, True, False, RSUB, 128, PACK, EVEN,
                     OFF64, SAT, ASM)
        else:
            _bw_tile(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits,
                     tr, tc * NC + (j - NR), FMAX, FEXP, FFRAC, POW2, E5, False, False, True, 32, CBC, PACK,
                     EVEN, OFF64, SAT, ASM)

    @triton.jit(do_not_specialize=["rs_ld", "cs_ld"])
    def _mx_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld,
                   FMAX: tl.constexpr, RCP: tl.constexpr, E5: tl.constexpr,
                   DO_ROW: tl.constexpr, DO_COL: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
                   OFF64: tl.constexpr, SAT: tl.constexpr, ASM: tl.constexpr):
        """MXFP8 (M, K multiples of 32). Program (pr, pc) reads rows pr*32:+32 of NB 32-column
        blocks from block pc*NB on, once, as one [32, NB, 32] tile (row, block, column in block):
        the max over the last axis is the amax of a 1x32 rowwise block, the max over the first
        axis that of a 32x1 columnwise block. The tile is loaded and stored as [32, NB*32]: in
        that layout a thread holds a few rows of a few columns, so both maxima take few lane
        shuffles (loaded as [32, NB, 32], a thread held 16 columns of 2 rows and the column
        maxima took two shuffles per element).
        Rowwise: data [M, K], E8M0 grid [.., rs_ld] element [m, kb]; columnwise: data [M, K]
        (not transposed), E8M0 grid [.., cs_ld] element [mb, k]."""
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        r = tl.arange(0, 32)
        b = tl.arange(0, NB)
        c = tl.arange(0, 32)
        if OFF64:
            r = r.to(tl.int64)
        row0 = pr * 32
        kb = pc * NB + b  # 32-column block index
        bmask = kb * 32 < K
        cc = tl.arange(0, NB * 32)
        offs = (row0.to(tl.int64) * K + pc * NB * 32) + (r[:, None] * K + cc[None, :])
        mask3 = (pc * NB * 32 + cc < K)[None, :]
        x = tl.reshape(_load(x_ptr + offs, mask3, EVEN), (32, NB, 32))
        a = _abs(x)
        if DO_COL:  # both reductions first: |x| need not outlive them
            amc = tl.max(a, axis=0)  # [NB, 32]
        if DO_ROW:
            e, s = _mx_scale(tl.max(a, axis=2), RCP, ASM)  # [32, NB]
            tl.store(rs_ptr + (row0 + r)[:, None] * rs_ld + kb[None, :], e.to(tl.uint8),
                     mask=bmask[None, :])
            q = _fp8_bytes(x, tl.broadcast_to(s[:, :, None], (32, NB, 32)), FMAX, E5, SAT, ASM)
            _store(rq_ptr + offs, tl.reshape(q, (32, NB * 32)), mask3, EVEN)
        if DO_COL:
            e, s = _mx_scale(amc, RCP, ASM)
            tl.store(cs_ptr + pr * cs_ld + (kb[:, None] * 32 + c[None, :]), e.to(tl.uint8),
                     mask=bmask[:, None])
            q = _fp8_bytes(x, tl.broadcast_to(s[None, :, :], (32, NB, 32)), FMAX, E5, SAT, ASM)
            _store(cq_ptr + offs, tl.reshape(q, (32, NB * 32)), mask3, EVEN)


# ------------------------------------------------------------------------------------------------
# launch helpers
# ------------------------------------------------------------------------------------------------

#: tiles and warps per recipe/usage (SUB: rows per sub-tile, a program reads 4*SUB rows; BC:
#: columns; NB: 32-column blocks per MXFP8 program; PAIR: _bw_pair_kernel, whose rowwise programs
#: read 4*RSUB rows and columnwise programs CBC columns); tools/bench_quantize.py --sweep times others.
CONFIG = {
    "1x128_both": {"PAIR": True, "RSUB": 16, "CBC": 32, "num_warps": 2},
    "1x128_row": {"SUB": 8, "BC": 128, "num_warps": 4},
    "1x128_col": {"SUB": 32, "BC": 64, "num_warps": 4},
    "128x128": {"num_warps": 4},
    "mxfp8": {"NB": 4, "num_warps": 1},
}

# launch options that keep the arithmetic IEEE (dropped if this Triton does not know them)
_EXTRA_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


class _Plan:
    """One launch for one call signature: the kernel, its grid and constexprs, the shapes of the
    storage tensors and the scalar arguments; after the first launch also the CompiledKernel,
    which later calls launch directly (Triton's argument binding and specialisation are then
    skipped, about half of the host time of a call)."""

    __slots__ = ("kernel", "grid", "meta", "outputs", "scalars", "pack", "compiled", "tail")

    def __init__(self, kernel, grid, meta, outputs, scalars, pack):
        self.kernel, self.grid, self.meta = kernel, (grid[0], grid[1], 1), meta
        self.outputs = outputs  # (shape, dtype, zero-filled) of rq, rs, cq, cs; None: not written
        self.scalars, self.pack = scalars, pack
        self.compiled = self.tail = None

    def launch(self, args):
        global _EXTRA_OPTIONS
        if self.compiled is not None:
            self.compiled[self.grid](*args, *self.tail)
            return
        if _EXTRA_OPTIONS and not _INTERPRET:
            try:
                compiled = self.kernel[self.grid](*args, **self.meta, **_EXTRA_OPTIONS)
            except KeyError as exc:  # "Keyword argument ... was specified but unrecognised"
                if "unrecognised" not in str(exc) and "unrecognized" not in str(exc):
                    raise
                _EXTRA_OPTIONS = {}
                compiled = self.kernel[self.grid](*args, **self.meta)
        else:
            compiled = self.kernel[self.grid](*args, **self.meta)
        if not _INTERPRET:  # a CompiledKernel takes every parameter, constexprs included, in order
            self.tail = tuple(self.meta[n] for n in self.kernel.arg_names[len(args):])
            self.compiled = compiled


#: plans by call signature (input dtype, shape, 16-byte alignment and device, recipe arguments,
#: math mode and tile config: everything the launch depends on)
_PLANS: dict = {}
_MAX_PLANS = 4096


def _exponent_and_fraction(v: float) -> tuple[int, int]:
    """Unbiased exponent and the 23 fraction bits of a normal fp32 value."""
    b = torch.tensor(v, dtype=torch.float32).view(torch.int32).item()
    return ((b >> 23) & 0xFF) - 127, b & 0x7FFFFF


def _hardware_satfinite(device: torch.device) -> bool:
    """The fp32 -> fp8 cast saturates and writes NaN as 0x7F by itself (sm_89+)."""
    return not _INTERPRET and torch.cuda.get_device_capability(device) >= (8, 9)


def _make_plan(x2, recipe, block, fp8, pow2, eps, rowwise, columnwise, cfg) -> _Plan:
    M, K = x2.shape
    u8, f32 = torch.uint8, torch.float32
    flags = dict(FMAX=FP8_MAX[fp8], E5=fp8 == "e5m2", DO_ROW=rowwise, DO_COL=columnwise,
                 SAT=_hardware_satfinite(x2.device), ASM=get_math_mode() == "asm",
                 OFF64=BLOCK_LEN * max(M, K) > _INT32_LIMIT)  # else in-tile offsets are int32

    def grid_spec(rows, cols, used_rows, used_cols, dtype):  # zero-filled where it has padding
        return (rows, cols), dtype, (rows, cols) != (used_rows, used_cols)

    if recipe == "mxfp8":
        nkb = K // MX_BLOCK_LEN
        rs = grid_spec(_pad_to(M, 128), _pad_to(nkb, 4), M, nkb, u8)
        cs = grid_spec(_pad_to(M // MX_BLOCK_LEN, 4), _pad_to(K, 128), M // MX_BLOCK_LEN, K, u8)
        outputs = (((M, K), u8, False) if rowwise else None, rs if rowwise else None,
                   ((M, K), u8, False) if columnwise else None, cs if columnwise else None)
        return _Plan(_mx_kernel, (M // MX_BLOCK_LEN, _ceil_div(nkb, cfg["NB"])),
                     dict(flags, RCP=FP8_RCP_MAX[fp8], EVEN=nkb % cfg["NB"] == 0, **cfg),
                     outputs, (rs[0][1] if rowwise else 0, cs[0][1] if columnwise else 0), False)
    cfg = dict(cfg)
    pair = cfg.pop("PAIR", False) and rowwise and columnwise
    Mb, Kb = _ceil_div(M, BLOCK_LEN), _ceil_div(K, BLOCK_LEN)
    if block == "1x128":
        rs = grid_spec(Kb, _pad_to(M, 4), Kb, M, f32)
        cs = grid_spec(Mb, _pad_to(K, 4), Mb, K, f32)
        if pair:
            if 32 % cfg["RSUB"] or BLOCK_LEN % cfg["CBC"]:
                raise ValueError(f"bad 1x128 pair config {cfg}: RSUB must divide 32 and CBC {BLOCK_LEN}")
        elif (rowwise and cfg["BC"] != BLOCK_LEN) or (columnwise and 4 * cfg["SUB"] != BLOCK_LEN):
            raise ValueError(f"bad 1x128 tile config {cfg}: the blocked dim must be {BLOCK_LEN}")
    else:
        rs = grid_spec(Mb, _pad_to(Kb, 4), Mb, Kb, f32)
        cs = grid_spec(Kb, _pad_to(Mb, 4), Kb, Mb, f32)
        cfg = dict(cfg, SUB=BLOCK_LEN // 4, BC=BLOCK_LEN)
    pack = columnwise and M % 4 == 0  # columnwise bytes written as 32-bit words of four rows
    outputs = (((M, K), u8, False) if rowwise else None, rs if rowwise else None,
               ((K, M), u8, False) if columnwise else None, cs if columnwise else None)
    eps32 = float(torch.tensor(eps, dtype=torch.float32)) if eps else 0.0  # the fp32 value torch uses
    vinf = _VINF_BITS[x2.dtype] & (_SIGN_EXP_MASK if pow2 else -1)
    fexp, ffrac = _exponent_and_fraction(FP8_MAX[fp8])
    flags = dict(flags, FEXP=fexp, FFRAC=ffrac, POW2=pow2)
    if pair and block == "1x128":
        meta = dict(flags, PACK=pack, EVEN=M % BLOCK_LEN == 0 and K % BLOCK_LEN == 0, **cfg)
        del meta["DO_ROW"], meta["DO_COL"]
        per_tile = 32 // cfg["RSUB"] + BLOCK_LEN // cfg["CBC"]
        return _Plan(_bw_pair_kernel, (per_tile * Mb * Kb, 1), meta, outputs,
                     (rs[0][1], cs[0][1], eps32, vinf, Kb),
                     pack)
    BR = 4 * cfg["SUB"]
    return _Plan(_bw_kernel, (_ceil_div(M, BR), _ceil_div(K, cfg["BC"])),
                 dict(flags, TILE2D=block == "128x128", PACK=pack, EVEN=M % BR == 0 and K % cfg["BC"] == 0,
                      **cfg),
                 outputs, (rs[0][1] if rowwise else 0, cs[0][1] if columnwise else 0, eps32,
                           vinf), pack)


def triton_parts(x2: torch.Tensor, recipe: str, block: str, fp8: str, pow2: bool, eps: float,
                 rowwise: bool, columnwise: bool) -> dict:
    """Storage tensors of a contiguous 2-D input, exactly as ``quantize._quantize_parts``."""
    reason = triton_unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"Triton quantizer unavailable: {reason}")
    if x2.dim() != 2 or not x2.is_contiguous():
        raise ValueError("triton_parts expects a contiguous 2-D tensor")
    M, K = x2.shape
    if M == 0 or K == 0:  # nothing to launch: the torch path handles the empty layouts
        from .quantize import _quantize_parts  # does not dispatch back for an empty input
        return _quantize_parts(x2, recipe, block, fp8, pow2, eps, rowwise, columnwise)
    if block == "128x128" and not rowwise:
        # the columnwise copy is the exact transpose of the rowwise one (docs/spec/te.md 1.4), as in the
        # torch path; the kernel's columnwise-only variant gave wrong bytes for partial tiles
        # with Triton 3.6 on an H200
        from .quantize import _transpose_2d_parts
        row = triton_parts(x2, recipe, block, fp8, pow2, eps, True, False)
        data, scale = _transpose_2d_parts(row["rowwise_data"], row["rowwise_scale_inv"], M, K)
        return {"columnwise_data": data, "columnwise_scale_inv": scale}
    cfg = CONFIG["mxfp8" if recipe == "mxfp8" else "128x128" if block == "128x128" else
                 "1x128_both" if rowwise and columnwise else "1x128_row" if rowwise else "1x128_col"]
    dev = x2.device
    key = (x2.dtype, M, K, x2.data_ptr() % 16 == 0, dev, recipe, block, fp8, pow2, eps, rowwise,
           columnwise, _math_mode, tuple(cfg.items()))
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        plan = _PLANS[key] = _make_plan(x2, recipe, block, fp8, pow2, eps, rowwise, columnwise, cfg)
    rq, rs, cq, cs = (x2 if spec is None else  # x2: a placeholder the kernel never touches
                      (torch.zeros if spec[2] else torch.empty)(spec[0], dtype=spec[1], device=dev)
                      for spec in plan.outputs)
    plan.launch((x2, rq, rs, cq.view(torch.int32) if plan.pack else cq, cs, M, K, *plan.scalars))
    parts = {}
    if rowwise:
        parts["rowwise_data"], parts["rowwise_scale_inv"] = rq, rs
    if columnwise:
        parts["columnwise_data"], parts["columnwise_scale_inv"] = cq, cs
    return parts


def quantize_triton(x: torch.Tensor, recipe: str, *, block=None, fp8_dtype="e4m3",
                    pow2_scales: bool = True, eps: float = 0.0, rowwise: bool = True,
                    columnwise: bool = True) -> QuantizedTensor:
    """Same contract and bytes as :func:`parity.fp8.quantize.quantize`, computed by Triton kernels.

    Needs a CUDA tensor and an importable triton (or ``TRITON_INTERPRET=1`` and a CPU tensor).
    """
    if not (x.is_cuda or _INTERPRET):
        raise ValueError(f"quantize_triton needs a CUDA tensor, got device {x.device}")
    x2, recipe, block, fp8, eps = prepare_args(x, recipe, block, fp8_dtype, pow2_scales, eps,
                                               rowwise, columnwise)
    parts = triton_parts(x2, recipe, block, fp8, bool(pow2_scales), eps, rowwise, columnwise)
    return wrap_parts(x, parts, recipe, block, fp8, pow2_scales, eps, rowwise, columnwise)
