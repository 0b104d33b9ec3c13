"""Triton quantizers (parity/fp8/triton_quantize.py) == torch quantizers (parity/fp8/quantize.py):
identical data bytes and scale bits (integer views) on random, partial-block and edge inputs.

Needs CUDA and triton; skipped otherwise. tools/gpu_triton_check.py runs the same comparisons with
first-difference diagnostics, primitive probes and a throughput table.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from parity.fp8 import quantize
from parity.fp8 import triton_quantize as tq

qmod = importlib.import_module("parity.fp8.quantize")  # the module (parity.fp8.quantize is also the function)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not (torch.cuda.is_available() and tq.triton_available()),
                       reason=f"needs CUDA and triton: {tq.triton_unavailable_reason() or 'CUDA is not available'}"),
]

PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")


@pytest.fixture(autouse=True)
def _torch_reference(monkeypatch):
    """quantize() must stay the torch reference even with PARITY_TRITON_QUANTIZE=1 in the env."""
    monkeypatch.setattr(qmod, "USE_TRITON", False)
BLOCKWISE = [("blockwise", "1x128"), ("blockwise", "128x128")]
ALL = BLOCKWISE + [("mxfp8", "1x32")]


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


def edge_input(dtype, M=512, K=640):
    """Zero tile, subnormal tile, +-max tiles, inf, -inf, NaN, -NaN, all-NaN tile, -0.0 block."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g) * 3
    x[:128, :128] = 0.0
    x[128:256, :128] = 1e-39 if dtype == torch.float32 else 1e-38
    fmax = torch.finfo(dtype).max
    x[256:384, :128] = fmax
    x[256:300, 128:256] = -fmax
    x[5, 300] = math.inf
    x[6, 301] = -math.inf
    x[7, 302] = math.nan
    x[8, 303] = torch.tensor([0xFFC00000], dtype=torch.int64).to(torch.int32).view(torch.float32)[0]
    x[384:512, :128] = math.nan
    x[0:32, 512:544] = -0.0
    return x.to(dtype).cuda()


def rand(m, k, dtype, scale=10.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, k, generator=g) * scale).to(dtype).cuda()


@pytest.mark.parametrize("recipe,block", BLOCKWISE)
@pytest.mark.parametrize("shape", [(256, 384), (303, 300), (65, 96)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("eps", [0.0, 1.0])
def test_blockwise_random(recipe, block, shape, dtype, fmt, pow2, eps):
    x = rand(*shape, dtype)
    assert_identical(x, recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps)


@pytest.mark.parametrize("shape", [(96, 160), (256, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_mxfp8_random(shape, dtype, fmt):
    assert_identical(rand(*shape, dtype), "mxfp8", fp8_dtype=fmt)


EDGE_SETTINGS = ([(r, b, p, e) for r, b in BLOCKWISE for p in (True, False) for e in (0.0, 1.0)]
                 + [("mxfp8", "1x32", True, 0.0)])  # mxfp8: E8M0 scales, no epsilon


@pytest.mark.parametrize("recipe,block,pow2,eps", EDGE_SETTINGS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_edge_suite(recipe, block, pow2, eps, dtype, fmt):
    assert_identical(edge_input(dtype), recipe, block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps)


@pytest.mark.parametrize("recipe,block", ALL)
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("rowwise,columnwise", [(True, False), (False, True)])
def test_single_usage(recipe, block, fmt, rowwise, columnwise):
    for x in (edge_input(torch.bfloat16), rand(96, 160, torch.float32)):
        assert_identical(x, recipe, block=block, fp8_dtype=fmt, rowwise=rowwise, columnwise=columnwise)


@pytest.mark.parametrize("recipe,block", ALL)
def test_nd_and_tiny_shapes(recipe, block):
    shapes = [(2, 64, 96), (4, 32, 64)] if recipe == "mxfp8" else [(2, 3, 200), (300,), (1, 129), (129, 1)]
    for i, shape in enumerate(shapes):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(*shape, generator=g).to(torch.bfloat16).cuda()
        assert_identical(x, recipe, block=block)


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


@pytest.mark.parametrize("recipe,block", ALL)
def test_dispatch_and_requantize(recipe, block, monkeypatch):
    x = rand(256, 384, torch.bfloat16, 5.0)
    ref = quantize(x, recipe, block=block)
    ref_rq = ref.clone().requantize_(x * 0.25)
    monkeypatch.setattr(qmod, "USE_TRITON", True)
    got = quantize(x, recipe, block=block)
    got_rq = got.clone().requantize_(x * 0.25)
    for part in PARTS:
        assert torch.equal(_bits(getattr(ref, part)), _bits(getattr(got, part))), part
        assert torch.equal(_bits(getattr(ref_rq, part)), _bits(getattr(got_rq, part))), part


@pytest.mark.parametrize("mode", tq.MATH_MODES)
def test_math_modes_agree(mode):
    old = tq.get_math_mode()
    tq.set_math_mode(mode)
    try:
        for recipe, block in ALL:
            assert_identical(edge_input(torch.bfloat16), recipe, block=block)
    finally:
        tq.set_math_mode(old)
