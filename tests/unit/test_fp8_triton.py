"""Triton quantizers (parity/fp8/triton_quantize.py) == torch quantizers (parity/fp8/quantize.py):
identical data bytes and scale bits (integer views) on random, partial-block, N-D and edge inputs
(all-zero blocks, amaxes just below / at / above the powers of two where a scale flips, subnormals,
+-max, +-inf, NaN, -0.0), plus the Triton arithmetic primitives against IEEE results computed by
torch on the CPU, the default dispatch to Triton on CUDA and its opt-out switch.

The GPU tests need CUDA and triton (``-m gpu``); they are skipped otherwise.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.fp8 import quantize
from parity.fp8 import triton_quantize as tq
from parity.fp8.formats import FP8_MAX, cast_to_fp8

qmod = importlib.import_module("parity.fp8.quantize")  # the module (parity.fp8.quantize is also the function)

GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and tq.triton_available()),
                       reason=f"needs CUDA and triton: {tq.triton_unavailable_reason() or 'CUDA is not available'}"),
]


def gpu(fn):
    for mark in GPU:
        fn = mark(fn)
    return fn


PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
BLOCKWISE = [("blockwise", "1x128"), ("blockwise", "128x128")]
ALL = BLOCKWISE + [("mxfp8", "1x32")]
USAGES = [(True, True), (True, False), (False, True)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    """quantize() is the torch reference inside these tests (Triton is the default on CUDA)."""
    monkeypatch.setattr(qmod, "USE_TRITON", False)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def assert_identical(x: torch.Tensor, recipe: str, **kw):
    ref = quantize(x, recipe, **kw)
    got = tq.quantize_triton(x, recipe, **kw)
    for attr in ("shape", "dtype", "recipe", "block", "fp8_dtype", "pow2_scales", "eps"):
        assert getattr(ref, attr) == getattr(got, attr), attr
    for part in PARTS:
        a, b = getattr(ref, part), getattr(got, part)
        assert (a is None) == (b is None), part
        if a is None:
            continue
        assert a.shape == b.shape and a.dtype == b.dtype, (part, a.shape, b.shape, a.dtype, b.dtype)
        neq = _bits(a) != _bits(b)
        if bool(neq.any()):
            idx = tuple(int(v) for v in neq.nonzero()[0])
            pytest.fail(f"{part}: {int(neq.sum())} differ, first at {idx}: torch {int(_bits(a)[idx]):#x} "
                        f"triton {int(_bits(b)[idx]):#x}")


def _f32(bits) -> torch.Tensor:
    """fp32 values with the given bit patterns (a list or an int64 tensor)."""
    t = bits if isinstance(bits, torch.Tensor) else torch.tensor(bits, dtype=torch.int64)
    return t.to(torch.int32).view(torch.float32)


def rand(m, k, dtype, scale=10.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).to(dtype).cuda()


def edge_input(dtype, M=512, K=640):
    """Zero tile, subnormal tile and rows, +-max tiles, +-inf, +-NaN, an all-NaN tile, a -0.0
    block, a saturating non-pow2 block, tiny ramps and random data elsewhere."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g) * 3
    x[:128, :128] = 0.0
    x[128:256, :128] = 1e-39 if dtype == torch.float32 else 1e-38  # fp32 / bf16 subnormal (fp16: 0)
    x[128:130, 128:256] = 3e-41 if dtype == torch.float32 else 1e-40
    fmax = torch.finfo(dtype).max
    x[256:384, :128] = fmax
    x[256:300, 128:256] = -fmax
    x[5, 300] = math.inf
    x[6, 301] = -math.inf
    x[7, 302] = math.nan
    x[8, 303] = _f32([0xFFC00000])[0]  # a negative NaN
    x[384:512, :128] = math.nan
    x[0:32, 512:544] = -0.0
    x[40, 512:640] = 0.5
    x[40, 515] = 1.0000001  # saturation on a rounded-up non-pow2 scale
    x[41, 512:640] = torch.linspace(-1e-30, 1e-30, 128)
    x[480:512, 600:640] = 65504.0 if dtype == torch.float16 else 1e5
    return x.to(dtype).cuda()


_INT_VIEW = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def _neighbours(v: float, dtype) -> list:
    """v rounded to dtype and its neighbours one ulp below and above (positive floats order like
    their bit patterns)."""
    bits = torch.tensor([v], dtype=dtype).view(_INT_VIEW[dtype])
    return [float((bits + d).view(dtype)[0]) for d in (-1, 0, 1)]


def pow2_edge_input(dtype, M=2048, K=2048):
    """Block amaxes at, one ulp below and one ulp above the values where a scale flips a power of
    two: fp8max * 2^k (the blockwise pow2 scale and the E8M0 exponent) and 2^k, with either sign,
    over a background far below them. Row i holds one such value at column (37 i) mod K (a
    permutation: one per row and per column), the same value throughout a 128x128 tile and a
    different one in each tile, so every 1x128 / 128x1 / 32-element block and every tile sees one."""
    finfo = torch.finfo(dtype)
    vals = []
    for base in (448.0, 57344.0, 1.0):
        for k in range(-30, 31, 3):
            v = base * 2.0 ** k
            if finfo.tiny * 4 <= v <= finfo.max / 4:
                vals += _neighbours(v, dtype)
    g = torch.Generator().manual_seed(11)
    x = (torch.rand(M, K, generator=g) - 0.5) * (finfo.tiny * 2)
    for i in range(M):
        j = (37 * i) % K
        v = vals[((i // 128) * (K // 128) + j // 128) % len(vals)]
        x[i, j] = v if i % 2 else -v
    return x.to(dtype).cuda()


# ------------------------------------------------------------------------------------------------
# byte identity with the torch reference
# ------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("recipe,block", BLOCKWISE)
@pytest.mark.parametrize("shape", [(256, 384), (303, 300), (65, 96), (1000, 1100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1.0])
def test_blockwise_random(recipe, block, shape, dtype, fmt, pow2, eps):
    assert_identical(rand(*shape, dtype), recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps)


@gpu
@pytest.mark.parametrize("shape", [(96, 160), (256, 384), (1024, 1056)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_random(shape, dtype, fmt):
    assert_identical(rand(*shape, dtype), "mxfp8", fp8_dtype=fmt)


EDGE_SETTINGS = ([(r, b, p, e) for r, b in BLOCKWISE for p in (True, False) for e in (0.0, 1.0)]
                 + [("mxfp8", "1x32", True, 0.0)])  # mxfp8: E8M0 scales, no epsilon


@gpu
@pytest.mark.parametrize("recipe,block,pow2,eps", EDGE_SETTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_edge_suite(recipe, block, pow2, eps, dtype, fmt):
    assert_identical(edge_input(dtype), recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps)


@gpu
@pytest.mark.parametrize("recipe,block,pow2,eps", EDGE_SETTINGS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_pow2_flip_suite(recipe, block, pow2, eps, dtype, fmt):
    assert_identical(pow2_edge_input(dtype), recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps)


@gpu
@pytest.mark.parametrize("recipe,block", ALL)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise,columnwise", USAGES[1:])
def test_single_usage(recipe, block, fmt, rowwise, columnwise):
    for x in (edge_input(torch.bfloat16), pow2_edge_input(torch.bfloat16), rand(96, 160, torch.float32),
              rand(1000, 1024, torch.bfloat16)):
        if recipe == "mxfp8" and x.shape[0] % 32:
            continue
        assert_identical(x, recipe, block=block, fp8_dtype=fmt, rowwise=rowwise, columnwise=columnwise)


@gpu
@pytest.mark.parametrize("recipe,block", ALL)
def test_nd_and_tiny_shapes(recipe, block):
    shapes = ([(2, 64, 96), (4, 32, 64), (32, 32)] if recipe == "mxfp8"
              else [(2, 3, 200), (300,), (1, 129), (129, 1), (1, 1), (127, 129), (2, 64, 128)])
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()
        for rowwise, columnwise in USAGES:
            assert_identical(x, recipe, block=block, rowwise=rowwise, columnwise=columnwise)


@gpu
def test_special_blocks():
    """Tiny (subnormal-scale) blocks, a block with inf, NaN-only blocks and saturation on a
    rounded-up non-pow2 scale, in every recipe."""
    x = torch.full((128, 256), 0.5)
    x[0, :128] = 1e-40
    x[1, 0] = math.inf
    x[2, :] = math.nan
    x[3, 5] = 1.0000001
    x[40:72, 128:160] = -0.0
    x = x.cuda()
    for recipe, block in ALL:
        for pow2 in ((True, False) if recipe == "blockwise" else (True,)):
            for fmt in ("e4m3", "e5m2"):
                assert_identical(x, recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2)


@gpu
@pytest.mark.parametrize("recipe,block", ALL)
def test_non_contiguous_input(recipe, block):
    x = rand(512, 384, torch.bfloat16).t()  # [384, 512], strided
    assert_identical(x, recipe, block=block)


@gpu
@pytest.mark.parametrize("mode", tq.MATH_MODES)
def test_math_modes_agree(mode):
    old = tq.get_math_mode()
    tq.set_math_mode(mode)
    try:
        for recipe, block in ALL:
            assert_identical(edge_input(torch.bfloat16), recipe, block=block)
            assert_identical(pow2_edge_input(torch.float32), recipe, block=block)
    finally:
        tq.set_math_mode(old)


# ------------------------------------------------------------------------------------------------
# dispatch: Triton is the default for CUDA inputs; requantize_ goes the same way
# ------------------------------------------------------------------------------------------------

@gpu
@pytest.mark.parametrize("recipe,block", ALL)
def test_dispatch_and_requantize(recipe, block, monkeypatch):
    x = rand(256, 384, torch.bfloat16, 5.0)
    ref = quantize(x, recipe, block=block)
    ref_rq = ref.clone().requantize_(x * 0.25)
    calls = []
    real = tq.triton_parts
    monkeypatch.setattr(tq, "triton_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(qmod, "USE_TRITON", True)
    got = quantize(x, recipe, block=block)
    got_rq = got.clone().requantize_(x * 0.25)
    assert len(calls) == 2, "quantize() and requantize_() on CUDA must run the Triton kernels"
    for part in PARTS:
        assert torch.equal(_bits(getattr(ref, part)), _bits(getattr(got, part))), part
        assert torch.equal(_bits(getattr(ref_rq, part)), _bits(getattr(got_rq, part))), part


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs CUDA and an importable triton")
def test_triton_is_the_default_where_it_imports(monkeypatch):
    """Where CUDA and triton are both present, quantize() runs the Triton kernels unless told not
    to. Not gated on triton_available(), as the other tests here are: a wrong "unavailable" would
    skip them all and the torch path would run everywhere unnoticed."""
    monkeypatch.setattr(qmod, "USE_TRITON", True)  # the default (PARITY_TRITON_QUANTIZE unset)
    assert tq.triton_unavailable_reason() is None
    calls = []
    real = tq.triton_parts
    monkeypatch.setattr(tq, "triton_parts", lambda *a, **k: calls.append(1) or real(*a, **k))
    quantize(rand(128, 256, torch.bfloat16, 1.0), "blockwise", block="1x128")
    assert calls, "the torch path ran on CUDA where triton imports"


@pytest.mark.parametrize("import_error,interpret,cuda,expected", [
    ("No module named 'triton'", False, True, "triton is not importable (No module named 'triton')"),
    (None, True, False, None),  # TRITON_INTERPRET=1 runs the kernels on the CPU
    (None, False, False, "CUDA is not available"),
    (None, False, True, None),
])
def test_why_the_triton_path_cannot_run(monkeypatch, import_error, interpret, cuda, expected):
    """Every branch of the decision, on any host (the CPU gate has no triton, so the branches a
    triton without CUDA takes are reached only here)."""
    monkeypatch.setattr(tq, "_TRITON_IMPORT_ERROR", import_error)
    monkeypatch.setattr(tq, "_INTERPRET", interpret)
    monkeypatch.setattr(tq, "_cuda_ok", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert tq.triton_unavailable_reason() == expected
    assert tq.triton_available() is (expected is None)


@pytest.mark.parametrize("value,expected", [(None, True), ("0", False)])
def test_env_switch(value, expected):
    """PARITY_TRITON_QUANTIZE=0 forces the torch path; unset selects Triton (where it can run)."""
    env = {k: v for k, v in os.environ.items() if k != "PARITY_TRITON_QUANTIZE"}
    if value is not None:
        env["PARITY_TRITON_QUANTIZE"] = value
    root = str(Path(qmod.__file__).resolve().parents[2])  # this checkout, not an installed copy
    env["PYTHONPATH"] = os.pathsep.join([root] + [p for p in [env.get("PYTHONPATH")] if p])
    code = "import importlib; print(importlib.import_module('parity.fp8.quantize').USE_TRITON)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(expected)


# ------------------------------------------------------------------------------------------------
# primitives: correctly rounded division and multiply, the saturating RNE cast
# ------------------------------------------------------------------------------------------------

if tq.triton is not None:
    tl = tq.tl

    @tq.triton.jit
    def _probe_kernel(a_ptr, b_ptr, div_ptr, mul_ptr, slash_ptr, q4_ptr, q5_ptr, N,
                      SAT: tl.constexpr, ASM: tl.constexpr, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        a = tl.load(a_ptr + i, mask=m, other=1.0)
        b = tl.load(b_ptr + i, mask=m, other=1.0)
        tl.store(div_ptr + i, tq._div_rn(a, b, ASM), mask=m)
        tl.store(mul_ptr + i, tq._mul_rn(a, b, ASM), mask=m)
        tl.store(slash_ptr + i, a / b, mask=m)  # Triton's own fp32 division (approximate)
        tl.store(q4_ptr + i, tq._fp8_bytes(a, 1.0, 448.0, False, SAT, ASM), mask=m)
        tl.store(q5_ptr + i, tq._fp8_bytes(a, 1.0, 57344.0, True, SAT, ASM), mask=m)


def _probe(a: torch.Tensor, b: torch.Tensor, mode: str, sat: bool = False) -> dict:
    n = a.numel()
    outs = {k: torch.empty(n, dtype=torch.float32, device="cuda") for k in ("div", "mul", "slash")}
    q4 = torch.empty(n, dtype=torch.uint8, device="cuda")
    q5 = torch.empty(n, dtype=torch.uint8, device="cuda")
    _probe_kernel[(triton_cdiv(n, 1024),)](a.cuda(), b.cuda(), outs["div"], outs["mul"], outs["slash"],
                                           q4, q5, n, SAT=sat, ASM=mode == "asm", BLOCK=1024,
                                           **tq._EXTRA_OPTIONS)
    return {k: v.cpu() for k, v in dict(outs, q4=q4, q5=q5).items()}


def triton_cdiv(a, b):
    return -(-a // b)


def _operands():
    """Random finite fp32 bit patterns (normal and subnormal) against the operands of the scale
    rule: fp8max and 1 over amaxes, and multipliers 2^-127 (subnormal), 2^127, 1 and random."""
    g = torch.Generator().manual_seed(3)
    rnd = torch.randint(0, 0x7F800000, (1 << 16,), generator=g, dtype=torch.int64)
    sign = torch.randint(0, 2, (1 << 16,), generator=g, dtype=torch.int64) << 31
    r = _f32(rnd | sign)
    sub = _f32(torch.randint(1, 0x00800000, (1 << 12,), generator=g, dtype=torch.int64))
    consts = _f32([0x00400000, 0x7F000000, 0x3F800000, 0x43E00000, 0x47600000])
    a = torch.cat([r, sub, r] + [torch.full_like(r[:4096], float(c)) for c in consts])
    b = torch.cat([r.roll(1), r[:sub.numel()], r.abs()] + [r[:4096].abs() for _ in consts])
    return a, b


@gpu
@pytest.mark.parametrize("mode", tq.MATH_MODES)
@pytest.mark.parametrize("sat", [False, True])
def test_primitives_match_ieee(mode, sat):
    """sat: the cast kernels use on sm_89+ (the hardware saturates and writes NaN as 0x7F);
    otherwise the explicit clamp and NaN byte."""
    if sat and not tq._hardware_satfinite(torch.device("cuda")):
        pytest.skip("the fp32 -> fp8 cast saturates in hardware on sm_89+ only")
    a, b = _operands()
    got = _probe(a, b, mode, sat)
    assert torch.equal(got["div"].view(torch.int32), torch.div(a, b).view(torch.int32))
    assert torch.equal(got["mul"].view(torch.int32), torch.mul(a, b).view(torch.int32))
    specials = _f32([0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x80000000, 0, 0x7F7FFFFF])
    y = torch.cat([a, b, a * 1e-30, a * 1e30, specials])
    q = _probe(y, torch.ones_like(y), mode, sat)
    for key, fmt in (("q4", "e4m3"), ("q5", "e5m2")):
        assert torch.equal(q[key], cast_to_fp8(y, fmt)), fmt


@gpu
def test_plain_division_would_be_caught():
    """Triton's own '/' is not correctly rounded: the probe above would fail if _div_rn used it
    (the scale rule needs IEEE division, docs/spec/te.md 1.2)."""
    a, b = _operands()
    got = _probe(a, b, "asm")
    wrong = int((got["slash"].view(torch.int32) != torch.div(a, b).view(torch.int32)).sum())
    assert wrong > 0
    fmax = torch.full_like(b, FP8_MAX["e4m3"])
    got = _probe(fmax, b.abs(), "asm")
    assert int((got["slash"].view(torch.int32) != torch.div(fmax, b.abs()).view(torch.int32)).sum()) > 0
