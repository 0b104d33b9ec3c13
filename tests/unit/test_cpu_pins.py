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

from parity.distributed.determinism import CPU_PINS, apply_cpu_pins, cpu_isa
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
    if mode == "pinned" and "OPENBLAS_CORETYPE" in CPU_PINS:
        e["OPENBLAS_CORETYPE"] = CPU_PINS["OPENBLAS_CORETYPE"]  # read when numpy loads, before the probe's pins
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
    blas = {"OPENBLAS_CORETYPE": "Haswell"} if "OPENBLAS_CORETYPE" in CPU_PINS else {}
    assert apply_cpu_pins(env) == {"ATEN_CPU_CAPABILITY": "avx2", **blas}
    assert env == {"MKL_CBWR": "AUTO", "ATEN_CPU_CAPABILITY": "avx2", **blas}
    assert cpu_isa({"ATEN_CPU_CAPABILITY": "default"}) == "default"
    assert cpu_isa({}) in ("avx2", "default")  # the pin, capped by this CPU


def test_pins_after_the_first_dispatch_are_refused():
    """A pin that comes after ATen's first dispatch is refused: on an AVX-512 CPU the pin itself
    (avx2) comes too late; on an AVX2 CPU a pin down to the scalar kernels stands in for it."""
    e = {k: v for k, v in os.environ.items() if k not in CPU_PINS}  # unpinned: the CPU's widest kernels
    r = subprocess.run([sys.executable, "-c", LATE_PIN_PROBE], env={**e, "PYTHONPATH": str(REPO)},
                       capture_output=True, text=True)
    have, want = r.stdout.split()
    if have not in ("avx2", "avx512"):
        pytest.skip(f"ATen runs its {have} kernels here: no narrower set to pin")
    assert r.returncode != 0 and "DeterminismError" in r.stderr, r.stderr
    assert f"ATen already runs its {have} CPU kernels" in r.stderr and f"asks for {want}" in r.stderr


# After a first dispatch: prints the kernels ATen runs and the narrower set it then pins, and pins.
LATE_PIN_PROBE = """
import os, torch
torch.ones(2) + 1
have = torch.backends.cpu.get_cpu_capability().lower()
from parity.distributed.pins import CPU_PINS
want = CPU_PINS["ATEN_CPU_CAPABILITY"] if have == "avx512" else "default"
print(have, want, flush=True)
if have in ("avx2", "avx512"):
    os.environ["ATEN_CPU_CAPABILITY"] = want
    from parity.distributed.determinism import apply_cpu_pins
    apply_cpu_pins()
"""


# The CPU's fp32 GEMM (parity.model.matmul) in a fresh interpreter, under OPENBLAS_CORETYPE=argv[1].
GEMM_PROBE = """
import hashlib, sys, torch
from parity.distributed.determinism import openblas_coretype
from parity.model import matmul
g = torch.Generator().manual_seed(0)
a, b = torch.randn(128, 256, generator=g), torch.randn(256, 192, generator=g)
x, w = torch.randn(64, 320, generator=g).requires_grad_(True), torch.randn(96, 320, generator=g)
y = matmul.linear(x, w)
y.pow(2).sum().backward()
h = hashlib.sha256()
for t in (matmul.mm(a, b), matmul.addmm(a[:, :192], a, b, beta=0.75, alpha=-1.5), y, x.grad):
    h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes())
print(openblas_coretype(), h.hexdigest()[:16])
"""

needs_pinned_blas = pytest.mark.skipif("OPENBLAS_CORETYPE" not in CPU_PINS,
                                       reason="OpenBLAS's kernels are pinned on x86-64 Linux CPUs with AVX2 and FMA")


def _gemm_probe(coretype: str) -> tuple[str, str]:
    e = {k: v for k, v in os.environ.items() if k not in CPU_PINS}
    e.update(OPENBLAS_CORETYPE=coretype, OPENBLAS_NUM_THREADS="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", GEMM_PROBE], env=e, capture_output=True, text=True, check=True)
    kernels, digest = out.stdout.split()
    return kernels, digest


@needs_pinned_blas
def test_the_cpu_gemm_bits_follow_openblas_kernels():
    """Why the ranks pin OpenBLAS's kernels: another kernel set (here Sandybridge's AVX kernels,
    without FMA, which any AVX2 CPU runs; an AVX-512 CPU's own choice is SkylakeX) gives other bits
    for the same GEMMs. That the pinned kernels give the same bits on Intel and AMD CPUs was
    measured (docs/spec/platform.md s1.2)."""
    pinned = _gemm_probe("Haswell")
    other = _gemm_probe("Sandybridge")
    assert pinned[0] == "Haswell" and other[0] == "Sandybridge"
    assert pinned[1] != other[1]


@needs_pinned_blas
def test_a_rank_whose_openblas_loaded_before_the_pin_is_refused():
    """numpy's OpenBLAS picks its kernels when it loads: a process that loaded it on other kernels
    and only then gets the pin (as a rank forked from an unpinned process would) must not run."""
    code = ("import os, torch\n"  # torch loads numpy, and OpenBLAS on the kernels the environment names
            "del os.environ['OPENBLAS_CORETYPE']\n"
            "from parity.distributed.determinism import apply_cpu_pins\n"
            "apply_cpu_pins()\n")
    e = {k: v for k, v in os.environ.items() if k not in CPU_PINS}
    e.update(OPENBLAS_CORETYPE="Sandybridge", PYTHONPATH=str(REPO))
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)
    assert r.returncode != 0 and "DeterminismError" in r.stderr
    assert "OpenBLAS already runs its Sandybridge kernels" in r.stderr
    e["OPENBLAS_CORETYPE"] = "Haswell"  # loaded pinned: accepted
    r = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def _bits16(t):
    return t.contiguous().view(torch.int16)


def test_fp32_gemm_formulation_is_a_bf16_gemm_with_one_rounding():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 32, generator=g).bfloat16().requires_grad_(True)
    w = torch.randn(8, 32, generator=g).bfloat16().requires_grad_(True)
    y = matmul.linear(x, w)
    exact = (x.double() @ w.double().T)
    assert y.dtype == torch.bfloat16 and torch.equal(_bits16(y), _bits16(exact.float().bfloat16()))  # K=32: fp32 sum is exact here
    y.float().sum().backward()
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")  # as inside Muon's step
    try:
        a = torch.randn(8, 16, generator=g).bfloat16()
        assert torch.equal(_bits16(matmul.mm(a, a.T)), _bits16((a.double() @ a.double().T).float().bfloat16()))
        assert torch.get_float32_matmul_precision() == "medium"
        c = matmul.addmm(a[:, :8], a, a.T[:, :8], beta=0.5, alpha=2.0)
        exact = (a.double() @ a.double().T[:, :8]).float()  # K=16: exact in fp32, as is * 2.0
        assert torch.equal(_bits16(c), _bits16((a[:, :8].float() * 0.5 + exact * 2.0).bfloat16()))
    finally:
        torch.set_float32_matmul_precision(prev)
