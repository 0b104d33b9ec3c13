"""bf16 matmuls with fp32 accumulation, written as fp32 GEMMs of the upcast operands.

A bf16 GEMM multiplies bf16 values (exactly, in fp32), accumulates in fp32 and rounds the result
to bf16 once. An fp32 GEMM of the upcast operands followed by one rounding is the same math. On
the CPU it runs through MKL's SGEMM, which the rank launcher pins to reproducible code paths
(``MKL_CBWR``, see :data:`parity.distributed.determinism.CPU_PINS`), instead of oneDNN's bf16
GEMM, whose kernels and blocking follow the CPU's instruction set and cache sizes: with it the
bits of the router, the output head and Muon's Newton-Schulz iteration changed from one CPU model
to another (docs/measurements/2026-12-01-cpu-platform-independence.md). Autograd through the
casts gives the backward GEMMs the same shape: fp32 GEMM, one rounding to bf16.

The fp32 GEMMs must run at "highest" float32 matmul precision (torch's default): at "medium"
torch hands fp32 GEMMs to oneDNN's bf16 kernels. :func:`mm` and :func:`addmm` ensure it; the
backward of :func:`linear` runs at the precision in effect during backward, the default.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

__all__ = ["Linear", "linear", "mm", "addmm"]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w^T`` in ``x.dtype``, accumulated in fp32 (differentiable)."""
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


def mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in ``a.dtype``, accumulated in fp32."""
    with _highest():
        return (a.float() @ b.float()).to(a.dtype)


def addmm(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta: float, alpha: float) -> torch.Tensor:
    """``beta * c + alpha * (a @ b)`` in ``c.dtype``: computed in fp32, rounded once."""
    with _highest():
        return torch.addmm(c.float(), a.float(), b.float(), beta=beta, alpha=alpha).to(c.dtype)
