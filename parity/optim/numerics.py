"""Elementwise math whose bits do not depend on the CPU.

torch's CPU ``sqrt`` is MKL's vector math, which is not correctly rounded and gives different bits
on Intel and AMD CPUs (docs/spec/platform.md s1): CPU goldens recorded on one did not reproduce on
the other. numpy's ``sqrt`` is the x86 square-root instruction, correctly rounded on every CPU, as
CUDA's default ``sqrt`` is on the GPU.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ieee_sqrt"]


def ieee_sqrt(t: torch.Tensor) -> torch.Tensor:
    """The correctly rounded square root of every element of fp32 or fp64 ``t`` (a new tensor, no
    autograd)."""
    if t.device.type == "cpu":
        return torch.from_numpy(np.sqrt(t.detach().numpy()))
    return t.detach().sqrt()
