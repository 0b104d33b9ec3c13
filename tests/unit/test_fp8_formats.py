"""FP8 element formats and E8M0 helpers against independent, table/integer-based references."""

from __future__ import annotations

import math
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from parity.fp8 import formats as fm
from parity.fp8.formats import (
    FP8_MAX,
    canonical_fp8_dtype,
    cast_to_fp8,
    e8m0_from_fp32,
    e8m0_quant_scale,
    e8m0_to_fp32,
    fp8_to_fp32,
    input_dtype_max,
)

# ---------------------------------------------------------------------------------------------
# independent reference: decode every fp8 code from its bit fields, round by table search
# ---------------------------------------------------------------------------------------------
_LAYOUT = {"e4m3": (4, 3, 7), "e5m2": (5, 2, 15)}  # exponent bits, mantissa bits, bias


def _decode_code(code: int, fmt: str) -> float:
    eb, mb, bias = _LAYOUT[fmt]
    e = (code >> mb) & ((1 << eb) - 1)
    m = code & ((1 << mb) - 1)
    if e == 0:
        return math.ldexp(m, 1 - bias - mb)
    return math.ldexp((1 << mb) + m, e - bias - mb)


def _positive_table(fmt: str):
    """(codes, values) of all finite non-negative values, increasing; codes are consecutive."""
    max_code = {"e4m3": 0x7E, "e5m2": 0x7B}[fmt]
    codes = np.arange(0, max_code + 1)
    vals = np.array([_decode_code(int(c), fmt) for c in codes], dtype=np.float64)
    assert vals[-1] == FP8_MAX[fmt]
    assert np.all(np.diff(vals) > 0)
    return codes, vals


def ref_cast(y: np.ndarray, fmt: str) -> np.ndarray:
    """Saturating RNE fp32 -> fp8 by nearest-table-entry search; NaN -> 0x7F; sign of zero kept."""
    codes, vals = _positive_table(fmt)
    y = np.asarray(y, dtype=np.float32).astype(np.float64)  # exact
    out = np.zeros(y.shape, dtype=np.uint8)
    nan = np.isnan(y)
    a = np.minimum(np.abs(np.where(nan, 0.0, y)), vals[-1])
    hi = np.clip(np.searchsorted(vals, a, side="left"), 0, len(vals) - 1)  # vals[hi] >= a
    lo = np.clip(hi - 1, 0, len(vals) - 1)
    dlo, dhi = a - vals[lo], vals[hi] - a
    # codes are consecutive, so "even mantissa" == even code
    pick = np.where(dhi < dlo, hi, np.where(dlo < dhi, lo, np.where(codes[hi] % 2 == 0, hi, lo)))
    pick = np.where(vals[hi] == a, hi, pick)
    mag = codes[pick].astype(np.uint8)
    neg = np.signbit(y)
    out = np.where(neg, mag | 0x80, mag).astype(np.uint8)
    return np.where(nan, np.uint8(0x7F), out).astype(np.uint8)


def _f32_from_bits(bits) -> torch.Tensor:
    return torch.tensor(np.array(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


def _bits32(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@pytest.fixture(scope="module", params=["e4m3", "e5m2"])
def fmt(request):
    return request.param


def _probe_values(fmt: str) -> torch.Tensor:
    _, vals = _positive_table(fmt)
    mids = (vals[1:] + vals[:-1]) / 2  # exact in float64, and in fp32 (<= 6 significant bits)
    base = np.concatenate([vals, mids, [vals[-1] * 1.03125, vals[-1] * 1.0625, vals[-1] * 2, 1e30, 3.0e38]])
    f32 = torch.tensor(base, dtype=torch.float32)
    bits = f32.view(torch.int32)
    # one fp32 ulp either side of every probe (catches ties handled as "round half up" etc.)
    around = torch.cat([f32, (bits + 1).view(torch.float32), (bits - 1).clamp_min(0).view(torch.float32)])
    rng = torch.Generator().manual_seed(1)
    rand = torch.rand(4000, generator=rng) * vals[-1] * 1.2
    tiny = torch.rand(2000, generator=rng) * float(vals[1]) * 4  # subnormal region and below
    allv = torch.cat([around, rand, tiny])
    return torch.cat([allv, -allv])


def test_cast_matches_table_reference(fmt):
    y = _probe_values(fmt)
    got = cast_to_fp8(y, fmt)
    want = torch.from_numpy(ref_cast(y.numpy(), fmt))
    bad = (got != want).nonzero()
    assert bad.numel() == 0, f"{len(bad)} mismatches, e.g. y={y[bad[0]].item()!r}: {got[bad[0]]} vs {want[bad[0]]}"


def test_cast_specials(fmt):
    mx = FP8_MAX[fmt]
    max_byte = {"e4m3": 0x7E, "e5m2": 0x7B}[fmt]
    nan_neg = _f32_from_bits([0xFFC00001])[0].item()
    y = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, nan_neg, mx, -mx, mx * 1.5, -1e38,
                      # saturation boundary: the midpoint between max and the next (non-existent) step
                      {"e4m3": 464.0, "e5m2": 61440.0}[fmt], {"e4m3": 479.0, "e5m2": 65000.0}[fmt]],
                     dtype=torch.float32)
    got = cast_to_fp8(y, fmt).tolist()
    assert got[0] == 0x00 and got[1] == 0x80
    assert got[2] == max_byte and got[3] == max_byte | 0x80
    assert got[4] == 0x7F and got[5] == 0x7F, "every NaN must become the canonical byte 0x7F"
    assert got[6] == max_byte and got[7] == max_byte | 0x80
    assert got[8] == max_byte and got[9] == max_byte | 0x80
    assert got[10] == max_byte and got[11] == max_byte
    # negative underflow keeps the sign
    assert cast_to_fp8(torch.tensor([-1e-30]), fmt).item() == 0x80


def test_cast_accepts_bf16_and_rejects_f64():
    y = torch.tensor([1.0, -3.5, 1000.0], dtype=torch.bfloat16)
    assert cast_to_fp8(y, "e4m3").tolist() == cast_to_fp8(y.float(), "e4m3").tolist()
    with pytest.raises(TypeError):
        cast_to_fp8(torch.tensor([1.0], dtype=torch.float64), "e4m3")


def test_decode_roundtrip(fmt):
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    vals = fp8_to_fp32(codes, fmt)
    finite = torch.isfinite(vals)
    positive = _positive_table(fmt)[0]
    # exactly the table's codes and their negatives are finite (0x80 is -0.0)
    want_finite = [(c & 0x7F) <= positive[-1] for c in range(256)]
    assert finite.tolist() == want_finite
    ref = torch.tensor([math.copysign(_decode_code(c & 0x7F, fmt), -1.0 if c & 0x80 else 1.0) if want_finite[c]
                        else 0.0 for c in range(256)], dtype=torch.float32)
    assert torch.equal(vals[finite].view(torch.int32), ref[finite].view(torch.int32))  # bits: -0.0 included
    # every finite code round-trips through the cast
    assert torch.equal(cast_to_fp8(vals[finite], fmt), codes[finite])


def test_dtype_names():
    assert canonical_fp8_dtype("E4M3") == "e4m3"
    assert canonical_fp8_dtype(torch.float8_e5m2) == "e5m2"
    assert canonical_fp8_dtype("float8_e4m3fn") == "e4m3"
    with pytest.raises(ValueError):
        canonical_fp8_dtype("e3m4")
    assert fm.FP8_TORCH_DTYPE["e4m3"] == torch.float8_e4m3fn


def test_input_dtype_max():
    assert _bits32(input_dtype_max(torch.bfloat16)) == 0x7F7F0000
    assert input_dtype_max(torch.float16) == 65504.0
    assert _bits32(input_dtype_max(torch.float32)) == 0x7F7FFFFF
    with pytest.raises(TypeError):
        input_dtype_max(torch.float64)


def test_rcp_max_constants():
    assert _bits32(fm.FP8_RCP_MAX["e4m3"]) == 0x3B124925
    assert _bits32(fm.FP8_RCP_MAX["e5m2"]) == 0x37924925


# ---------------------------------------------------------------------------------------------
# E8M0
# ---------------------------------------------------------------------------------------------

def _ref_e8m0(v: float) -> int:
    """clamp(ceil(log2 v) + 127, 0, 254) by exact rational arithmetic; NaN 255, inf 254, 0 -> 0."""
    if math.isnan(v):
        return 255
    if math.isinf(v):
        return 254
    if v == 0:
        return 0
    fr = Fraction(v)
    k = fr.numerator.bit_length() - fr.denominator.bit_length()  # 2^k is within a factor 2 of v
    while Fraction(2) ** k < fr:
        k += 1
    while Fraction(2) ** (k - 1) >= fr:
        k -= 1
    return max(0, min(254, k + 127))


def test_e8m0_encode_bit_rule():
    rng = np.random.default_rng(3)
    edge_bits = [0x0, 0x1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF, 0x800000, 0x800001, 0x3F800000,
                 0x3F800001, 0x3F7FFFFF, 0x7F000000, 0x7F000001, 0x7F7FFFFF, 0x7F400000, 0x7F800000,
                 0x7FC00000, 0x00000002]
    rand_bits = rng.integers(0, 0x7F800000, size=3000, dtype=np.int64).tolist()
    # every exponent field with the mantissas where the rule turns (0, 1, 2**22 -+ 1, 2**23 - 1)
    fields = [(E << 23) | f for E in range(255) for f in (0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x7FFFFF)]
    bits = edge_bits + rand_bits + fields
    v = _f32_from_bits(bits)
    got = e8m0_from_fp32(v).tolist()
    want = [_ref_e8m0(x) for x in v.tolist()]
    assert got == want
    assert e8m0_from_fp32(-v).tolist() == want  # the sign bit is ignored
    nan = _f32_from_bits([0x7F800001, 0x7FC00000, 0x7FFFFFFF])
    assert e8m0_from_fp32(nan).tolist() == e8m0_from_fp32(-nan).tolist() == [255] * 3


def test_e8m0_decode_and_scale():
    e = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    dec = e8m0_to_fp32(e)
    scl = e8m0_quant_scale(e)
    for i in range(255):
        assert dec[i].item() == math.ldexp(1.0, i - 127), i
        assert scl[i].item() == math.ldexp(1.0, 127 - i), i
    assert math.isnan(dec[255].item()) and math.isnan(scl[255].item())
    assert dec.view(torch.int32)[0].item() == 0x00400000
    assert scl.view(torch.int32)[254].item() == 0x00400000
    # the pair is inverse for every finite code
    assert torch.all(dec[:255].double() * scl[:255].double() == 1.0)
