"""AdamW (decoupled weight decay) written out one tensor at a time.

Every formula is elementwise, and the per-step scalars (bias corrections, step size) are Python
floats that do not depend on the tensor. So element i of the result depends only on element i of
p, g, m and v, whatever tensor it sits in. Megatron's DistributedOptimizer steps each rank's slice
of a flat fp32 buffer, not whole params. With these formulas the sharded step gives the same bits
as the unsharded one, so Adam params can be grouped or sharded any way without affecting parity.
Torch's foreach/fused paths are avoided so that the kernels do not depend on how the params are
grouped. tests/test_adam.py checks the sharded step bit for bit.

The op sequence is the same as torch.optim.AdamW(foreach=False, fused=False), including
`bc2 ** 0.5` rather than math.sqrt, but for the square root of `v`, which is the correctly rounded
one on every CPU (parity.optim.numerics).
"""

from __future__ import annotations

import torch

from parity.optim.eager import EagerOptimizer
from parity.optim.numerics import ieee_sqrt

__all__ = ["Adam"]


class Adam(EagerOptimizer):
    """AdamW over fp32 tensors; state is exp_avg, exp_avg_sq and an int `step` per param."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (b1, b2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                t = state["step"]
                m, v = state["exp_avg"], state["exp_avg_sq"]

                p.mul_(1 - lr * wd)
                m.lerp_(g, 1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                bc1 = 1 - b1**t
                bc2 = 1 - b2**t
                p.addcdiv_(m, (ieee_sqrt(v) / bc2**0.5).add_(eps), value=-lr / bc1)
        return loss
