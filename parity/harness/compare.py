"""Bit-exact comparison of captured tensors, with ULP statistics on mismatch.

"Equal" here means *the same bits*. Both tensors are reinterpreted as integers
of the same width (``view(torch.int32)`` for fp32, ``int16`` for bf16/fp16,
``uint8`` for every 1-byte type, ...) and compared with :func:`torch.equal`.
So, unlike ``torch.equal`` or ``assert_close(rtol=0, atol=0)`` on the float
values:

* ``+0.0`` and ``-0.0`` are different;
* two NaNs with different payloads (or signs) are different;
* two NaNs with identical bits are equal.

A dtype or shape mismatch is a difference as well, reported as such (no
element statistics are computed for it).

Only when the bits differ are statistics computed: the number of differing
elements, the first differing index and its two values with their bit
patterns, NaN/Inf counts and, for floating-point dtypes, the distance in
units in the last place (ULP) with a histogram. All of it runs on the tensors'
device in bounded-size chunks (ULP distances only for the differing elements);
only a handful of integers per chunk leave it.

ULP distance
------------
Every float bit pattern is mapped onto an ordered integer line (sign-magnitude
to a monotonic integer), and the distance is the absolute difference of the
two points, computed in int64:

* ``-0.0`` and ``+0.0`` are *adjacent* points, 1 ULP apart. A sign flip of a
  zero is therefore a 1-ULP difference, and a difference that crosses zero
  costs one extra ULP (``-tiny`` to ``+tiny`` is 3 ULP: -tiny, -0, +0, +tiny).
  Formats without a negative zero (``float8_*fnuz``) do not pay that extra ULP.
* Infinity is the point right after the largest finite value.
* If either element is NaN and the bits differ, the distance is
  :data:`ULP_NAN` (the int64 maximum), which lands in the ``">100"`` bucket
  and is printed as ``NaN`` in messages.
* For fp64 a distance of :data:`ULP_SATURATED` (2^63 - 2) or more saturates
  there, so that neither marker is ever a real distance (a sign flip of the
  largest double below 2 is 2^63 - 1 ULP: it must not read as NaN).

Supported float dtypes: float64, float32, float16, bfloat16, float8_e4m3fn,
float8_e5m2, float8_e4m3fnuz, float8_e5m2fnuz and float8_e8m0fnu (unsigned,
used for MXFP8 scales). Other dtypes (integers, bool, packed fp4, complex) are
compared bit for bit, but have no ULP statistics (``max_ulp`` is ``None``).

Entry points: :func:`compare_tensors`, :func:`compare_captures`,
:func:`ulp_distance`, :func:`require_nonempty_phases`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from parity.harness.errors import MismatchError, UsageError, VacuousComparisonError
from parity.vocab import STEP_PHASES

__all__ = [
    "ULP_BUCKETS",
    "ULP_NAN",
    "ULP_SATURATED",
    "TensorDiff",
    "CaptureDiff",
    "compare_tensors",
    "compare_captures",
    "fmt_ulp",
    "ulp_distance",
    "bit_view",
    "is_ulp_dtype",
    "phase_of",
    "require_nonempty_phases",
]

# Phases in the order a step produces them; used to sort reports so that the
# first failure listed is the earliest one in the step.

# Histogram buckets (the tt-metal convention), counted over ALL elements.
ULP_BUCKETS: tuple[str, ...] = ("0", "1", "2", "3-10", "11-100", ">100")
_BUCKET_UPPER = (0, 1, 2, 10, 100)  # torch.bucketize boundaries (right-closed)

ULP_NAN: int = torch.iinfo(torch.int64).max
ULP_SATURATED: int = ULP_NAN - 1

# Elements per chunk when computing statistics. Full-chunk temporaries are
# bool masks and native-width bit views; int64 ULP work is done on the
# differing elements only. CPU: small chunks stay in cache (measured 2x faster
# than 16M); GPUs: big chunks mean fewer syncs (measured 2.5x faster than 4M).
_CHUNK = 1 << 22
_CHUNK_ACCEL = 1 << 24


def _chunk_size(device: torch.device) -> int:
    return _CHUNK if device.type == "cpu" else max(_CHUNK, _CHUNK_ACCEL)

_INT64_MAX = torch.iinfo(torch.int64).max


# --------------------------------------------------------------------------------------------
# Bit formats
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _FloatFormat:
    """How to read a float dtype's bit pattern."""

    bits: int
    """Element width in bits."""
    signed: bool
    """Whether the top bit is a sign bit (False only for E8M0)."""
    nan: str
    """NaN rule: "ieee" (magnitude above the infinity pattern), "allones"
    (every non-sign bit set, e.g. E4M3FN 0x7F), "negzero" (the bit pattern of
    -0, as in the FNUZ formats) or "unsigned-max" (E8M0 0xFF)."""
    inf: int | None
    """Magnitude bit pattern of infinity, or None if the format has none."""


def _float_formats() -> dict[torch.dtype, _FloatFormat]:
    table = {
        "float64": _FloatFormat(64, True, "ieee", 0x7FF0000000000000),
        "float32": _FloatFormat(32, True, "ieee", 0x7F800000),
        "float16": _FloatFormat(16, True, "ieee", 0x7C00),
        "bfloat16": _FloatFormat(16, True, "ieee", 0x7F80),
        "float8_e5m2": _FloatFormat(8, True, "ieee", 0x7C),
        "float8_e4m3fn": _FloatFormat(8, True, "allones", None),
        "float8_e4m3fnuz": _FloatFormat(8, True, "negzero", None),
        "float8_e5m2fnuz": _FloatFormat(8, True, "negzero", None),
        "float8_e8m0fnu": _FloatFormat(8, False, "unsigned-max", None),
    }
    # Older torch builds lack some float8 dtypes; skip those.
    return {getattr(torch, name): fmt for name, fmt in table.items() if hasattr(torch, name)}


_FORMATS = _float_formats()

# Same-width integer type used to read raw bits. One-byte types use uint8 so
# that widening to int64 gives the unsigned bit pattern directly.
_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def is_ulp_dtype(dtype: torch.dtype) -> bool:
    """Whether :func:`ulp_distance` supports ``dtype``."""
    return dtype in _FORMATS


def bit_view(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret ``t`` as a same-width integer tensor (no copy).

    Works on non-contiguous views. Complex tensors are first viewed as real,
    which appends a trailing dimension of size 2.
    """
    if t.requires_grad:  # (an op per call otherwise: the harness compares thousands per step)
        t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t.resolve_conj())
    if t.dtype == torch.bool:
        return t.view(torch.uint8)
    int_dtype = _INT_VIEW.get(t.element_size())
    if int_dtype is None:
        raise UsageError(f"cannot compare dtype {t.dtype} bit for bit: unsupported element size")
    return t if t.dtype == int_dtype else t.view(int_dtype)


def _check_tensor(t: Any, path: str, side: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise UsageError(f"{path}: {side} is a {type(t).__name__}, not a torch.Tensor")
    if type(t) not in (torch.Tensor, torch.nn.Parameter):
        raise UsageError(
            f"{path}: {side} is a tensor subclass ({type(t).__name__}); capture its raw storage "
            "fields (e.g. _data/_scale_inv or rowwise_data/rowwise_scale_inv) as plain tensors"
        )
    if t.layout != torch.strided:
        raise UsageError(f"{path}: {side} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.is_quantized:
        raise UsageError(f"{path}: {side} is a quantized tensor; capture its int_repr() and scales instead")


# --------------------------------------------------------------------------------------------
# ULP distance
# --------------------------------------------------------------------------------------------


def _sign_mag(v: torch.Tensor, fmt: _FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """Split raw bits (any int view) into (sign as bool, magnitude as int64)."""
    w = v.to(torch.int64)
    if not fmt.signed:
        return torch.zeros_like(w, dtype=torch.bool), w & ((1 << fmt.bits) - 1)
    if fmt.bits == 64:
        return w < 0, w & _INT64_MAX
    # a signed view widens sign-extended, an unsigned one zero-extended: bit (bits - 1) is the sign either way
    return (w >> (fmt.bits - 1)) & 1 != 0, w & ((1 << (fmt.bits - 1)) - 1)


def _nan_mask(sign: torch.Tensor, mag: torch.Tensor, fmt: _FloatFormat) -> torch.Tensor:
    if fmt.nan == "ieee":
        return mag > fmt.inf
    if fmt.nan == "allones":
        return mag == (1 << (fmt.bits - 1)) - 1
    if fmt.nan == "negzero":
        return sign & (mag == 0)
    return mag == (1 << fmt.bits) - 1  # unsigned-max


def _ulp_from_bits(
    va: torch.Tensor, vb: torch.Tensor, fmt: _FloatFormat
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ULP distance of two same-shape int views; also returns (nan_a, nan_b, mag_a, mag_b).

    Bit-identical elements get 0, differing ones >= 1 (the mapping is injective).
    """
    sa, ma = _sign_mag(va, fmt)
    sb, mb = _sign_mag(vb, fmt)
    same = sa == sb
    d_same = (ma - mb).abs()
    # Opposite signs: walk from a down to zero, across, and up to b. The +1
    # accounts for the -0/+0 step, absent in formats without a negative zero.
    step = 0 if fmt.nan == "negzero" else 1
    d_cross = ma + mb + step
    if fmt.bits == 64:  # only fp64 reaches the markers (and overflows int64)
        d_cross = torch.where(ma >= (ULP_SATURATED - step - mb), ULP_SATURATED, d_cross)
    d = torch.where(same, d_same, d_cross)
    nan_a = _nan_mask(sa, ma, fmt)
    nan_b = _nan_mask(sb, mb, fmt)
    differ = (ma != mb) | (sa != sb)
    d = torch.where((nan_a | nan_b) & differ, ULP_NAN, d)
    return d, nan_a, nan_b, ma, mb


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise distance in ULP between two float tensors of the same dtype and shape.

    See the module docstring for the conventions (-0/+0 adjacent, NaN =
    :data:`ULP_NAN`). Runs on ``a``'s device (``b`` is moved there if needed).

    Args:
        a: a float tensor of a supported dtype.
        b: a tensor with the same dtype and shape.

    Returns:
        An int64 tensor of the same shape.
    """
    _check_tensor(a, "ulp_distance", "a")
    _check_tensor(b, "ulp_distance", "b")
    if a.dtype != b.dtype or a.shape != b.shape:
        raise UsageError(
            f"ulp_distance needs equal dtype and shape, got {a.dtype}{tuple(a.shape)} "
            f"and {b.dtype}{tuple(b.shape)}"
        )
    fmt = _FORMATS.get(a.dtype)
    if fmt is None:
        raise UsageError(f"ulp_distance does not support dtype {a.dtype}")
    b = b.to(a.device)
    return _ulp_from_bits(bit_view(a), bit_view(b), fmt)[0]


# --------------------------------------------------------------------------------------------
# Result objects
# --------------------------------------------------------------------------------------------


def _fmt_pct(fraction: float) -> str:
    pct = 100.0 * fraction
    if pct == 0 or pct >= 1:
        return f"{pct:.1f}%" if pct < 100 else "100%"
    return f"{pct:.2g}%"


def fmt_ulp(u: int) -> str:
    """A max-ULP distance for people: a NaN difference (no distance) reads "NaN", a saturated
    float64 distance ">=2^63-2"."""
    if u == ULP_NAN:
        return "NaN"
    if u == ULP_SATURATED:
        return ">=2^63-2"
    return str(u)


def _fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    return str(v)


@dataclass(frozen=True)
class TensorDiff:
    """The outcome of comparing two tensors (see :func:`compare_tensors`).

    ``reason`` is ``"equal"``, ``"values"`` (same dtype and shape, some bits
    differ), ``"dtype"`` or ``"shape"``. Element statistics (``n_diff``,
    ``first_*``, NaN/Inf counts) are ``None`` for dtype/shape mismatches;
    ULP fields are ``None`` for dtypes without a ULP notion.
    """

    path: str
    equal: bool
    reason: str
    dtype_a: str
    dtype_b: str
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    numel: int
    n_diff: int | None = None
    max_ulp: int | None = None
    ulp_hist: dict[str, int] | None = None
    first_index: tuple[int, ...] | None = None
    first_values: tuple[Any, Any] | None = None
    first_bits: tuple[str, str] | None = None
    nan_a: int | None = None
    nan_b: int | None = None
    inf_a: int | None = None
    inf_b: int | None = None

    @property
    def fraction(self) -> float | None:
        """Share of differing elements (0 for empty tensors), or None if not computed."""
        if self.n_diff is None:
            return None
        return self.n_diff / self.numel if self.numel else 0.0

    def message(self) -> str:
        """One line naming the path and what differs (or that it is equal)."""
        if self.reason == "dtype":
            return (
                f"{self.path}: dtype differs: {self.dtype_a} vs {self.dtype_b} "
                f"(shape {self.shape_a} vs {self.shape_b})"
            )
        if self.reason == "shape":
            return f"{self.path}: shape differs: {self.shape_a} vs {self.shape_b} ({self.dtype_a})"
        if self.equal:
            return f"{self.path}: equal ({self.numel} elements, {self.dtype_a})"
        parts = [
            f"{self.path}: {self.n_diff} of {self.numel} elements differ ({_fmt_pct(self.fraction or 0.0)})"
        ]
        if self.max_ulp is not None:
            parts.append(f"max {fmt_ulp(self.max_ulp)} ULP")
        if self.ulp_hist is not None:
            inner = ", ".join(f"{k}: {v}" for k, v in self.ulp_hist.items() if v)
            parts.append(f"hist {{{inner}}}")
        if self.nan_a or self.nan_b:
            parts.append(f"NaN {self.nan_a} vs {self.nan_b}")
        if self.inf_a or self.inf_b:
            parts.append(f"Inf {self.inf_a} vs {self.inf_b}")
        if self.first_index is not None and self.first_values is not None and self.first_bits is not None:
            va, vb = self.first_values
            ba, bb = self.first_bits
            parts.append(
                f"first at {self.first_index}: {_fmt_value(va)} ({ba}) vs {_fmt_value(vb)} ({bb})"
            )
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (NaN/Inf values are written as strings)."""

        def js(v: Any) -> Any:
            if isinstance(v, float) and not math.isfinite(v):
                return repr(v)
            return v

        return {
            "path": self.path,
            "equal": self.equal,
            "reason": self.reason,
            "dtype_a": self.dtype_a,
            "dtype_b": self.dtype_b,
            "shape_a": list(self.shape_a),
            "shape_b": list(self.shape_b),
            "numel": self.numel,
            "n_diff": self.n_diff,
            "fraction": self.fraction,
            "max_ulp": self.max_ulp,
            "ulp_hist": dict(self.ulp_hist) if self.ulp_hist is not None else None,
            "first_index": list(self.first_index) if self.first_index is not None else None,
            "first_values": [js(v) for v in self.first_values] if self.first_values else None,
            "first_bits": list(self.first_bits) if self.first_bits else None,
            "nan_a": self.nan_a,
            "nan_b": self.nan_b,
            "inf_a": self.inf_a,
            "inf_b": self.inf_b,
        }


# --------------------------------------------------------------------------------------------
# compare_tensors
# --------------------------------------------------------------------------------------------


def _unravel(flat: int, shape: tuple[int, ...]) -> tuple[int, ...]:
    idx = []
    for size in reversed(shape):
        idx.append(flat % size)
        flat //= size
    return tuple(reversed(idx))


def _py_value(t: torch.Tensor) -> Any:
    """A Python scalar for a 0-dim tensor (float for every float dtype, None if it has no value)."""
    try:
        if t.is_floating_point():
            return float(t.to(torch.float64).item())
        if t.is_complex():
            return complex(t.item())
        if t.dtype == torch.bool:
            return bool(t.item())
        return int(t.item())
    except (RuntimeError, TypeError):  # e.g. packed fp4 has no scalar value
        return None


def _hex_bits(v: int, nbytes: int) -> str:
    return f"0x{v & ((1 << (8 * nbytes)) - 1):0{2 * nbytes}x}"


def _native_nonfinite(v: torch.Tensor, fmt: _FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(NaN count, Inf count) of raw bits, computed in the view's own width (no int64 copy)."""
    if fmt.nan == "negzero":
        nan = v == (1 << (fmt.bits - 1))
    elif fmt.nan == "unsigned-max":
        nan = v == (1 << fmt.bits) - 1
    else:
        mag = v & (_INT64_MAX if fmt.bits == 64 else (1 << (fmt.bits - 1)) - 1)
        if fmt.nan == "allones":
            nan = mag == (1 << (fmt.bits - 1)) - 1
        else:
            nan = mag > fmt.inf
            return torch.count_nonzero(nan), torch.count_nonzero(mag == fmt.inf)
    return torch.count_nonzero(nan), torch.zeros((), dtype=torch.int64, device=v.device)


def _chunk_stats(ca: torch.Tensor, cb: torch.Tensor, fmt: _FloatFormat | None) -> torch.Tensor:
    """Per-chunk statistics of two flat int views, as one int64 vector (stays on the device).

    Layout: [n_diff, first_diff_offset, max_ulp, hist x6, nan_a, nan_b, inf_a, inf_b].
    ULP distances are computed for the differing elements only: every equal
    element is at distance 0 and every differing one at distance >= 1.
    """
    dev = ca.device
    ne = ca != cb
    n_diff = torch.count_nonzero(ne)
    first = torch.argmax(ne.view(torch.uint8)).to(torch.int64)  # first True (0 if none)
    if fmt is None:
        rest = torch.zeros(11, dtype=torch.int64, device=dev)
        return torch.cat([n_diff.reshape(1), first.reshape(1), rest])
    d = _ulp_from_bits(ca[ne], cb[ne], fmt)[0]
    boundaries = torch.tensor(_BUCKET_UPPER, dtype=torch.int64, device=dev)
    hist = torch.bincount(torch.bucketize(d, boundaries), minlength=len(ULP_BUCKETS)).to(torch.int64)
    hist[0] += ca.numel() - n_diff
    max_d = d.max() if d.numel() else torch.zeros((), dtype=torch.int64, device=dev)
    nan_a, inf_a = _native_nonfinite(ca, fmt)
    nan_b, inf_b = _native_nonfinite(cb, fmt)
    return torch.cat(
        [n_diff.reshape(1), first.reshape(1), max_d.reshape(1), hist, torch.stack([nan_a, nan_b, inf_a, inf_b])]
    )


def _nonfinite_counts(v: torch.Tensor, fmt: _FloatFormat) -> tuple[int, int]:
    flat = v.reshape(-1)
    chunk = _chunk_size(flat.device)
    out = torch.zeros(2, dtype=torch.int64, device=v.device)
    for i in range(0, flat.numel(), chunk):
        n_nan, n_inf = _native_nonfinite(flat[i : i + chunk], fmt)
        out[0] += n_nan
        out[1] += n_inf
    n_nan, n_inf = out.tolist()
    return n_nan, n_inf


def compare_tensors(
    a: torch.Tensor, b: torch.Tensor, path: str, *, count_nonfinite: bool = False
) -> TensorDiff:
    """Compare two tensors bit for bit; compute statistics only when they differ.

    The fast path is one :func:`torch.equal` on the integer views, on ``a``'s
    device (``b`` is moved there if it lives elsewhere). On a mismatch, the
    statistics are computed on the device in chunks.

    Args:
        a: the reference tensor (e.g. the OFF run, or the golden).
        b: the tensor under test.
        path: the path id put at the front of every message, e.g.
            ``"step 12/grad_reduce/decoder.0.mlp.fc1.weight/rank 3"``.
        count_nonfinite: also count NaN/Inf when the tensors are equal (one
            extra pass over both). They are always counted on a mismatch.

    Returns:
        A :class:`TensorDiff`; ``.equal`` is the verdict.
    """
    _check_tensor(a, path, "a")
    _check_tensor(b, path, "b")
    common = dict(
        path=path,
        dtype_a=str(a.dtype),
        dtype_b=str(b.dtype),
        shape_a=tuple(a.shape),
        shape_b=tuple(b.shape),
        numel=a.numel(),
    )
    if a.dtype != b.dtype:
        return TensorDiff(equal=False, reason="dtype", **common)
    if a.shape != b.shape:
        return TensorDiff(equal=False, reason="shape", **common)
    if b.device != a.device:
        b = b.to(a.device)
    va, vb = bit_view(a), bit_view(b)
    fmt = _FORMATS.get(a.dtype)
    numel = a.numel()

    if torch.equal(va, vb):
        nan = inf = None
        if count_nonfinite and fmt is not None:
            nan, inf = _nonfinite_counts(va, fmt)
        return TensorDiff(
            equal=True,
            reason="equal",
            n_diff=0,
            max_ulp=0 if fmt is not None else None,
            ulp_hist={k: (numel if k == "0" else 0) for k in ULP_BUCKETS} if fmt is not None else None,
            nan_a=nan,
            nan_b=nan,
            inf_a=inf,
            inf_b=inf,
            **common,
        )

    fa, fb = va.reshape(-1), vb.reshape(-1)
    chunk = _chunk_size(fa.device)
    rows = [_chunk_stats(fa[i : i + chunk], fb[i : i + chunk], fmt) for i in range(0, fa.numel(), chunk)]
    stats = torch.stack(rows).tolist()  # the only device -> host transfer of statistics
    n_diff = sum(r[0] for r in stats)
    first_flat = next(i * chunk + r[1] for i, r in enumerate(stats) if r[0])
    first_index = _unravel(first_flat, tuple(va.shape))
    if va.dim() == a.dim():
        ea, eb = a.detach()[first_index], b.detach()[first_index]
        first_values = (_py_value(ea), _py_value(eb))
    else:  # complex viewed as real: report the real/imag component
        first_values = (_py_value(fa[first_flat]), _py_value(fb[first_flat]))
    nbytes = va.element_size()
    first_bits = (_hex_bits(int(fa[first_flat].item()), nbytes), _hex_bits(int(fb[first_flat].item()), nbytes))
    if fmt is None:
        return TensorDiff(
            equal=False,
            reason="values",
            n_diff=n_diff,
            first_index=first_index,
            first_values=first_values,
            first_bits=first_bits,
            **common,
        )
    hist = {k: sum(r[3 + j] for r in stats) for j, k in enumerate(ULP_BUCKETS)}
    return TensorDiff(
        equal=False,
        reason="values",
        n_diff=n_diff,
        max_ulp=max(r[2] for r in stats),
        ulp_hist=hist,
        first_index=first_index,
        first_values=first_values,
        first_bits=first_bits,
        nan_a=sum(r[9] for r in stats),
        nan_b=sum(r[10] for r in stats),
        inf_a=sum(r[11] for r in stats),
        inf_b=sum(r[12] for r in stats),
        **common,
    )


# --------------------------------------------------------------------------------------------
# compare_captures
# --------------------------------------------------------------------------------------------


def phase_of(key: str) -> str:
    """The phase part of a capture key (``"grad_reduce/x.weight"`` -> ``"grad_reduce"``)."""
    return key.split("/", 1)[0]


def _phase_rank(key: str) -> int:
    try:
        return STEP_PHASES.index(phase_of(key))
    except ValueError:
        return len(STEP_PHASES)


def _ordered_keys(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Union of keys: phase order first, then a's insertion order, then b-only keys."""
    seen: dict[str, None] = dict.fromkeys(a)
    for k in b:
        seen.setdefault(k, None)
    keys = list(seen)
    order = {k: i for i, k in enumerate(keys)}
    return sorted(keys, key=lambda k: (_phase_rank(k), order[k]))


@dataclass
class CaptureDiff:
    """The outcome of comparing two captures (see :func:`compare_captures`)."""

    prefix: str
    suffix: str
    diffs: list[TensorDiff]
    """One per key present in both captures, in phase order."""
    missing: list[str]
    """Keys present in ``a`` but absent from ``b`` (always a failure)."""
    extra: list[str]
    """Keys present in ``b`` but absent from ``a`` (a failure unless allowed)."""
    labels: tuple[str, str] = ("a", "b")
    allow_extra: bool = False
    n_elements: int = field(default=0)
    """Total number of elements compared (sum of numel over common keys)."""

    def path(self, key: str) -> str:
        """The path id of ``key`` in messages."""
        return f"{self.prefix}{key}{self.suffix}"

    @property
    def failures(self) -> list[TensorDiff]:
        """The tensor comparisons that failed, in phase order."""
        return [d for d in self.diffs if not d.equal]

    @property
    def ok(self) -> bool:
        """True when every key matched and no key was missing (or extra, unless allowed)."""
        return not self.missing and (self.allow_extra or not self.extra) and not self.failures

    @property
    def first_failure(self) -> str | None:
        """The message of the earliest failure in phase order (missing keys first within a phase)."""
        msgs = self._ordered_messages()
        return msgs[0][1] if msgs else None

    def _ordered_messages(self) -> list[tuple[tuple[int, int], str]]:
        out: list[tuple[tuple[int, int], str]] = []
        a, b = self.labels
        for k in self.missing:
            out.append(((_phase_rank(k), -1), f"{self.path(k)}: present in {a}, missing from {b}"))
        if not self.allow_extra:
            for k in self.extra:
                out.append(((_phase_rank(k), -1), f"{self.path(k)}: present in {b}, missing from {a}"))
        for i, d in enumerate(self.diffs):
            if not d.equal:
                out.append(((_phase_rank(d.path[len(self.prefix):]), i), d.message()))
        out.sort(key=lambda t: t[0])
        return out

    def messages(self) -> list[str]:
        """One line per failure (missing/extra keys and differing tensors), in phase order."""
        return [m for _, m in self._ordered_messages()]

    def summary(self) -> str:
        """One line: the verdict with counts."""
        where = f"{self.prefix}*{self.suffix}" if (self.prefix or self.suffix) else "capture"
        n_fail = len(self.failures)
        status = "OK" if self.ok else "FAIL"
        parts = [
            f"{where}: {status}: {len(self.diffs)} tensors compared ({self.n_elements} elements), {n_fail} differ"
        ]
        if self.missing:
            parts.append(f"{len(self.missing)} missing from {self.labels[1]}")
        if self.extra:
            allowed = " (allowed)" if self.allow_extra else ""
            parts.append(f"{len(self.extra)} missing from {self.labels[0]}{allowed}")
        return ", ".join(parts)

    def raise_on_failure(self) -> None:
        """Raise :class:`MismatchError` (exit code 1) with the summary and the first failure."""
        __tracebackhide__ = True
        if not self.ok:
            raise MismatchError(f"{self.summary()}; first: {self.first_failure}")


def compare_captures(
    a: Mapping[str, torch.Tensor],
    b: Mapping[str, torch.Tensor],
    *,
    prefix: str = "",
    suffix: str = "",
    labels: tuple[str, str] = ("a", "b"),
    allow_extra: bool = False,
    count_nonfinite: bool = False,
) -> CaptureDiff:
    """Compare two captures key by key, bit for bit.

    Every key of either capture is accounted for: common keys are compared
    with :func:`compare_tensors`, keys only in ``a`` are reported as missing
    (always a failure), keys only in ``b`` as extra (a failure unless
    ``allow_extra``).

    Args:
        a: the reference capture (``{"phase/name": tensor}``).
        b: the capture under test.
        prefix: put in front of every key in messages, e.g. ``"step 12/"``.
        suffix: put after every key in messages, e.g. ``"/rank 3"``.
        labels: names of ``a`` and ``b`` used in missing/extra messages.
        allow_extra: do not fail on keys present only in ``b``.
        count_nonfinite: forwarded to :func:`compare_tensors`.

    Returns:
        A :class:`CaptureDiff`.

    Raises:
        VacuousComparisonError: both captures are empty, or every compared
            tensor has zero elements, so a pass would prove nothing.
    """
    __tracebackhide__ = True
    if not a and not b:
        raise VacuousComparisonError(
            f"{prefix or 'capture'}: both captures are empty, nothing to compare; "
            "check that the capture hooks ran"
        )
    keys = _ordered_keys(a, b)
    diffs: list[TensorDiff] = []
    missing: list[str] = []
    extra: list[str] = []
    n_elements = 0
    for k in keys:
        if k not in b:
            missing.append(k)
        elif k not in a:
            extra.append(k)
        else:
            d = compare_tensors(a[k], b[k], f"{prefix}{k}{suffix}", count_nonfinite=count_nonfinite)
            diffs.append(d)
            n_elements += d.numel
    result = CaptureDiff(
        prefix=prefix,
        suffix=suffix,
        diffs=diffs,
        missing=missing,
        extra=extra,
        labels=labels,
        allow_extra=allow_extra,
        n_elements=n_elements,
    )
    if result.ok and n_elements == 0:
        raise VacuousComparisonError(
            f"{prefix or 'capture'}: all {len(diffs)} compared tensors are empty (0 elements); "
            "the comparison would prove nothing"
        )
    return result


def require_nonempty_phases(
    capture: Mapping[str, Any], phases: Iterable[str], *, where: str = "capture"
) -> dict[str, int]:
    """Check that ``capture`` has at least one tensor with elements in every phase.

    Args:
        capture: a capture (``{"phase/name": tensor}``).
        phases: the phases that must be present.
        where: how to name the capture in the error, e.g. ``"step 3/rank 0"``.

    Returns:
        The number of keys per requested phase.

    Raises:
        VacuousComparisonError: some phase has no keys (or only empty tensors).
    """
    phases = list(phases)
    if not phases:
        raise UsageError("require_nonempty_phases: no phases given")
    counts = dict.fromkeys(phases, 0)
    nonempty = dict.fromkeys(phases, False)
    for k, v in capture.items():
        p = phase_of(k)
        if p in counts:
            counts[p] += 1
            if not isinstance(v, torch.Tensor) or v.numel() > 0:
                nonempty[p] = True
    bad = [p for p in phases if not nonempty[p]]
    if bad:
        raise VacuousComparisonError(
            f"{where}: no tensors captured for phase(s) {', '.join(bad)} "
            f"(have: {', '.join(sorted({phase_of(k) for k in capture})) or 'nothing'}); "
            "a comparison would be vacuous, check the capture hooks"
        )
    return counts
