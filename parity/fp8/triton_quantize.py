"""Triton kernels for the blockwise (1x128 / 128x128) and MXFP8 quantizers, byte-identical to the
torch reference in :mod:`parity.fp8.quantize` (spec: docs/spec/te.md sections 1.2, 1.3, 2.2, 2.3).

One launch per call and one read of the input: each program loads one tile of ``x`` into registers
and writes, from those registers, the rowwise and the columnwise FP8 bytes and both scale grids
(NaN-ignoring block amax, the scale rule of te.md 1.2 or the E8M0 exponent of te.md 2.2, the fp32
multiply, the saturating round-to-nearest-even cast and the canonical NaN byte 0x7F). Storage
tensors have exactly the layout and zero padding of :mod:`parity.fp8.quantize`.

    quantize_triton(x, recipe, *, block=None, fp8_dtype="e4m3", pow2_scales=True, eps=0.0,
                    rowwise=True, columnwise=True) -> QuantizedTensor
    triton_available() -> bool

``parity.fp8.quantize.quantize`` routes CUDA inputs here by default (``PARITY_TRITON_QUANTIZE=0``
keeps the torch path); tests/test_fp8_triton.py checks the bytes against the torch path.

Exactness notes (all must hold for bit-identical results):

* bf16/fp16 are widened to fp32 exactly; |x| and the NaN test are integer bit operations, and the
  block amax is an int32 max over the bit patterns of |x| (non-negative floats order like their
  bits), so no float min/max NaN semantics are involved.
* Triton's ``/`` on fp32 lowers to the approximate ``div.full.f32``; the two divisions of the scale
  rule use ``div.rn.f32`` through inline PTX (math mode "asm", default), or ``tl.math.div_rn``
  (math mode "tl"). The multiply uses ``mul.rn.f32`` (no FMA contraction, no flush to zero:
  subnormal inputs and the subnormal E8M0 multiplier 2^-127 matter). Select the mode with the
  environment variable ``PARITY_TRITON_MATH=asm|tl`` or :func:`set_math_mode`.
* Kernels are launched with ``enable_fp_fusion=False`` and ``enable_reflect_ftz=False`` (dropped
  automatically if the installed Triton does not know these options).
* The fp8 cast is ``.to(tl.float8e4nv / tl.float8e5, fp_downcast_rounding="rtne")`` after a clamp
  to +-fp8max (on sm_90 this is ``cvt.rn.satfinite``); NaN inputs are then forced to byte 0x7F
  (x * scale is NaN exactly when x is: every scale is finite and non-zero).

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


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


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
    return "tl" if _interpreting() else _math_mode


_cuda_ok = None  # torch.cuda.is_available(), asked once (it does not change within a process)


def triton_unavailable_reason():
    """None when the Triton path can run here, else a short reason."""
    global _cuda_ok
    if _TRITON_IMPORT_ERROR is not None:
        return f"triton is not importable ({_TRITON_IMPORT_ERROR})"
    if _interpreting():
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
    def _abs_bits(x):
        """int32 bits of |x| with NaN -> 0: non-negative floats order like their bits, so an
        integer max of these is the NaN-ignoring amax."""
        ab = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        return tl.where(ab > 0x7F800000, 0, ab)

    @triton.jit
    def _bw_scale(amax, eps, vinf_bits, pow2_mask, FMAX: tl.constexpr, ASM: tl.constexpr):
        """(scale, scale_inv) fp32 from NaN-free non-negative fp32 amax (te.md 1.2).

        eps: fp32 amax epsilon (0 is a no-op: amax >= +0); vinf_bits: fp32 bits of the input
        dtype's max; pow2_mask: 0xFF800000 (as int32) for power-of-two scales, else -1.
        """
        a = tl.where(amax < eps, eps, amax)
        ab = a.to(tl.int32, bitcast=True)
        unit = (ab == 0x7F800000) | (ab == 0)  # a is never NaN and never -0 here
        s = _div_rn(FMAX, a, ASM)
        sb = s.to(tl.int32, bitcast=True)
        sb = tl.where(sb == 0x7F800000, vinf_bits, sb)
        sb = sb & pow2_mask  # pow2: keep sign and exponent, clear the mantissa
        sb = tl.where(unit, 0x3F800000, sb)
        scale = sb.to(tl.float32, bitcast=True)
        scale_inv = _div_rn(1.0, scale, ASM)
        return scale, scale_inv

    @triton.jit
    def _mx_scale(amax, RCP: tl.constexpr, ASM: tl.constexpr):
        """(E8M0 exponent int32, multiplier 2^(127-e) fp32) from fp32 amax (te.md 2.2)."""
        v = _mul_rn(amax, RCP, ASM)
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
    def _fp8_bytes(x, s, FMAX: tl.constexpr, E5: tl.constexpr, ASM: tl.constexpr):
        """uint8 bits of Q(RN32(x * s)): clamp, RNE cast, NaN -> 0x7F (s is finite and > 0, so
        x * s is NaN exactly when x is)."""
        y = _mul_rn(x, s, ASM)
        nan = y != y
        y = tl.minimum(tl.maximum(y, -FMAX), FMAX)
        if E5:
            q = y.to(tl.float8e5, fp_downcast_rounding="rtne")
        else:
            q = y.to(tl.float8e4nv, fp_downcast_rounding="rtne")
        return tl.where(nan, 0x7F, q.to(tl.uint8, bitcast=True)).to(tl.uint8)

    @triton.jit(do_not_specialize=["rs_ld", "cs_ld", "eps", "vinf_bits", "pow2_mask"])
    def _bw1d_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits, pow2_mask,
                     FMAX: tl.constexpr, E5: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr,
                     BR: tl.constexpr, BC: tl.constexpr, EVEN: tl.constexpr, OFF64: tl.constexpr,
                     ASM: tl.constexpr):
        """1x128 blocks. Program (pr, pc) reads the tile x[pr*BR:+BR, pc*BC:+BC] of x [M, K] once.

        DO_ROW (needs BC == 128): the amax of each tile row is its 1x128 block (row, kb = pc);
        data [M, K], scale_inv grid [Kb, rs_ld] element [kb, m].
        DO_COL (needs BR == 128): the amax of each tile column is its 128x1 block (mb = pr, col);
        data transposed [K, M], scale_inv grid [Mb, cs_ld] element [mb, k].
        """
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        r = tl.arange(0, BR)
        c = tl.arange(0, BC)
        if OFF64:
            r = r.to(tl.int64)
            c = c.to(tl.int64)
        row0 = pr * BR
        col0 = pc * BC
        rmask = row0 + r < M
        cmask = col0 + c < K
        x = _load(x_ptr + (row0.to(tl.int64) * K + col0) + (r[:, None] * K + c[None, :]),
                  rmask[:, None] & cmask[None, :], EVEN)
        a = _abs_bits(x)
        if DO_ROW:
            s, sinv = _bw_scale(tl.max(a, axis=1).to(tl.float32, bitcast=True), eps, vinf_bits,
                                pow2_mask, FMAX, ASM)
            q = _fp8_bytes(x, tl.broadcast_to(s[:, None], (BR, BC)), FMAX, E5, ASM)
            _store(rq_ptr + (row0.to(tl.int64) * K + col0) + (r[:, None] * K + c[None, :]), q,
                   rmask[:, None] & cmask[None, :], EVEN)
            tl.store(rs_ptr + pc * rs_ld + row0 + r, sinv, mask=rmask)
        if DO_COL:
            s, sinv = _bw_scale(tl.max(a, axis=0).to(tl.float32, bitcast=True), eps, vinf_bits,
                                pow2_mask, FMAX, ASM)
            q = _fp8_bytes(x, tl.broadcast_to(s[None, :], (BR, BC)), FMAX, E5, ASM)
            _store(cq_ptr + (col0.to(tl.int64) * M + row0) + (c[:, None] * M + r[None, :]), tl.trans(q),
                   cmask[:, None] & rmask[None, :], EVEN)
            tl.store(cs_ptr + pr * cs_ld + col0 + c, sinv, mask=cmask)

    @triton.jit(do_not_specialize=["rs_ld", "cs_ld", "eps", "vinf_bits", "pow2_mask"])
    def _bw2d_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld, eps, vinf_bits, pow2_mask,
                     FMAX: tl.constexpr, E5: tl.constexpr, DO_ROW: tl.constexpr, DO_COL: tl.constexpr,
                     B: tl.constexpr, EVEN: tl.constexpr, OFF64: tl.constexpr, ASM: tl.constexpr):
        """128x128 tiles, one program per tile (pm, pk): one scale for the tile; the bytes go to
        the rowwise data [M, K] and/or transposed to the columnwise data [K, M]; scale_inv to
        grid [Mb, rs_ld] element [pm, pk] and/or grid [Kb, cs_ld] element [pk, pm]."""
        pm = tl.program_id(0)
        pk = tl.program_id(1)
        r = tl.arange(0, B)
        c = tl.arange(0, B)
        if OFF64:
            r = r.to(tl.int64)
            c = c.to(tl.int64)
        row0 = pm * B
        col0 = pk * B
        rmask = row0 + r < M
        cmask = col0 + c < K
        x = _load(x_ptr + (row0.to(tl.int64) * K + col0) + (r[:, None] * K + c[None, :]),
                  rmask[:, None] & cmask[None, :], EVEN)
        am = tl.max(_abs_bits(x), axis=1)
        am = tl.zeros_like(am) + tl.max(am, axis=0)  # the tile amax in every lane (exact int add)
        s, sinv = _bw_scale(am.to(tl.float32, bitcast=True), eps, vinf_bits, pow2_mask, FMAX, ASM)
        q = _fp8_bytes(x, tl.broadcast_to(s[:, None], (B, B)), FMAX, E5, ASM)
        sinv0 = tl.max(sinv.to(tl.int32, bitcast=True), axis=0).to(tl.float32, bitcast=True)
        if DO_ROW:
            _store(rq_ptr + (row0.to(tl.int64) * K + col0) + (r[:, None] * K + c[None, :]), q,
                   rmask[:, None] & cmask[None, :], EVEN)
            tl.store(rs_ptr + pm * rs_ld + pk, sinv0)
        if DO_COL:
            _store(cq_ptr + (col0.to(tl.int64) * M + row0) + (c[:, None] * M + r[None, :]), tl.trans(q),
                   cmask[:, None] & rmask[None, :], EVEN)
            tl.store(cs_ptr + pk * cs_ld + pm, sinv0)

    @triton.jit(do_not_specialize=["rs_ld", "cs_ld"])
    def _mx_kernel(x_ptr, rq_ptr, rs_ptr, cq_ptr, cs_ptr, M, K, rs_ld, cs_ld,
                   FMAX: tl.constexpr, RCP: tl.constexpr, E5: tl.constexpr,
                   DO_ROW: tl.constexpr, DO_COL: tl.constexpr, NB: tl.constexpr, EVEN: tl.constexpr,
                   OFF64: tl.constexpr, ASM: tl.constexpr):
        """MXFP8 (M, K multiples of 32). Program (pr, pc) reads rows pr*32:+32 of NB 32-column
        blocks from block pc*NB on as one [32, NB, 32] tile (row, block, column in block): the
        max over the last axis is the amax of a 1x32 rowwise block, the max over the first axis
        that of a 32x1 columnwise block.
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
        offs = (row0.to(tl.int64) * K + pc * NB * 32) + (r[:, None, None] * K + b[None, :, None] * 32
                                                        + c[None, None, :])
        mask3 = bmask[None, :, None]
        x = _load(x_ptr + offs, mask3, EVEN)
        a = _abs_bits(x)
        if DO_ROW:
            e, s = _mx_scale(tl.max(a, axis=2).to(tl.float32, bitcast=True), RCP, ASM)  # [32, NB]
            q = _fp8_bytes(x, tl.broadcast_to(s[:, :, None], (32, NB, 32)), FMAX, E5, ASM)
            _store(rq_ptr + offs, q, mask3, EVEN)
            tl.store(rs_ptr + (row0 + r)[:, None] * rs_ld + kb[None, :], e.to(tl.uint8),
                     mask=bmask[None, :])
        if DO_COL:
            e, s = _mx_scale(tl.max(a, axis=0).to(tl.float32, bitcast=True), RCP, ASM)  # [NB, 32]
            q = _fp8_bytes(x, tl.broadcast_to(s[None, :, :], (32, NB, 32)), FMAX, E5, ASM)
            _store(cq_ptr + offs, q, mask3, EVEN)
            tl.store(cs_ptr + pr * cs_ld + (kb[:, None] * 32 + c[None, :]), e.to(tl.uint8),
                     mask=bmask[:, None])


# ------------------------------------------------------------------------------------------------
# launch helpers
# ------------------------------------------------------------------------------------------------

#: tile shapes and warps per recipe/usage; tools/bench_quantize.py --configs times alternatives.
CONFIG = {
    "1x128_both": dict(BR=128, BC=128, num_warps=8),
    "1x128_row": dict(BR=64, BC=128, num_warps=8),
    "1x128_col": dict(BR=128, BC=64, num_warps=8),
    "128x128": dict(num_warps=8),
    "mxfp8": dict(NB=8, num_warps=4),
}

# launch options that keep the arithmetic IEEE (dropped if this Triton does not know them)
_EXTRA_OPTIONS = {"enable_fp_fusion": False, "enable_reflect_ftz": False}


def _launch(kernel, grid, args, meta):
    global _EXTRA_OPTIONS
    if _EXTRA_OPTIONS and not _interpreting():
        try:
            return kernel[grid](*args, **meta, **_EXTRA_OPTIONS)
        except KeyError as exc:  # "Keyword argument ... was specified but unrecognised"
            if "unrecognised" not in str(exc) and "unrecognized" not in str(exc):
                raise
            _EXTRA_OPTIONS = {}
    return kernel[grid](*args, **meta)


def _grid_tensor(rows: int, cols: int, used_rows: int, used_cols: int, dtype, device):
    """Scale grid: zeros where it has padding (the kernels write only the used part)."""
    if (rows, cols) == (used_rows, used_cols):
        return torch.empty((rows, cols), dtype=dtype, device=device)
    return torch.zeros((rows, cols), dtype=dtype, device=device)


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
    dev = x2.device
    u8, f32 = torch.uint8, torch.float32
    rq = torch.empty((M, K), dtype=u8, device=dev) if rowwise else x2  # x2: an unused placeholder
    flags = dict(FMAX=FP8_MAX[fp8], E5=fp8 == "e5m2", DO_ROW=rowwise, DO_COL=columnwise,
                 ASM=get_math_mode() == "asm")
    # in-tile offsets are int32 unless a 128-row (or -column) stripe can pass 2^31 elements
    off64 = BLOCK_LEN * max(M, K) > _INT32_LIMIT

    if recipe == "mxfp8":
        nkb = K // MX_BLOCK_LEN
        cq = torch.empty((M, K), dtype=u8, device=dev) if columnwise else x2
        rs = _grid_tensor(_pad_to(M, 128), _pad_to(nkb, 4), M, nkb, u8, dev) if rowwise else x2
        cs = (_grid_tensor(_pad_to(M // MX_BLOCK_LEN, 4), _pad_to(K, 128), M // MX_BLOCK_LEN, K, u8, dev)
              if columnwise else x2)
        cfg = CONFIG["mxfp8"]
        grid = (M // MX_BLOCK_LEN, _ceil_div(nkb, cfg["NB"]))
        _launch(_mx_kernel, grid,
                (x2, rq, rs, cq, cs, M, K, rs.shape[-1], cs.shape[-1]),
                dict(flags, RCP=FP8_RCP_MAX[fp8], EVEN=nkb % cfg["NB"] == 0, OFF64=off64, **cfg))
    else:
        Mb, Kb = _ceil_div(M, BLOCK_LEN), _ceil_div(K, BLOCK_LEN)
        eps32 = float(torch.tensor(eps, dtype=torch.float32)) if eps else 0.0  # the fp32 value torch uses
        cq = torch.empty((K, M), dtype=u8, device=dev) if columnwise else x2
        scalars = (eps32, _VINF_BITS[x2.dtype], _SIGN_EXP_MASK if pow2 else -1)
        if block == "1x128":
            rs = _grid_tensor(Kb, _pad_to(M, 4), Kb, M, f32, dev) if rowwise else x2
            cs = _grid_tensor(Mb, _pad_to(K, 4), Mb, K, f32, dev) if columnwise else x2
            cfg = CONFIG["1x128_both" if rowwise and columnwise else "1x128_row" if rowwise else "1x128_col"]
            if (rowwise and cfg["BC"] != BLOCK_LEN) or (columnwise and cfg["BR"] != BLOCK_LEN):
                raise ValueError(f"bad 1x128 tile config {cfg}: the blocked dim must be {BLOCK_LEN}")
            kernel, grid = _bw1d_kernel, (_ceil_div(M, cfg["BR"]), _ceil_div(K, cfg["BC"]))
            even = M % cfg["BR"] == 0 and K % cfg["BC"] == 0
        else:
            rs = _grid_tensor(Mb, _pad_to(Kb, 4), Mb, Kb, f32, dev) if rowwise else x2
            cs = _grid_tensor(Kb, _pad_to(Mb, 4), Kb, Mb, f32, dev) if columnwise else x2
            cfg = dict(B=BLOCK_LEN, **CONFIG["128x128"])
            kernel, grid = _bw2d_kernel, (Mb, Kb)
            even = M % BLOCK_LEN == 0 and K % BLOCK_LEN == 0
        _launch(kernel, grid, (x2, rq, rs, cq, cs, M, K, rs.shape[-1], cs.shape[-1], *scalars),
                dict(flags, EVEN=even, OFF64=off64, **cfg))
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
    if not (x.is_cuda or _interpreting()):
        raise ValueError(f"quantize_triton needs a CUDA tensor, got device {x.device}")
    x2, recipe, block, fp8, eps = prepare_args(x, recipe, block, fp8_dtype, pow2_scales, eps,
                                               rowwise, columnwise)
    parts = triton_parts(x2, recipe, block, fp8, bool(pow2_scales), eps, rowwise, columnwise)
    return wrap_parts(x, parts, recipe, block, fp8, pow2_scales, eps, rowwise, columnwise)
