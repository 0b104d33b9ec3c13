"""FP8 element formats (E4M3, E5M2) and the E8M0 scale format, bit for bit as TE uses them.

Everything here follows docs/spec/te.md sections 0 and 2.2:

* ``cast_to_fp8`` is the saturating round-to-nearest-even fp32 -> fp8 conversion of TE's kernels
  (``__NV_SATFINITE``): finite overflow and +-inf go to +-max, the sign of zero is kept, and every
  NaN becomes the canonical byte 0x7F (the GPU's canonical NaN), on every device.
* E8M0 encode rounds the exponent *up* (TE's ``float_to_e8m0``), clamped to [0, 254].

FP8 data are carried as ``torch.uint8`` tensors holding the raw bits; view them as
``FP8_TORCH_DTYPE[name]`` to get values.
"""

from __future__ import annotations

import functools
import struct

import torch

__all__ = [
    "E4M3",
    "E5M2",
    "FP8_DTYPES",
    "FP8_MAX",
    "FP8_MAX_BYTE",
    "FP8_NAN_BYTE",
    "FP8_TORCH_DTYPE",
    "FP8_RCP_MAX",
    "E8M0_NAN",
    "canonical_fp8_dtype",
    "input_dtype_max",
    "cast_to_fp8",
    "fp8_to_fp32",
    "e8m0_from_fp32",
    "e8m0_to_fp32",
    "e8m0_quant_scale",
]

E4M3 = "e4m3"
E5M2 = "e5m2"
FP8_DTYPES = (E4M3, E5M2)

#: largest finite magnitude of each format (== torch.finfo(...).max)
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}

#: torch dtype of each format (E4M3 is the "fn" variant: no inf, NaN = S.1111.111)
FP8_TORCH_DTYPE = {E4M3: torch.float8_e4m3fn, E5M2: torch.float8_e5m2}

#: byte of +max (the byte of -max is this | 0x80)
FP8_MAX_BYTE = {E4M3: 0x7E, E5M2: 0x7B}

#: canonical NaN byte written for any NaN input (docs/spec/te.md section 0)
FP8_NAN_BYTE = 0x7F

#: ``RN32(1 / fp8max)``: 1/max computed in double and stored as float (docs/spec/te.md 2.2)
FP8_RCP_MAX = {E4M3: float(torch.tensor(1.0 / 448.0, dtype=torch.float32)),
               E5M2: float(torch.tensor(1.0 / 57344.0, dtype=torch.float32))}

#: E8M0 byte meaning NaN
E8M0_NAN = 255

_ALIASES = {
    "e4m3": E4M3, "e4m3fn": E4M3, "float8_e4m3fn": E4M3, "fp8_e4m3": E4M3,
    "e5m2": E5M2, "float8_e5m2": E5M2, "fp8_e5m2": E5M2,
}


_CANONICAL = (E4M3, E5M2)


def canonical_fp8_dtype(fp8_dtype) -> str:
    """Return "e4m3" or "e5m2" for a name (any case) or a torch float8 dtype; ValueError otherwise."""
    if fp8_dtype in _CANONICAL:  # already canonical: the hot path of every GEMM operand
        return fp8_dtype
    if isinstance(fp8_dtype, torch.dtype):
        for name, dt in FP8_TORCH_DTYPE.items():
            if dt == fp8_dtype:
                return name
        raise ValueError(f"unsupported fp8 dtype {fp8_dtype}; expected float8_e4m3fn or float8_e5m2")
    if isinstance(fp8_dtype, str):
        name = _ALIASES.get(fp8_dtype.strip().lower().replace("torch.", ""))
        if name is not None:
            return name
    raise ValueError(f"unsupported fp8 dtype {fp8_dtype!r}; expected 'e4m3' or 'e5m2'")


_INPUT_MAX_BITS = {
    torch.bfloat16: 0x7F7F0000,  # 0x1.FEp127 = 3.38953139e38
    torch.float16: 0x477FE000,   # 65504
    torch.float32: 0x7F7FFFFF,   # FLT_MAX
}


def input_dtype_max(dtype: torch.dtype) -> float:
    """Largest finite value of a high-precision input dtype, as an exact fp32 value ("Vinf", docs/spec/te.md 1.2)."""
    try:
        bits = _INPUT_MAX_BITS[dtype]
    except KeyError:
        raise TypeError(f"unsupported input dtype {dtype}; expected bfloat16, float16 or float32") from None
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def cast_to_fp8(y: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Q(y): saturating RNE cast of fp32 values to fp8 bits (uint8 tensor of the same shape).

    Finite values beyond the max and +-inf become +-max; -0.0 and negative underflow keep the sign
    (0x80); NaN (either sign, any payload) becomes 0x7F. bf16/fp16 inputs are widened exactly first;
    other dtypes are refused (a float64 -> fp32 step would round twice).
    """
    name = canonical_fp8_dtype(fp8_dtype)
    if y.dtype in (torch.bfloat16, torch.float16):
        y = y.float()
    elif y.dtype != torch.float32:
        raise TypeError(f"cast_to_fp8 expects float32 input, got {y.dtype}")
    fmax = FP8_MAX[name]
    # torch's own fp32 -> fp8 conversion is RNE (subnormals included) but maps overflow to NaN
    # (E4M3) or inf (E5M2); clamping first gives the saturating behaviour. clamp keeps -0.0 and NaN.
    q = torch.clamp(y, -fmax, fmax).to(FP8_TORCH_DTYPE[name]).view(torch.uint8)
    # After the clamp no byte can be inf, so every byte whose magnitude bits exceed +max's byte is a
    # NaN encoding (E4M3: 0x7F/0xFF; E5M2: 0x7D..0x7F/0xFD..0xFF). Canonicalise on the byte tensor,
    # which is cheaper than testing the fp32 input for NaN.
    nan = (q & 0x7F) > FP8_MAX_BYTE[name]
    return q.masked_fill_(nan, FP8_NAN_BYTE)


def fp8_to_fp32(data: torch.Tensor, fp8_dtype) -> torch.Tensor:
    """Decode fp8 bits (uint8) to fp32 values (exact)."""
    name = canonical_fp8_dtype(fp8_dtype)
    if data.dtype != torch.uint8:
        raise TypeError(f"fp8 data must be uint8 bits, got {data.dtype}")
    return data.view(FP8_TORCH_DTYPE[name]).float()


_E8M0_CEIL_OFFSET = (1 << 52) - 1 - ((1023 - 127) << 52)


def e8m0_from_fp32(v: torch.Tensor) -> torch.Tensor:
    """E8M0 biased exponent of ``v`` rounded *up* to a power of two (docs/spec/te.md 2.2), as uint8.

    Meant for v >= 0 (the sign bit is ignored). NaN -> 255; +inf -> 254; 0 -> 0; otherwise
    ``clamp(ceil(log2 v) + 127, 0, 254)``: with E the exponent field and F the mantissa field,
    e = E + 1 if F > 0 and E != 254 and not (E == 0 and F <= 2**22), else E.
    """
    if v.dtype != torch.float32:
        raise TypeError(f"e8m0_from_fp32 expects float32, got {v.dtype}")
    # In float64 every fp32 value is normal, subnormals included, so one carry rule covers them
    # all: adding 2**52 - 1 to |v|'s bits carries into the exponent field exactly when the mantissa
    # is nonzero, which leaves ceil(log2 |v|) + 1023 there; _E8M0_CEIL_OFFSET also moves the bias
    # to 127. Below 2**-127 that is <= 0, above 2**127 (and +inf) >= 255: both clamp.
    bits = v.double().abs_().view(torch.int64)
    e = ((bits + _E8M0_CEIL_OFFSET) >> 52).clamp_(0, 254)
    return e.masked_fill_(torch.isnan(v), 255).to(torch.uint8)


# E8M0 byte -> fp32 bits of 2**(e - 127) (e = 0: 2**-127, a subnormal) and of its quantization
# multiplier 2**(127 - e) (biased exponent 254 - e; e = 254: 2**-127); 255 is NaN in both.
_E8M0_BITS = {
    "value": [0x00400000] + [e << 23 for e in range(1, 255)] + [0x7FC00000],
    "quant_scale": [(254 - e) << 23 for e in range(254)] + [0x00400000, 0x7FC00000],
}


@functools.lru_cache(maxsize=None)
def _e8m0_table(kind: str, device: torch.device) -> torch.Tensor:
    return torch.tensor(_E8M0_BITS[kind], dtype=torch.int32, device=device).view(torch.float32)


def e8m0_to_fp32(e: torch.Tensor) -> torch.Tensor:
    """Decode E8M0 bytes to the fp32 value 2**(e - 127) (e = 0 -> 2**-127, a subnormal; 255 -> NaN)."""
    if e.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 bytes, got {e.dtype}")
    return _e8m0_table("value", e.device)[e.long()]  # a lookup: one op where the bit rule takes six


def e8m0_quant_scale(e: torch.Tensor) -> torch.Tensor:
    """Quantization multiplier 2**(127 - e) as fp32 (e = 254 -> 2**-127, e = 0 -> 2**127, 255 -> NaN)."""
    if e.dtype != torch.uint8:
        raise TypeError(f"E8M0 scales must be uint8 bytes, got {e.dtype}")
    return _e8m0_table("quant_scale", e.device)[e.long()]
