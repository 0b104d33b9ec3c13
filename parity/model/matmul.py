"""bf16 matmuls with fp32 accumulation, written as fp32 GEMMs of the upcast operands.

A bf16 GEMM multiplies bf16 values (exactly, in fp32), accumulates in fp32 and rounds the result
to bf16 once. An fp32 GEMM of the upcast operands followed by one rounding is the same math.
Autograd through the casts gives the backward GEMMs the same shape: fp32 GEMM, one rounding to bf16.

The fp32 GEMM's bits depend on its kernel (the order of its sums, where it fuses multiply and
add). On the CPU it runs on numpy's OpenBLAS, whose kernel set the ranks pin (``OPENBLAS_CORETYPE``,
:data:`parity.distributed.pins.CPU_PINS`): its AVX2+FMA kernels gave the same bits on Intel and AMD
CPUs and on OpenBLAS 0.3.31 and 0.3.34 (docs/spec/platform.md s1.2), 2-4x faster than MKL's
COMPATIBLE branch, the only MKL branch reproducible across CPU vendors. Not oneDNN's bf16 GEMM
either: its kernels and blocking follow the CPU's instruction set and cache sizes (the bits of the
router, the output head and Newton-Schulz changed from one CPU model to another:
docs/measurements/2026-12-01-cpu-platform-independence.md). On CUDA it is torch's (cuBLAS).

The CUDA fp32 GEMMs must run at "highest" float32 matmul precision (torch's default): at "medium"
torch hands fp32 GEMMs to bf16 kernels. :func:`mm` and :func:`addmm` ensure it; the backward of
:func:`linear` runs at the precision in effect during backward, the default.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Linear", "linear", "mm", "addmm"]


def _cpu_sgemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for fp32 CPU matrices on numpy's OpenBLAS. Both operands are made contiguous, so
    every call is the same plain (no-transpose) GEMM whatever the views' strides."""
    return torch.from_numpy(np.matmul(a.detach().contiguous().numpy(), b.detach().contiguous().numpy()))


class _CPULinear(torch.autograd.Function):
    """``x @ w^T`` for fp32 CPU tensors, forward and backward on :func:`_cpu_sgemm`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        x2 = x.reshape(-1, x.shape[-1])
        return _cpu_sgemm(x2, w.t()).reshape(*x.shape[:-1], w.shape[0])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = _cpu_sgemm(g2, w).reshape(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = _cpu_sgemm(g2.t(), x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` in ``x.dtype``, accumulated in fp32 (differentiable)."""
    if x.device.type == "cpu":
        return _CPULinear.apply(x.float(), w.float()).to(x.dtype)
    return F.linear(x.float(), w.float()).to(x.dtype)


class Linear(torch.nn.Linear):
    """``nn.Linear`` (no bias) whose forward is :func:`linear`. Called as a module, so forward
    pre-hooks (the DDP's overlapped param gather) run before its weight is read."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


@contextlib.contextmanager
def _highest():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def mm(a: torch.Tensor, b: torch.Tensor, *, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``a @ b`` accumulated in fp32, rounded once to ``out_dtype`` (default ``a.dtype``). The
    operands may be fp32 tensors that hold bf16 values: an iteration that reuses an operand then
    widens it once, not per GEMM."""
    out_dtype = out_dtype or a.dtype
    if a.device.type == "cpu":
        return _cpu_sgemm(a.float(), b.float()).to(out_dtype)
    with _highest():
        return (a.float() @ b.float()).to(out_dtype)


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float,
          out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """``beta * c + alpha * (a @ b)`` computed in fp32, rounded once to ``out_dtype`` (default
    ``c.dtype``). On the CPU the two scalings and the sum are separate fp32 operations (alpha = 1
    scales nothing: x * 1 is x); cuBLAS fuses them into its GEMM's epilogue."""
    out_dtype = out_dtype or c.dtype
    if c.device.type == "cpu":
        ab = _cpu_sgemm(a.float(), b.float())
        if alpha != 1.0:
            ab = ab * alpha
        return (ab if beta == 0 else c.float() * beta + ab).to(out_dtype)  # beta = 0 ignores c, as torch does
    with _highest():
        return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(out_dtype)
