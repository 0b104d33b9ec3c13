"""Blockwise / MXFP8 quantizers: handcrafted blocks, an independent slow reference, layouts,
in-place requantization and the 2D columnwise rebuild."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from parity.fp8 import QuantizedTensor, is_quantized_tensor, quantize

F32 = torch.float32
BF16 = torch.bfloat16
FP8MAX = {"e4m3": 448.0, "e5m2": 57344.0}
MAXBYTE = {"e4m3": 0x7E, "e5m2": 0x7B}
VINF_BITS = {torch.bfloat16: 0x7F7F0000, torch.float16: 0x477FE000, torch.float32: 0x7F7FFFFF}


# ---------------------------------------------------------------------------------------------
# independent slow reference: one block at a time, scalar numpy float32 arithmetic,
# pow2 via frexp, E8M0 via frexp, fp8 cast via an explicit table of all codes
# ---------------------------------------------------------------------------------------------

def _np_f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


def _fp8_table(fmt):
    eb, mb, bias = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}[fmt]
    codes = np.arange(0, MAXBYTE[fmt] + 1)
    vals = []
    for c in codes:
        e, m = int(c) >> mb, int(c) & ((1 << mb) - 1)
        vals.append(math.ldexp(m, 1 - bias - mb) if e == 0 else math.ldexp((1 << mb) + m, e - bias - mb))
    return codes, np.array(vals)


_TABLES = {f: _fp8_table(f) for f in ("e4m3", "e5m2")}


def ref_cast(y: np.ndarray, fmt: str) -> np.ndarray:
    codes, vals = _TABLES[fmt]
    y = np.asarray(y, dtype=np.float32).astype(np.float64)
    nan = np.isnan(y)
    a = np.minimum(np.abs(np.where(nan, 0.0, y)), vals[-1])
    hi = np.clip(np.searchsorted(vals, a), 0, len(vals) - 1)
    lo = np.maximum(hi - 1, 0)
    dlo, dhi = a - vals[lo], vals[hi] - a
    pick = np.where(dhi < dlo, hi, np.where(dlo < dhi, lo, np.where(codes[hi] % 2 == 0, hi, lo)))
    mag = codes[pick].astype(np.uint8)
    out = np.where(np.signbit(y), mag | 0x80, mag).astype(np.uint8)
    return np.where(nan, np.uint8(0x7F), out).astype(np.uint8)


def ref_block_scale(blk: np.ndarray, fmt, src_dtype, pow2, eps):
    """(scale, scale_inv) as np.float32 for one block of fp32 values (TE kernel rule)."""
    finite_or_inf = blk[~np.isnan(blk)]
    a = np.float32(np.abs(finite_or_inf).max()) if finite_or_inf.size else np.float32(0.0)
    eps32 = np.float32(eps)
    if a < eps32:
        a = eps32
    if a == np.inf or a == 0:
        return np.float32(1.0), np.float32(1.0)
    with np.errstate(over="ignore", divide="ignore"):
        s = np.float32(FP8MAX[fmt]) / a
    if np.isinf(s):
        s = _np_f32(VINF_BITS[src_dtype])
    if pow2:
        _, ex = math.frexp(float(s))
        s = np.float32(math.ldexp(1.0, ex - 1))
    return s, np.float32(1.0) / s


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("src_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_scale_math_matches_the_reference_at_the_edges(fmt, src_dtype, pow2, eps):
    """blockwise_scale_from_amax on amaxes at every fp32 magnitude (random bit patterns spread
    over all exponents, subnormals included) and at the special points (0, inf, the 2^127 scale
    cap, the Vinf clamp, fp8max itself) gives the slow reference's bits for scale and scale_inv."""
    from parity.fp8.quantize import blockwise_scale_from_amax

    g = np.random.default_rng(7)
    bits = (g.integers(0, 255, 600, dtype=np.uint32) << 23) | g.integers(0, 1 << 23, 600, dtype=np.uint32)
    special = [0.0, 1e-45, 1e-40, 2.0 ** -126, 448 * 2.0 ** -127, 2.0 ** -123, 2.0 ** -122, 1.0,
               448.0, 57344.0, 3.0e38, 3.4028235e38, math.inf]
    amax = np.concatenate([bits.view(np.float32), np.array(special, dtype=np.float32)])
    s, si = blockwise_scale_from_amax(torch.from_numpy(amax.copy()), fmt, src_dtype, pow2_scales=pow2, eps=eps)
    want = [ref_block_scale(np.array([a], dtype=np.float32), fmt, src_dtype, pow2, eps) for a in amax]
    want_bits = np.array([[np.float32(x).view(np.uint32) for x in w] for w in want], dtype=np.uint32)
    assert amax.size == 613 and np.isinf(amax).sum() == 1
    assert np.array_equal(s.numpy().view(np.uint32), want_bits[:, 0])
    assert np.array_equal(si.numpy().view(np.uint32), want_bits[:, 1])


def ref_blockwise_dir(x: np.ndarray, bm: int, bk: int, fmt, src_dtype, pow2, eps):
    """Quantize fp32 array x [M, K] with bm x bk blocks: (bytes [M, K], scale_inv [ceil(M/bm), ceil(K/bk)])."""
    M, K = x.shape
    Mb, Kb = -(-M // bm), -(-K // bk)
    y = np.zeros((M, K), dtype=np.float32)
    sinv = np.zeros((Mb, Kb), dtype=np.float32)
    for i in range(Mb):
        for j in range(Kb):
            blk = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            s, si = ref_block_scale(blk, fmt, src_dtype, pow2, eps)
            with np.errstate(over="ignore", invalid="ignore"):
                y[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = blk * s  # float32 * float32
            sinv[i, j] = si
    return ref_cast(y, fmt), sinv


def ref_e8m0(a: np.float32, fmt) -> int:
    v = np.float32(a) * np.float32(1.0 / FP8MAX[fmt])
    if np.isnan(v):
        return 255
    if np.isinf(v):
        return 254
    if v == 0:
        return 0
    m, ex = math.frexp(float(v))  # v = m * 2^ex, 0.5 <= m < 1
    k = ex - 1 if m == 0.5 else ex  # ceil(log2 v)
    return max(0, min(254, k + 127))


def ref_mx_dir(x: np.ndarray, bm: int, bk: int, fmt):
    M, K = x.shape
    y = np.zeros((M, K), dtype=np.float32)
    e = np.zeros((M // bm, K // bk), dtype=np.uint8)
    for i in range(M // bm):
        for j in range(K // bk):
            blk = x[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk]
            vals = blk[~np.isnan(blk)]
            a = np.float32(np.abs(vals).max()) if vals.size else np.float32(0)
            ei = ref_e8m0(a, fmt)
            s = np.float32(math.ldexp(1.0, 127 - ei))
            with np.errstate(over="ignore", invalid="ignore"):
                y[i * bm:(i + 1) * bm, j * bk:(j + 1) * bk] = blk * s
            e[i, j] = ei
    return ref_cast(y, fmt), e


def _pad(grid: np.ndarray, r: int, c: int) -> np.ndarray:
    out = np.zeros((r, c), dtype=grid.dtype)
    out[: grid.shape[0], : grid.shape[1]] = grid
    return out


def p4(n):
    return -(-n // 4) * 4


def p128(n):
    return -(-n // 128) * 128


def reference_parts(x: torch.Tensor, recipe, block, fmt, pow2, eps) -> dict:
    """All four storage tensors in TE's layout, from the slow reference."""
    src_dtype = x.dtype
    x2 = x.reshape(-1, x.shape[-1]).float().numpy()
    M, K = x2.shape
    if recipe == "mxfp8":
        rq, re = ref_mx_dir(x2, 1, 32, fmt)
        cq, ce = ref_mx_dir(x2, 32, 1, fmt)
        return {"rowwise_data": rq, "rowwise_scale_inv": _pad(re, p128(M), p4(K // 32)),
                "columnwise_data": cq, "columnwise_scale_inv": _pad(ce, p4(M // 32), p128(K))}
    if block == "1x128":
        rq, rs = ref_blockwise_dir(x2, 1, 128, fmt, src_dtype, pow2, eps)          # rs [M, Kb]
        cq, cs = ref_blockwise_dir(x2.T.copy(), 1, 128, fmt, src_dtype, pow2, eps)  # of x^T: [K, Mb]
        return {"rowwise_data": rq, "rowwise_scale_inv": _pad(rs.T, rs.shape[1], p4(M)),
                "columnwise_data": cq, "columnwise_scale_inv": _pad(cs.T, cs.shape[1], p4(K))}
    rq, rs = ref_blockwise_dir(x2, 128, 128, fmt, src_dtype, pow2, eps)
    Mb, Kb = rs.shape
    # columnwise: quantize x^T with 128x128 tiles independently (same tiles, transposed)
    cq, cs = ref_blockwise_dir(x2.T.copy(), 128, 128, fmt, src_dtype, pow2, eps)
    return {"rowwise_data": rq, "rowwise_scale_inv": _pad(rs, Mb, p4(Kb)),
            "columnwise_data": cq, "columnwise_scale_inv": _pad(cs, Kb, p4(Mb))}


def bits(t) -> np.ndarray:
    if isinstance(t, torch.Tensor):
        t = t.contiguous().numpy()
    return t.view(np.int32) if t.dtype == np.float32 else t


def assert_parts_equal(q: QuantizedTensor, ref: dict, where=""):
    for name, want in ref.items():
        got = getattr(q, name)
        assert got is not None, f"{where}{name} missing"
        if name.endswith("data"):
            got = got.reshape(want.shape)
        assert tuple(got.shape) == tuple(want.shape), f"{where}{name}: {tuple(got.shape)} vs {want.shape}"
        diff = bits(got) != bits(want)
        n = int(diff.sum())
        assert n == 0, f"{where}{name}: {n} differing elements, first at {np.argwhere(diff)[0].tolist()}"


def many_scales(shape, dtype, seed, tile=(128, 128), lo=-24, hi=24):
    """Random normal values with a random power-of-two magnitude per tile (many distinct scales)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    M, K = x.shape
    tm, tk = -(-M // tile[0]), -(-K // tile[1])
    mags = torch.randint(lo, hi, (tm, tk), generator=g).double()
    mags = mags.repeat_interleave(tile[0], 0)[:M].repeat_interleave(tile[1], 1)[:, :K]
    x = x * torch.exp2(mags) * (1 + 0.1 * torch.rand(M, 1, generator=g, dtype=torch.float64))
    return x.to(dtype)


# ---------------------------------------------------------------------------------------------
# random tensors vs the slow reference, all recipes / formats / options
# ---------------------------------------------------------------------------------------------
BW_CONFIGS = [
    (block, fmt, pow2, eps, dtype)
    for block in ("1x128", "128x128")
    for fmt in ("e4m3", "e5m2")
    for pow2 in (True, False)
    for eps in (0.0, 1.0)
    for dtype in (BF16, F32)
]


@pytest.mark.parametrize("block,fmt,pow2,eps,dtype", BW_CONFIGS,
                         ids=[f"{b}-{f}-{'pow2' if p else 'f32'}-eps{e}-{str(d)[6:]}" for b, f, p, e, d in BW_CONFIGS])
def test_blockwise_random_vs_reference(block, fmt, pow2, eps, dtype):
    seed = BW_CONFIGS.index((block, fmt, pow2, eps, dtype))
    x = many_scales((200, 300), dtype, seed, tile=(64, 96), lo=-8, hi=8)
    q = quantize(x, "blockwise", block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps)
    assert_parts_equal(q, reference_parts(x, "blockwise", block, fmt, pow2, eps))


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [BF16, F32, torch.float16])
def test_mxfp8_random_vs_reference(fmt, dtype):
    lo, hi = (-10, 10) if dtype == torch.float16 else (-60, 60)
    x = many_scales((96, 160), dtype, 7, tile=(16, 8), lo=lo, hi=hi)
    q = quantize(x, "mxfp8", fp8_dtype=fmt)
    assert_parts_equal(q, reference_parts(x, "mxfp8", "1x32", fmt, True, 0.0))


def test_fp16_input_blockwise():
    x = many_scales((130, 260), torch.float16, 3, lo=-6, hi=6)
    for block in ("1x128", "128x128"):
        q = quantize(x, "blockwise", block=block, pow2_scales=False)
        assert_parts_equal(q, reference_parts(x, "blockwise", block, "e4m3", False, 0.0))


@pytest.mark.parametrize("shape", [(303, 300), (65, 96), (1, 16), (16,), (8, 32, 256), (1024, 1), (2, 3, 5, 129)])
@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_blockwise_shapes(shape, block):
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(shape, generator=g) * 3).to(BF16)
    q = quantize(x, "blockwise", block=block)
    assert q.shape == torch.Size(shape) and q.dtype == BF16
    assert q.rowwise_data.shape == torch.Size(shape)
    assert q.columnwise_data.shape == torch.Size((shape[-1],) + tuple(shape[:-1]))
    assert_parts_equal(q, reference_parts(x, "blockwise", block, "e4m3", True, 0.0), f"{shape}: ")


def test_mxfp8_nd_and_shape_errors():
    x = torch.randn(8, 32, 256, dtype=BF16)
    q = quantize(x, "mxfp8")
    assert q.rowwise_data.shape == x.shape and q.columnwise_data.shape == x.shape
    assert q.rowwise_scale_inv.shape == (256, 8) and q.columnwise_scale_inv.shape == (8, 256)
    assert_parts_equal(q, reference_parts(x, "mxfp8", "1x32", "e4m3", True, 0.0))
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(64, 48), "mxfp8")
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(3, 64), "mxfp8")
    with pytest.raises(ValueError):
        quantize(torch.randn(64, 64), "mxfp8", pow2_scales=False)
    with pytest.raises(ValueError):
        quantize(torch.randn(64, 64), "mxfp8", block="1x128")


def test_argument_errors():
    x = torch.randn(4, 128)
    with pytest.raises(ValueError):
        quantize(x, "tensorwise")
    with pytest.raises(ValueError):
        quantize(x, "blockwise", block="1x64")
    with pytest.raises(ValueError):
        quantize(x, "blockwise", fp8_dtype="e3m4")
    with pytest.raises(ValueError):
        quantize(x, "blockwise", rowwise=False, columnwise=False)
    with pytest.raises(TypeError):
        quantize(x.double(), "blockwise")
    with pytest.raises(ValueError):
        quantize(torch.tensor(1.0), "blockwise")


def test_recipe_and_block_names_are_read_in_any_case_and_alias():
    x = many_scales((128, 256), F32, 7, tile=(1, 128))
    for recipe, block, want in (("BlockWise", None, "128x128"), ("blockwise", "1", "1x128"),
                                ("blockwise", "128x1", "1x128"), ("BLOCKWISE", "2D", "128x128"),
                                ("MXFP8", "32", "1x32")):
        q = quantize(x, recipe, block=block)
        assert (q.recipe, q.block) == (recipe.lower(), want), (recipe, block)
        ref = quantize(x, recipe.lower(), block=want)
        assert torch.equal(q.rowwise_data, ref.rowwise_data) and same(q.rowwise_scale_inv, ref.rowwise_scale_inv)


def test_defaults():
    q = quantize(torch.randn(4, 128), "blockwise")
    assert (q.recipe, q.block, q.fp8_dtype, q.pow2_scales, q.eps) == ("blockwise", "128x128", "e4m3", True, 0.0)
    assert q.rowwise_scale_inv.dtype == F32 and q.rowwise_data.dtype == torch.uint8
    m = quantize(torch.randn(32, 64), "mxfp8", fp8_dtype="e5m2")
    assert (m.block, m.fp8_dtype) == ("1x32", "e5m2") and m.rowwise_scale_inv.dtype == torch.uint8


# ---------------------------------------------------------------------------------------------
# handcrafted blocks with known answers
# ---------------------------------------------------------------------------------------------

def f32bits(t: torch.Tensor):
    return t.contiguous().view(torch.int32)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality through integer views (fp32 scale grids or uint8 bytes)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == F32:
        return torch.equal(f32bits(a), f32bits(b))
    return torch.equal(a, b)


def one_tile(value, dtype=F32, shape=(128, 128)):
    return torch.full(shape, value, dtype=dtype)


@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_all_zero_block(block):
    x = one_tile(0.0)
    x[5, 7] = -0.0
    q = quantize(x, "blockwise", block=block)
    assert torch.all(f32bits(q.rowwise_scale_inv[:, :1] if block == "128x128" else q.rowwise_scale_inv) == 0x3F800000)
    assert q.rowwise_data[5, 7].item() == 0x80 and q.columnwise_data[7, 5].item() == 0x80
    assert int((q.rowwise_data != 0).sum()) == 1
    # with eps = 1 the zero block uses a = 1: scale 448 -> pow2 256, scale_inv 2^-8
    q = quantize(x, "blockwise", block=block, eps=1.0)
    assert q.rowwise_scale_inv[0, 0].item() == 2.0 ** -8
    q = quantize(x, "blockwise", block=block, eps=1.0, pow2_scales=False)
    assert f32bits(q.rowwise_scale_inv[0, :1]).item() == f32bits(torch.tensor([1.0]) / torch.tensor([448.0])).item()


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tiny_block_uses_input_max(dtype):
    # amax < 448 / FLT_MAX: the division overflows and the scale becomes the input dtype's max
    x = one_tile(1e-39, dtype)
    x[0, 0] = -2e-39
    q = quantize(x, "blockwise", block="128x128")
    assert f32bits(q.rowwise_scale_inv[0, :1]).item() == 0x00400000  # 2^-127, subnormal, kept
    ref = reference_parts(x, "blockwise", "128x128", "e4m3", True, 0.0)
    assert_parts_equal(q, ref)
    assert q.rowwise_data[1, 1].item() != 0  # 1e-39 * 2^127 ~ 0.17 is representable
    q = quantize(x, "blockwise", block="1x128", pow2_scales=False)
    s = float(torch.tensor([VINF_BITS[dtype]], dtype=torch.int32).view(F32))
    want = f32bits(torch.ones(1) / torch.tensor([s])).item()
    assert torch.all(f32bits(q.rowwise_scale_inv[0, :128]) == want)
    assert_parts_equal(q, reference_parts(x, "blockwise", "1x128", "e4m3", False, 0.0))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_dtype_max_block(dtype):
    xmax = torch.finfo(dtype).max
    x = one_tile(xmax, dtype)
    x[1] = -xmax
    q = quantize(x, "blockwise", block="128x128", fp8_dtype="e4m3")
    assert q.rowwise_scale_inv[0, 0].item() == 2.0 ** 120
    assert q.rowwise_data[0, 0].item() == 0x78 and q.rowwise_data[1, 0].item() == 0xF8  # +-256
    assert math.isinf(q.dequantize(F32)[0, 0].item())  # 256 * 2^120 = 2^128 overflows fp32
    q = quantize(x, "blockwise", block="128x128", fp8_dtype="e5m2")
    assert q.rowwise_scale_inv[0, 0].item() == 2.0 ** 113 and q.rowwise_data[0, 0].item() == 0x78
    for fmt in ("e4m3", "e5m2"):
        q = quantize(x, "blockwise", block="128x128", fp8_dtype=fmt, pow2_scales=False)
        assert q.rowwise_data[0, 0].item() == MAXBYTE[fmt] and q.rowwise_data[1, 0].item() == MAXBYTE[fmt] | 0x80
        scale = (torch.tensor([FP8MAX[fmt]]) / torch.tensor([xmax], dtype=F32))
        assert f32bits(q.rowwise_scale_inv[0, :1]).item() == f32bits(torch.ones(1) / scale).item()
    # docs/spec/te.md s1.2: bf16 / E4M3 non-pow2 scale is 1.3217166e-36, fp32 / E4M3 is 1.3165538e-36
    q = quantize(x, "blockwise", block="128x128", pow2_scales=False)
    expect = 1.3217166e-36 if dtype == BF16 else 1.3165538e-36
    assert abs(1.0 / q.rowwise_scale_inv[0, 0].item() / expect - 1) < 1e-6


def test_saturation_on_rounded_up_scale():
    # non-pow2: s = RN32(448 / a) can round up so that RN32(a * s) is one fp32 ulp above 448; the
    # byte must still be +-max (0x7E), not NaN. Round-to-nearest-even gives that by itself (the
    # midpoint to the next step is 464): this pins the edge, while the clamp's own effect, for
    # values past that midpoint, is checked by test_inf_block (e5m2) and test_fp8_formats'
    # test_cast_specials.
    found = None
    for a in np.linspace(1.0, 2.0, 20001, dtype=np.float32):
        s = np.float32(448.0) / a
        if np.float32(a * s) > np.float32(448.0):
            found = float(a)
            break
    assert found is not None
    x = one_tile(0.5, F32, (1, 128))
    x[0, 3] = found
    x[0, 4] = -found
    q = quantize(x, "blockwise", block="1x128", pow2_scales=False)
    assert q.rowwise_data[0, 3].item() == 0x7E and q.rowwise_data[0, 4].item() == 0xFE


@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_inf_block(block):
    x = one_tile(1.0, F32)
    x[0, 0] = math.inf
    x[0, 1] = -math.inf
    x[0, 2] = 1000.0
    x[0, 3] = 3.0
    q = quantize(x, "blockwise", block=block)
    assert q.rowwise_scale_inv[0, 0].item() == 1.0
    row = q.rowwise_data[0, :4].tolist()
    assert row == [0x7E, 0xFE, 0x7E, 0x44]  # inf -> +max, -inf -> -max, 1000 -> 448, 3.0 unscaled
    q5 = quantize(x, "blockwise", block=block, fp8_dtype="e5m2")
    assert q5.rowwise_data[0, :2].tolist() == [0x7B, 0xFB]
    assert_parts_equal(q, reference_parts(x, "blockwise", block, "e4m3", True, 0.0))


@pytest.mark.parametrize("block", ["1x128", "128x128"])
def test_nan_is_ignored_and_canonical(block):
    x = one_tile(0.25, F32)
    neg_nan = torch.tensor([0xFFC00000], dtype=torch.int64).to(torch.int32).view(F32)[0]
    x[0, 0] = math.nan
    x[0, 1] = neg_nan
    x[0, 2] = 3.0
    x[1, 0] = 3.0
    q = quantize(x, "blockwise", block=block)
    # amax 3 -> scale 448/3 = 149.3 -> pow2 128, scale_inv 2^-7
    assert q.rowwise_scale_inv[0, 0].item() == 2.0 ** -7
    assert q.rowwise_data[0, 0].item() == 0x7F and q.rowwise_data[0, 1].item() == 0x7F
    assert q.columnwise_data[0, 0].item() == 0x7F and q.columnwise_data[1, 0].item() == 0x7F
    # a block of NaNs only: amax 0 -> scale 1
    y = one_tile(math.nan, F32)
    qy = quantize(y, "blockwise", block=block)
    assert qy.rowwise_scale_inv[0, 0].item() == 1.0 and torch.all(qy.rowwise_data == 0x7F)
    assert_parts_equal(q, reference_parts(x, "blockwise", block, "e4m3", True, 0.0))


def test_mxfp8_specials():
    x = torch.zeros(64, 64)
    x[0, 0:32] = 1e-39       # tiny row block
    x[1, 0] = math.inf       # row block with inf -> e = 254
    x[1, 1] = 5.0
    x[2, 0] = math.nan       # NaN ignored: amax 448 -> v = 448 * RN(1/448) -> e = 127
    x[2, 1] = 448.0
    x[3, 32:64] = torch.finfo(F32).max
    q = quantize(x, "mxfp8")
    e = q.rowwise_scale_inv
    assert e[0, 0].item() == ref_e8m0(np.float32(1e-39), "e4m3")
    assert e[1, 0].item() == 254 and q.rowwise_data[1, 0].item() == 0x7E and q.rowwise_data[1, 1].item() == 0
    assert e[2, 0].item() == 127 and q.rowwise_data[2, 0].item() == 0x7F and q.rowwise_data[2, 1].item() == 0x7E
    assert e[5, 1].item() == 0  # all-zero block
    assert_parts_equal(q, reference_parts(x, "mxfp8", "1x32", "e4m3", True, 0.0))


# ---------------------------------------------------------------------------------------------
# layout properties
# ---------------------------------------------------------------------------------------------

def test_2d_columnwise_is_exact_transpose():
    x = many_scales((300, 420), BF16, 5, tile=(128, 128))
    q = quantize(x, "blockwise", block="128x128", pow2_scales=False)
    assert torch.equal(q.columnwise_data, q.rowwise_data.t())
    Mb, Kb = 3, 4
    assert q.rowwise_scale_inv.shape == (Mb, 4) and q.columnwise_scale_inv.shape == (Kb, 4)
    assert torch.equal(f32bits(q.columnwise_scale_inv[:Kb, :Mb]), f32bits(q.rowwise_scale_inv[:Mb, :Kb].t()))


def test_1x128_columnwise_is_rowwise_of_transpose():
    x = many_scales((260, 300), F32, 6, tile=(16, 16))
    q = quantize(x, "blockwise", block="1x128", pow2_scales=False)
    qt = quantize(x.t().contiguous(), "blockwise", block="1x128", pow2_scales=False, columnwise=False)
    assert torch.equal(q.columnwise_data, qt.rowwise_data)
    assert torch.equal(f32bits(q.columnwise_scale_inv), f32bits(qt.rowwise_scale_inv))
    # and it really is a different quantization from the rowwise one
    assert not torch.equal(q.columnwise_data, q.rowwise_data.t())


def test_mxfp8_columnwise_not_derivable_from_rowwise():
    x = many_scales((64, 64), F32, 9, tile=(4, 4), lo=-6, hi=6)
    q = quantize(x, "mxfp8")
    rows = q.dequantize(F32)  # from the rowwise copy
    col_e = q.columnwise_scale_inv[:2, :64]
    # re-scaling the rowwise result into the columnwise grid (any per-block multiplier: the exact
    # E8M0 one is the only candidate with the same scales) rounds twice and differs from TE's
    s = torch.pow(2.0, 127.0 - col_e.float()).repeat_interleave(32, dim=0)
    rescaled = torch.from_numpy(ref_cast((rows * s).numpy(), "e4m3"))
    assert int((rescaled != q.columnwise_data).sum()) > 0
    # while the direct quantization of the source matches the reference
    assert_parts_equal(q, reference_parts(x, "mxfp8", "1x32", "e4m3", True, 0.0))
    # and rowwise/columnwise scales really differ per element
    row_e = q.rowwise_scale_inv[:64, :2].repeat_interleave(32, dim=1)
    assert not torch.equal(row_e, col_e.repeat_interleave(32, dim=0))


@pytest.mark.parametrize("recipe,block,shape", [("blockwise", "1x128", (130, 300)), ("blockwise", "128x128", (130, 300)),
                                                ("blockwise", "1x128", (3, 5)), ("mxfp8", None, (96, 96))])
def test_scale_padding_is_zero(recipe, block, shape):
    x = torch.randn(shape) * 100 + 1
    q = quantize(x, recipe, block=block)
    M, K = shape
    Mb, Kb = -(-M // 128), -(-K // 128)
    valid = {
        "1x128": {"rowwise_scale_inv": (Kb, M), "columnwise_scale_inv": (Mb, K)},
        "128x128": {"rowwise_scale_inv": (Mb, Kb), "columnwise_scale_inv": (Kb, Mb)},
        None: {"rowwise_scale_inv": (M, K // 32), "columnwise_scale_inv": (M // 32, K)},
    }[block]
    expect_shape = {
        "1x128": {"rowwise_scale_inv": (Kb, p4(M)), "columnwise_scale_inv": (Mb, p4(K))},
        "128x128": {"rowwise_scale_inv": (Mb, p4(Kb)), "columnwise_scale_inv": (Kb, p4(Mb))},
        None: {"rowwise_scale_inv": (p128(M), p4(K // 32)), "columnwise_scale_inv": (p4(M // 32), p128(K))},
    }[block]
    padded = 0
    for name, (r, c) in valid.items():
        g = getattr(q, name)
        assert tuple(g.shape) == expect_shape[name]
        raw = g.view(torch.int32) if g.dtype == F32 else g
        mask = torch.ones_like(raw, dtype=torch.bool)
        mask[:r, :c] = False
        padded += int(mask.sum())
        assert torch.all(raw[mask] == 0), f"{name}: padding not zero"
        assert torch.all(raw[~mask] != 0), f"{name}: valid scale is zero"
    assert padded > 0, "case should have padding"


def test_usage_flags():
    x = torch.randn(256, 256)
    q = quantize(x, "blockwise", block="1x128", columnwise=False)
    assert q.columnwise_data is None and q.columnwise_scale_inv is None
    with pytest.raises(RuntimeError):
        q.gemm_operand("columnwise")
    q2 = quantize(x, "mxfp8", rowwise=False)
    assert q2.rowwise_data is None
    full = quantize(x, "mxfp8")
    assert torch.equal(q2.columnwise_data, full.columnwise_data)
    assert set(q2.raw_parts()) == {"columnwise_data", "columnwise_scale_inv"}


# ---------------------------------------------------------------------------------------------
# QuantizedTensor behaviour
# ---------------------------------------------------------------------------------------------

def test_is_quantized_tensor_and_container():
    q = quantize(torch.randn(8, 128), "blockwise")
    assert is_quantized_tensor(q)
    assert not is_quantized_tensor(torch.randn(2))

    class Fake:
        rowwise_data = None
        columnwise_data = None
        shape = (1,)

        def dequantize(self):
            return None

    assert not is_quantized_tensor(Fake())
    assert not isinstance(q, torch.Tensor)
    assert q.device == torch.device("cpu")
    assert q.nbytes == sum(t.numel() * t.element_size() for t in q.raw_parts().values())
    parts = q.raw_parts()
    assert set(parts) == {"rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv"}
    assert parts["rowwise_data"].data_ptr() != q.rowwise_data.data_ptr()
    assert all(t.is_contiguous() for t in parts.values())


@pytest.mark.parametrize("recipe,block", [("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", None)])
@pytest.mark.parametrize("usage", ["rowwise", "columnwise"])
def test_dequantize(recipe, block, usage):
    x = many_scales((160, 192), BF16, 21, tile=(32, 64), lo=-4, hi=4)
    q = quantize(x, recipe, block=block, pow2_scales=(recipe == "mxfp8"),
                 rowwise=usage == "rowwise", columnwise=usage == "columnwise")
    d = q.dequantize(F32)
    assert d.shape == x.shape and d.dtype == F32
    assert q.dequantize().dtype == BF16
    # manual: decode bytes and multiply by the per-element scale_inv
    ref = reference_parts(x, recipe, block, "e4m3", recipe == "mxfp8", 0.0)
    if recipe == "mxfp8":
        if usage == "rowwise":
            e = ref["rowwise_scale_inv"][:160, :6].repeat(32, axis=1)
            data = ref["rowwise_data"]
        else:
            e = ref["columnwise_scale_inv"][:5, :192].repeat(32, axis=0)
            data = ref["columnwise_data"]
        sinv = np.ldexp(np.float32(1.0), e.astype(np.int32) - 127).astype(np.float32)
        vals = torch.from_numpy(data).view(torch.float8_e4m3fn).float().numpy()
        want = vals * sinv
    else:
        gemm = q.gemm_operand(usage)
        vals = gemm.data.view(torch.float8_e4m3fn).float()
        want = (vals * gemm.scale_inv.repeat_interleave(128, dim=1)[:, : vals.shape[1]]).numpy()
        if usage == "columnwise":
            want = want.T
    assert np.array_equal(bits(d.numpy()), bits(np.ascontiguousarray(want, dtype=np.float32)))
    err = (d - x.float()).abs().max().item()
    assert err <= x.float().abs().max().item() * 2 ** -3


@pytest.mark.parametrize("recipe,block", [("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", None)])
def test_requantize_in_place(recipe, block):
    x0 = many_scales((256, 384), BF16, 31, tile=(64, 64))
    x1 = many_scales((256, 384), BF16, 32, tile=(64, 64))
    q = quantize(x0, recipe, block=block)
    objs = {name: getattr(q, name) for name in ("rowwise_data", "rowwise_scale_inv", "columnwise_data",
                                                 "columnwise_scale_inv")}
    ptrs = {name: t.data_ptr() for name, t in objs.items()}
    old_col = q.columnwise_data.clone()
    old_col_scale = q.columnwise_scale_inv.clone()
    out = q.requantize_(x1)
    assert out is q
    for name, t in objs.items():
        assert getattr(q, name) is t and t.data_ptr() == ptrs[name], f"{name} storage replaced"
    fresh = quantize(x1, recipe, block=block)
    assert same(q.rowwise_data, fresh.rowwise_data)
    assert same(q.rowwise_scale_inv, fresh.rowwise_scale_inv)
    if block == "128x128":
        assert q.columnwise_stale
        assert same(q.columnwise_data, old_col), "stale columnwise bytes must be left in place"
        assert same(q.columnwise_scale_inv, old_col_scale)
        assert not torch.equal(q.columnwise_data, fresh.columnwise_data)
        with pytest.raises(RuntimeError, match="stale"):
            q.gemm_operand("columnwise")
        q.post_all_gather_processing()
        assert not q.columnwise_stale
        assert q.columnwise_data is objs["columnwise_data"]
    else:
        assert not q.columnwise_stale
        q.post_all_gather_processing()  # no-op
    for name in ("columnwise_data", "columnwise_scale_inv"):
        assert same(getattr(q, name), getattr(fresh, name)), name


def test_requantize_checks_and_nd():
    x = torch.randn(4, 64, 256, dtype=BF16)
    q = quantize(x, "blockwise", block="1x128")
    y = torch.randn(4, 64, 256, dtype=BF16)
    q.requantize_(y.reshape(-1))  # same numel: reshaped to the logical shape
    assert torch.equal(q.rowwise_data, quantize(y, "blockwise", block="1x128").rowwise_data)
    with pytest.raises(ValueError):
        q.requantize_(torch.randn(5, 256))
    # the scale rule follows the source dtype (Vinf): fp32 tiny source gives FLT_MAX-based scale
    q2 = quantize(torch.zeros(1, 128, dtype=BF16), "blockwise", block="1x128", pow2_scales=False, columnwise=False)
    q2.requantize_(torch.full((1, 128), 1e-39))
    want = quantize(torch.full((1, 128), 1e-39), "blockwise", block="1x128", pow2_scales=False, columnwise=False)
    assert torch.equal(f32bits(q2.rowwise_scale_inv), f32bits(want.rowwise_scale_inv))
    # a QuantizedTensor source is dequantized first
    q3 = quantize(torch.randn(128, 128), "blockwise", block="1x128")
    src = quantize(torch.randn(128, 128) * 7, "blockwise", block="128x128")
    q3.requantize_(src)
    assert torch.equal(q3.rowwise_data, quantize(src.dequantize(), "blockwise", block="1x128").rowwise_data)
    # a source quantize() refuses is refused here too, before any byte is written
    before = q3.rowwise_data.clone()
    for bad in (torch.randn(128, 128, dtype=torch.float64), torch.ones(128, 128, dtype=torch.int32)):
        with pytest.raises(TypeError, match="bfloat16/float16/float32"):
            q3.requantize_(bad)
    assert torch.equal(q3.rowwise_data, before)


def test_post_all_gather_creates_missing_columnwise():
    x = many_scales((300, 260), F32, 41, tile=(128, 128))
    q = quantize(x, "blockwise", block="128x128", columnwise=False)
    q.post_all_gather_processing()
    full = quantize(x, "blockwise", block="128x128")
    assert torch.equal(q.columnwise_data, full.columnwise_data)
    assert torch.equal(f32bits(q.columnwise_scale_inv), f32bits(full.columnwise_scale_inv))


@pytest.mark.parametrize("recipe,block", [("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", None)])
def test_gemm_operand_layout(recipe, block):
    x = many_scales((192, 320), BF16, 51, tile=(32, 32))
    q = quantize(x, recipe, block=block)
    blk = 32 if recipe == "mxfp8" else 128
    a = q.gemm_operand("rowwise")
    assert a.data.shape == (192, 320) and a.scale_inv.shape == (192, -(-320 // blk)) and a.block_len == blk
    assert a.data.dtype == torch.uint8 and a.scale_inv.dtype == F32
    t = q.gemm_operand("columnwise")
    assert t.data.shape == (320, 192) and t.scale_inv.shape == (320, -(-192 // blk))
    assert (a.tile_2d is not None) == (block == "128x128")
    # operand of x^T dequantizes to x^T (from the columnwise copy)
    deq_t = (t.data.view(torch.float8_e4m3fn).float() * t.scale_inv.repeat_interleave(blk, 1)[:, :192])
    col_only = quantize(x, recipe, block=block, rowwise=False)
    assert torch.equal(f32bits(deq_t.t()), f32bits(col_only.dequantize(F32)))
    deq = a.data.view(torch.float8_e4m3fn).float() * a.scale_inv.repeat_interleave(blk, 1)[:, :320]
    assert torch.equal(f32bits(deq), f32bits(q.dequantize(F32)))
    with pytest.raises(ValueError):
        q.gemm_operand("both")


def test_clone_and_repr():
    q = quantize(torch.randn(128, 256), "blockwise")
    c = q.clone()
    assert c.rowwise_data.data_ptr() != q.rowwise_data.data_ptr()
    assert torch.equal(c.rowwise_data, q.rowwise_data)
    assert "usages=['rowwise', 'columnwise']" in repr(q) and "stale" not in repr(q)
    assert "usages=['rowwise']" in repr(quantize(torch.randn(128, 256), "blockwise", columnwise=False))
    assert (q.size(), q.size(0), q.size(-1), q.dim()) == (torch.Size([128, 256]), 128, 256, 2)
    # a 128x128 requantize leaves the columnwise copy stale: the flag travels with a clone, says so
    # in the repr, and both refuse the stale copy until it is rebuilt
    q.requantize_(torch.randn(128, 256))
    c = q.clone()
    assert c.columnwise_stale and "columnwise_stale=True" in repr(c)
    with pytest.raises(RuntimeError, match="stale"):
        c.gemm_operand("columnwise")
    c.post_all_gather_processing()
    assert not c.columnwise_stale and "stale" not in repr(c)


# ---------------------------------------------------------------------------------------------
# CUDA: the same bytes on the GPU as on the CPU (docs/spec/te.md 3: identical but for the NaN sign byte,
# which the canonicalisation removes)
# ---------------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("recipe,block", [("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", None)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [BF16, F32])
def test_cuda_matches_cpu(recipe, block, fmt, pow2, dtype):
    if recipe == "mxfp8" and not pow2:
        pytest.skip("mxfp8 scales are always powers of two")
    x = many_scales((384, 640), dtype, 77, tile=(128, 128), lo=-30, hi=30)
    x[:128, :128] = 0
    x[128:256, :128] = (x[128:256, :128].float() * 1e-39).to(dtype)
    x[256:, 128:256] = torch.finfo(dtype).max
    x[256:, 200] = -torch.finfo(dtype).max
    x[5, 300] = math.inf
    x[6, 301] = -math.inf
    x[7, 302] = math.nan
    x[8, 303] = -math.nan
    cpu = quantize(x, recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2)
    gpu = quantize(x.cuda(), recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2)
    assert gpu.device.type == "cuda"
    for name, t in cpu.raw_parts().items():
        g = getattr(gpu, name).cpu()
        assert same(g, t), f"{name}: {int((bits(g.numpy()) != bits(t.numpy())).sum())} differ"
    dg, dc = gpu.dequantize(F32).cpu(), cpu.dequantize(F32)
    assert torch.equal(dg.isnan(), dc.isnan())  # NaN payloads of fp32 arithmetic differ by device
    assert same(dg[~dc.isnan()], dc[~dc.isnan()])
    x2 = many_scales((384, 640), dtype, 78)
    cpu.requantize_(x2)
    gpu.requantize_(x2)  # a CPU source is moved to the tensor's device
    cpu.post_all_gather_processing()
    gpu.post_all_gather_processing()
    for name, t in cpu.raw_parts().items():
        assert same(getattr(gpu, name).cpu(), t), name


def test_fp32_input_not_modified():
    x = many_scales((130, 260), F32, 12)
    x0 = x.clone()
    for recipe, block in (("blockwise", "1x128"), ("blockwise", "128x128")):
        quantize(x, recipe, block=block)
    y = x[:128, :256].contiguous()
    y0 = y.clone()
    quantize(y, "mxfp8")
    assert same(x, x0) and same(y, y0)
