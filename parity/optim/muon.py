"""Muon for fp32 master weights, as Megatron runs it through Emerging-Optimizers v0.2.0.

The spec is docs/spec/megatron.md §3. Each owned master moves by

    p <- p - lr*wd*p                      (decoupled weight decay, applied before momentum)
    M <- lerp(M, g, 1 - beta)
    U <- lerp(g, M, beta) if nesterov else M
    p <- p - lr * scale(rows, cols) * extra * NS(U)

where NS is a quintic Newton-Schulz iteration that pushes the singular values of U towards 1.
Each step uses the same torch op, in the same order and dtype, as the reference, because the
harness compares results bit for bit. Algebraically equal rewrites (p*(1 - lr*wd),
b*A + c*A@A, math.sqrt, ...) round differently and would break that.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from parity.model import matmul
from parity.optim.eager import EagerOptimizer

__all__ = [
    "NS_COEFFICIENTS",
    "newton_schulz",
    "muon_scale_factor",
    "orthogonalize",
    "fp32_matmul_precision",
    "Muon",
]

# (a, b, c) for X <- a X + b (X X^T) X + c (X X^T)^2 X. The list is cycled, so 5 quintic steps
# use each tuple once.
NS_COEFFICIENTS: dict[str, list[tuple[float, float, float]]] = {
    "quintic": [
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ],
    "simple": [(3.4445, -4.7750, 2.0315)],
}


NS_EPS = 1e-7
"""The floor of the Frobenius norm Newton-Schulz divides by: a zero update stays zero, not 0/0."""


def newton_schulz(
    x: torch.Tensor, steps: int = 5, coefficient_type: str = "quintic", eps: float = NS_EPS
) -> torch.Tensor:
    """Approximate the orthogonal polar factor of a 2-D fp32 matrix, returned in fp32.

    The quintic coefficients trade exactness for speed: singular values end up spread around 1
    (measured in tests/test_muon.py), not equal to 1.
    """
    if x.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(x.shape)}")
    if x.dtype != torch.float32:
        raise ValueError(f"newton_schulz needs float32 input, got {x.dtype}")
    if coefficient_type not in NS_COEFFICIENTS:
        raise ValueError(f"unknown coefficient_type {coefficient_type!r}")

    # Work on the short side so the Gram matrix X X^T is as small as possible.
    transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    # The Frobenius norm bounds the spectral norm, so every singular value starts in [0, 1],
    # inside the region where the iteration converges. F.normalize is x / max(||x||_F, eps).
    X = F.normalize(x, p=2, dim=(-2, -1), eps=eps)
    # Torch has no fp32-in/bf16-compute matmul, so "medium" means run the whole loop in bf16
    # (bf16 values, fp32 accumulation, one rounding per GEMM: parity.model.matmul).
    work = torch.bfloat16 if torch.get_float32_matmul_precision() == "medium" else torch.float32
    # X, A and B hold work-dtype values, each rounded once per GEMM; they are kept widened to fp32
    # (exact) because every GEMM widens its operands, and each is an operand more than once.
    X = X.to(work).float()
    for a, b, c in itertools.islice(itertools.cycle(NS_COEFFICIENTS[coefficient_type]), steps):
        A = matmul.mm(X, X.mT, out_dtype=work).float()
        B = matmul.addmm(A, A, A, beta=b, alpha=c, out_dtype=work).float()
        X = matmul.addmm(X, B, X, beta=a, alpha=1.0, out_dtype=work).float()
    return X.mT if transpose else X


def muon_scale_factor(rows: int, cols: int, mode: str = "spectral") -> float:
    """Multiplier for the orthogonalized update of a rows x cols matrix."""
    # `** 0.5` rather than math.sqrt: it is the float op the reference uses.
    if mode == "spectral":
        return max(rows, cols) ** 0.5
    if mode == "shape_scaling":
        return max(1, rows / cols) ** 0.5
    if mode == "unit_rms_norm":
        return (rows / cols) ** 0.5
    raise ValueError(f"unknown scale_mode {mode!r}")


def _scaled_newton_schulz(
    u: torch.Tensor, steps: int, coefficient_type: str, scale_mode: str, extra_scale_factor: float, eps: float
) -> torch.Tensor:
    # Two separate roundings, (O * scale) * extra, in the reference's order.
    scale = muon_scale_factor(u.size(0), u.size(1), scale_mode)
    return newton_schulz(u, steps, coefficient_type, eps) * scale * extra_scale_factor


def orthogonalize(
    update: torch.Tensor,
    *,
    steps: int = 5,
    coefficient_type: str = "quintic",
    scale_mode: str = "spectral",
    extra_scale_factor: float = 1.0,
    qkv_split_shapes: Sequence[int] | None = None,
    eps: float = NS_EPS,
) -> torch.Tensor:
    """Scaled Newton-Schulz of `update`; fused QKV weights are treated as separate matrices.

    A fused QKV weight has rows [q_0 k_0 v_0 q_1 k_1 v_1 ...] per query group. Q, K and V are
    different linear maps, so each piece (all groups' rows of it stacked) is orthogonalized and
    scaled on its own shape, then scattered back into the fused layout.
    """
    kw = dict(steps=steps, coefficient_type=coefficient_type, scale_mode=scale_mode,
              extra_scale_factor=extra_scale_factor, eps=eps)
    if qkv_split_shapes is None:
        return _scaled_newton_schulz(update, **kw)

    rows, cols = update.shape
    per_group = sum(qkv_split_shapes)
    if rows % per_group != 0:
        raise ValueError(f"{rows} rows do not divide into groups of {list(qkv_split_shapes)}")
    groups = rows // per_group
    pieces = update.view(groups, per_group, cols).split(list(qkv_split_shapes), dim=1)
    outs = [_scaled_newton_schulz(piece.reshape(-1, cols), **kw).reshape(groups, -1, cols)
            for piece in pieces]
    return torch.cat(outs, dim=1).reshape(update.shape)


@contextlib.contextmanager
def fp32_matmul_precision(prec: str) -> Iterator[None]:
    """Temporarily set torch's fp32 matmul precision ("highest", "high" or "medium")."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(prec)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


class Muon(EagerOptimizer):
    """Muon over fp32 master tensors; each param's gradient is read from `p.grad`.

    A fused QKV param carries `p.qkv_split_shapes` (set by the model). It is orthogonalized per
    piece when the group's `split_qkv` is true. Params whose grad is None are skipped, so a
    rank can hold every param and step only the ones it owns.
    """

    def __init__(
        self,
        params,
        lr: float,
        momentum: float = 0.95,
        nesterov: bool = False,
        weight_decay: float = 0.01,
        steps: int = 5,
        coefficient_type: str = "quintic",
        scale_mode: str = "spectral",
        extra_scale_factor: float = 1.0,
        fp32_matmul_prec: str = "medium",
        split_qkv: bool = True,
        eps: float = NS_EPS,
    ):
        defaults = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay,
                        steps=steps, coefficient_type=coefficient_type, scale_mode=scale_mode,
                        extra_scale_factor=extra_scale_factor, fp32_matmul_prec=fp32_matmul_prec,
                        split_qkv=split_qkv, eps=eps)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                M = state["momentum_buffer"]

                # Decoupled decay, applied as an in-place add of a scaled p (not a mul), before
                # the momentum update, as in the reference.
                if wd != 0:
                    p.add_(p, alpha=-lr * wd)
                M.lerp_(g, 1 - beta)
                U = g.lerp(M, beta) if group["nesterov"] else M

                split = getattr(p, "qkv_split_shapes", None) if group["split_qkv"] else None
                with fp32_matmul_precision(group["fp32_matmul_prec"]):
                    O = orthogonalize(U, steps=group["steps"],
                                      coefficient_type=group["coefficient_type"],
                                      scale_mode=group["scale_mode"],
                                      extra_scale_factor=group["extra_scale_factor"],
                                      qkv_split_shapes=split, eps=group["eps"])
                p.add_(O, alpha=-lr)
        return loss
