"""Elementwise math whose bits do not depend on the CPU.

torch's CPU ``sqrt`` on fp32 hands contiguous tensors to MKL's vector math, which is accurate to
about an ULP but not correctly rounded, and whose results differ between CPU vendors even on
MKL's reproducible COMPATIBLE branch: on an AMD EPYC 17% of 65,536 roots differed from the
correctly rounded ones, and the Adam masters of the CPU goldens recorded on an Intel Xeon did not
reproduce (docs/measurements.md, "seventh session"). numpy's ``sqrt`` is the IEEE square root (the
x86 ``sqrtps``/``sqrtpd`` instructions, correctly rounded on every CPU), as is CUDA's default
``sqrt``.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ieee_sqrt"]


def ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of every element of ``t`` (a new tensor, no autograd)."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.sqrt(t.detach().numpy()))
    return t.detach().sqrt()
