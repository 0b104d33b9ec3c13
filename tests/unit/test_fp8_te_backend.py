"""Our quantizer against TransformerEngine's own quantizers, byte for byte.

Runs only where TransformerEngine (with its torch extension) and a CUDA GPU exist: the blockwise
comparison needs sm90+, the MXFP8 one sm100+ (TE compiles its MXFP8 kernels for Blackwell only).
TE leaves scale-grid padding uninitialised, so scales are compared on their valid region.
"""

from __future__ import annotations

import pytest
import torch

te = pytest.importorskip("transformer_engine", reason="TransformerEngine is not installed")
if not torch.cuda.is_available():
    pytest.skip("TransformerEngine comparisons need a CUDA GPU", allow_module_level=True)
tex = pytest.importorskip("transformer_engine_torch", reason="TransformerEngine's torch extension is missing")

from parity.fp8 import quantize  # noqa: E402

pytestmark = pytest.mark.gpu

_CC = torch.cuda.get_device_capability()
_TE_DTYPE = {"e4m3": tex.DType.kFloat8E4M3, "e5m2": tex.DType.kFloat8E5M2}


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.uint8)


def _assert_same(name, ours, theirs):
    ours, theirs = _bits(ours).cpu(), _bits(theirs).cpu()
    assert ours.shape == theirs.shape, f"{name}: shape {tuple(ours.shape)} vs TE {tuple(theirs.shape)}"
    n = int((ours != theirs).sum())
    assert n == 0, f"{name}: {n} of {ours.numel()} elements differ from TE"


def _inputs(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, generator=g, device="cuda", dtype=torch.float32)
    M, K = x.reshape(-1, shape[-1]).shape
    x2 = x.view(M, K)
    # a zero tile, a tiny tile, a huge tile, and many magnitudes
    x2 *= torch.exp2(torch.randint(-12, 12, (M, 1), generator=g, device="cuda").float())
    if M >= 256 and K >= 256:
        x2[:128, :128] = 0.0
        x2[128:256, :128] *= 1e-40
        x2[:128, 128:256] = torch.finfo(dtype).max / 2
    return x.to(dtype)


@pytest.mark.skipif(_CC < (9, 0), reason="TE blockwise FP8 needs compute capability 9.0+")
@pytest.mark.parametrize("shape", [(256, 256), (303, 300), (1024, 256), (8, 32, 256)])
@pytest.mark.parametrize("block_dim", [1, 2])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("pow2", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blockwise_matches_te(shape, block_dim, fmt, pow2, dtype):
    from transformer_engine.pytorch.tensor.float8_blockwise_tensor import (
        Float8BlockQuantizer,
    )

    x = _inputs(shape, dtype, seed=sum(shape) + block_dim)
    quantizer = Float8BlockQuantizer(_TE_DTYPE[fmt], rowwise=True, columnwise=True, amax_epsilon=0.0,
                                     force_pow_2_scales=pow2, block_scaling_dim=block_dim)
    theirs = quantizer(x)
    ours = quantize(x, "blockwise", block="1x128" if block_dim == 1 else "128x128", fp8_dtype=fmt,
                    pow2_scales=pow2)
    M, K = ours.m, ours.k
    Mb, Kb = -(-M // 128), -(-K // 128)
    _assert_same("rowwise_data", ours.rowwise_data, theirs._rowwise_data)
    _assert_same("columnwise_data", ours.columnwise_data, theirs._columnwise_data)
    if block_dim == 1:
        valid = {"rowwise": (Kb, M), "columnwise": (Mb, K)}
    else:
        valid = {"rowwise": (Mb, Kb), "columnwise": (Kb, Mb)}
    for usage, (r, c) in valid.items():
        o = getattr(ours, f"{usage}_scale_inv")
        t = getattr(theirs, f"_{usage}_scale_inv")
        assert o.shape == t.shape, f"{usage} scale grid shape {tuple(o.shape)} vs TE {tuple(t.shape)}"
        _assert_same(f"{usage}_scale_inv", o[:r, :c], t[:r, :c])


def _unswizzle(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Logical [rows, cols] E8M0 grid from cuBLAS's 128x4 swizzled layout (docs/spec/te.md 2.3)."""
    r = torch.arange(rows, device=buf.device).view(-1, 1)
    c = torch.arange(cols, device=buf.device).view(1, -1)
    tiles = cols // 4
    off = ((r // 128) * tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)
    return buf.reshape(-1)[off]


@pytest.mark.skipif(_CC < (10, 0), reason="TE's MXFP8 kernels need compute capability 10.0+")
@pytest.mark.parametrize("shape", [(128, 128), (256, 1024), (320, 320), (8, 32, 256)])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mxfp8_matches_te(shape, fmt, dtype):
    from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer

    x = _inputs(shape, dtype, seed=sum(shape))
    theirs = MXFP8Quantizer(_TE_DTYPE[fmt], rowwise=True, columnwise=True)(x)
    ours = quantize(x, "mxfp8", fp8_dtype=fmt)
    M, K = ours.m, ours.k
    _assert_same("rowwise_data", ours.rowwise_data, theirs._rowwise_data)
    _assert_same("columnwise_data", ours.columnwise_data, theirs._columnwise_data)
    swizzled = bool(getattr(theirs, "_with_gemm_swizzled_scales", False))
    for usage, (r, c) in {"rowwise": (M, K // 32), "columnwise": (M // 32, K)}.items():
        o = getattr(ours, f"{usage}_scale_inv")
        t = getattr(theirs, f"_{usage}_scale_inv")
        if swizzled:
            if usage == "rowwise":
                t = _unswizzle(t, o.shape[0], o.shape[1])
            else:  # the columnwise grid is swizzled as its transpose
                t = _unswizzle(t, o.shape[1], o.shape[0]).t()
        else:
            t = t.view(o.shape)
        _assert_same(f"{usage}_scale_inv", o[:r, :c], t[:r, :c])
