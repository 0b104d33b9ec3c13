"""How many of torch's CPU fp32 square roots are not the correctly rounded ones, on this CPU.

Draws 65,536 positive fp32 values spread over 2^-40..2^10 (fixed seed), takes torch's ``sqrt`` and
parity's ``ieee_sqrt`` (numpy's, the x86 instruction), and prints how many differ, and how many of
each fail the exact correct-rounding test (the root lies between the midpoints to its neighbours,
squared exactly in float64). Run it with parity's CPU pins in the environment, as ranks have them,
to see what the stack saw before parity.optim.numerics (docs/spec/platform.md s1). Asserts nothing.

    python tools/sqrt_rounding.py
"""

from __future__ import annotations

import os

from parity.distributed.pins import pin_before_torch

pin_before_torch()

import torch  # noqa: E402  (after the pins)

from parity.optim.numerics import ieee_sqrt  # noqa: E402


def _not_correctly_rounded(r: torch.Tensor, v: torch.Tensor) -> int:
    below = (r.double() + torch.nextafter(r, torch.tensor(0.0)).double()) / 2
    above = (r.double() + torch.nextafter(r, torch.tensor(float("inf"))).double()) / 2
    v64 = v.double()
    return int((~((below * below <= v64) & (v64 <= above * above))).sum())


def main():
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    v = torch.rand(65536, generator=g) * torch.exp2(torch.randint(-40, 10, (65536,), generator=g).float())
    v = v[v > 0]
    mine, theirs = ieee_sqrt(v), v.sqrt()
    differ = int((mine.view(torch.int32) != theirs.view(torch.int32)).sum())
    pins = {k: os.environ.get(k) for k in ("ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    print(f"{v.numel()} values, torch {torch.__version__}, pins {pins}, CPU capability "
          f"{torch.backends.cpu.get_cpu_capability()}")
    print(f"torch sqrt differs from ieee_sqrt: {differ}; not correctly rounded: torch "
          f"{_not_correctly_rounded(theirs, v)}, ieee_sqrt {_not_correctly_rounded(mine, v)}")


if __name__ == "__main__":
    main()
