"""CPU bits that do not depend on the CPU model: the kernel pins and the fp32-GEMM formulation.

Each probe runs in a fresh interpreter (ATen picks its kernel set at the first dispatch of a
process), with environment variables that stand in for another CPU: ATEN_CPU_CAPABILITY for the
width of ATen's kernels, ONEDNN_MAX_CPU_ISA and MKL_ENABLE_INSTRUCTIONS for what oneDNN and MKL
dispatch to. See docs/measurements/2026-12-01-cpu-platform-independence.md for the full table.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from parity.distributed.determinism import CPU_PINS, DeterminismError, apply_cpu_pins, cpu_isa
from parity.model import matmul

REPO = Path(__file__).resolve().parents[2]

# Ops of the stack whose bits followed the CPU's instruction set before the pins: the attention
# softmax and cross-entropy (ATen's vectorized reductions), the bf16 linears (oneDNN), and Adam's
# sqrt/div (MKL's vector math).
PROBE = """
import hashlib, sys, torch
if sys.argv[1] == "pinned":
    from parity.distributed.determinism import apply_cpu_pins
    apply_cpu_pins()
import torch.nn.functional as F
from parity.model import matmul
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
s = torch.randn(2, 4, 64, 64, generator=g)
x = torch.randn(128, 128, generator=g).bfloat16()
w = (torch.randn(128, 128, generator=g) * 0.02).bfloat16()
v = torch.rand(65536, generator=g)
xr = x.clone().requires_grad_(True)
y = (matmul.linear if sys.argv[2] == "fp32" else F.linear)(xr, w)
y.float().pow(2).sum().backward()
outs = [torch.softmax(s, -1), F.cross_entropy(s.reshape(-1, 64), torch.arange(512) % 64), y, xr.grad,
        v.sqrt() / 3.0]
h = hashlib.sha256()
for t in outs:
    h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
print(torch.backends.cpu.get_cpu_capability(), h.hexdigest()[:16])
"""


def _probe(mode: str, gemm: str, **env) -> tuple[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in (*CPU_PINS, "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")}
    e.update(env, PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", PROBE, mode, gemm], env=e, capture_output=True, text=True, check=True)
    cap, digest = out.stdout.split()
    return cap, digest


def _wide_cpu() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


@pytest.mark.slow
@pytest.mark.skipif(not _wide_cpu(), reason="needs an AVX-512 CPU to stand in for a wider one")
def test_pins_make_the_bits_independent_of_the_instruction_sets():
    pinned = _probe("pinned", "fp32")
    assert pinned[0] == "AVX2"
    # An AVX2-only CPU: every library capped at AVX2 (the pins hold ATen there already).
    assert _probe("pinned", "fp32", ONEDNN_MAX_CPU_ISA="AVX2", MKL_ENABLE_INSTRUCTIONS="AVX2") == pinned
    assert _probe("pinned", "fp32", MKL_ENABLE_INSTRUCTIONS="SSE4_2")[1] == pinned[1]  # MKL COMPATIBLE branch
    # Without the pins, the AVX-512 kernels give other bits: what the pins prevent.
    assert _probe("native", "fp32")[1] != pinned[1]
    # With the pins but bf16 GEMMs through oneDNN, capping oneDNN changes the bits: why the stack
    # writes its bf16 matmuls as fp32 GEMMs (parity.model.matmul).
    assert _probe("pinned", "bf16")[1] != _probe("pinned", "bf16", ONEDNN_MAX_CPU_ISA="AVX2")[1]


def test_pins_fill_only_unset_variables():
    env = {"MKL_CBWR": "AUTO"}
    assert apply_cpu_pins(env) == {"ATEN_CPU_CAPABILITY": "avx2"}
    assert env == {"MKL_CBWR": "AUTO", "ATEN_CPU_CAPABILITY": "avx2"}
    assert cpu_isa({"ATEN_CPU_CAPABILITY": "default"}) == "default"
    assert cpu_isa({}) in ("avx2", "default")  # the pin, capped by this CPU


@pytest.mark.skipif(not _wide_cpu(), reason="needs an AVX-512 CPU")
def test_pins_after_the_first_dispatch_are_refused():
    code = ("import torch; torch.ones(2) + 1\n"
            "from parity.distributed.determinism import apply_cpu_pins\n"
            "apply_cpu_pins()\n")
    e = {k: v for k, v in os.environ.items() if k not in CPU_PINS}
    r = subprocess.run([sys.executable, "-c", code], env={**e, "PYTHONPATH": str(REPO)}, capture_output=True, text=True)
    assert r.returncode != 0 and "DeterminismError" in r.stderr and "ATen already runs its avx512" in r.stderr
    assert issubclass(DeterminismError, Exception)


def test_fp32_gemm_formulation_is_a_bf16_gemm_with_one_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(8, 32, generator=g).bfloat16().requires_grad_(True)
    y = matmul.linear(x, w)
    exact = (x.double() @ w.double().T)
    assert y.dtype == torch.bfloat16 and torch.equal(y, exact.float().bfloat16())  # K=32: fp32 sum is exact here
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # as inside Muon's step
    try:
        a = torch.randn(8, 16, generator=g).bfloat16()
        assert torch.equal(matmul.mm(a, a.T), (a.double() @ a.double().T).float().bfloat16())
        assert torch.get_float32_matmul_precision() == "medium"
        c = matmul.addmm(a[:, :8], a, a.T[:, :8], beta=0.5, alpha=2.0)
        ref = torch.addmm(a[:, :8].float(), a.float(), a.T[:, :8].float(), beta=0.5, alpha=2.0)
        assert torch.equal(c, ref.bfloat16())
    finally:
        torch.set_float32_matmul_precision(prev)
