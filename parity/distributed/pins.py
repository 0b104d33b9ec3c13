"""CPU settings a process needs before torch loads (this module imports no torch).

:data:`CPU_PINS` fix the CPU kernels ranks run; :func:`pin_before_torch` sets them, and one BLAS
thread, in a process that has not imported torch yet (the CLI does so first thing). ATen reads
ATEN_CPU_CAPABILITY at its first kernel dispatch, MKL reads MKL_CBWR at its first call and numpy's
OpenBLAS reads OPENBLAS_CORETYPE when it loads (``import torch`` loads numpy), so a process pinned
this way runs the pinned kernels itself, and so does a child it forks
(:mod:`parity.harness.launch`). A launcher in a process that loaded torch unpinned starts its
ranks and fork server inside :func:`pinned_environ`, so they load numpy's OpenBLAS pinned; each
rank then sets the pins in its own environment before its first kernel
(:func:`parity.distributed.determinism.apply_cpu_pins`, which refuses a rank whose ATen or OpenBLAS
already runs other kernels).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Iterator

__all__ = ["CPU_PINS", "LOAD_ENV", "OPENBLAS_CORETYPE", "cpu_flags", "cpuinfo_field", "pin_before_torch",
           "pinned_before_torch", "pinned_environ"]

OPENBLAS_CORETYPE = "Haswell"
"""The OpenBLAS kernel set numpy's fp32 GEMMs run (parity.model.matmul): its AVX2+FMA kernels give
the same bits on Intel and AMD CPUs and across OpenBLAS versions (docs/spec/platform.md s1.2),
while OpenBLAS's own choice follows the CPU (SkylakeX kernels on an AVX-512 Xeon: other bits)."""


def cpuinfo_field(name: str) -> str | None:
    """The value of field ``name`` (e.g. "model name", "flags") of the first CPU in /proc/cpuinfo
    (Linux), or None where unknown."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep and key.strip().lower() == name:
                    return value.strip()
    except OSError:
        pass
    return None


def cpu_flags() -> frozenset[str] | None:
    """The instruction-set flags of this CPU from /proc/cpuinfo (Linux), or None where unknown."""
    flags = cpuinfo_field("flags")
    return None if flags is None else frozenset(flags.split())


def _has_avx2_fma() -> bool:
    """Whether this is an x86-64 Linux CPU with AVX2 and FMA: forcing OpenBLAS's Haswell kernels
    on a CPU without them would stop the process with an illegal instruction when numpy loads."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return {"avx2", "fma"} <= (cpu_flags() or frozenset())


# CPU kernels that give the same bits on every x86-64 CPU with AVX2 (docs/measurements/
# 2026-12-01-cpu-platform-independence.md). Without them the bits follow the CPU: ATen picks its
# vectorized kernels (reductions, softmax, exp/silu, the Box-Muller of randn) by instruction set,
# MKL its GEMM and vector-math kernels by instruction set, and oneDNN (bf16 GEMMs) by instruction
# set and cache sizes (the model therefore runs no bf16 GEMM: parity.model.matmul). Each is set
# only where the environment does not set it already; a different value is a different platform
# (see parity.harness.platform), not a violation.
CPU_PINS: dict[str, str] = {
    # ATen's kernels at AVX2 (x86-64 servers since 2013 have it; a CPU without falls back to
    # the scalar kernels, which the platform id then names).
    "ATEN_CPU_CAPABILITY": "avx2",
    # MKL's conditional numerical reproducibility on its COMPATIBLE branch (SSE2 without the
    # approximate rcpps/rsqrtps, whose results differ between Intel and AMD), the only branch
    # MKL also honours on non-Intel CPUs; results independent of memory alignment (STRICT) for a
    # fixed thread count (1 per rank). An ISA branch such as AVX2 falls back to MKL's automatic
    # dispatch on AMD.
    "MKL_CBWR": "COMPATIBLE,STRICT",
}
# numpy's OpenBLAS on its AVX2+FMA kernels, where the CPU has them: the fp32 GEMMs of the model and
# of Newton-Schulz run there (parity.model.matmul), 2-4x faster than on MKL's COMPATIBLE branch.
if _has_avx2_fma():
    CPU_PINS["OPENBLAS_CORETYPE"] = OPENBLAS_CORETYPE

LOAD_ENV: dict[str, str] = {**CPU_PINS, "OPENBLAS_NUM_THREADS": "1"}
"""What a process needs in its environment when it loads numpy and torch: the pins, and one thread for
numpy's OpenBLAS. Loaded without it, OpenBLAS sizes its pool to the host, and a forked rank that
limits the pool to one thread (parity.distributed.determinism) starts a worker that spins idle
(docs/spec/platform.md s1.2). A rank that wants more threads raises the count itself."""

_pinned_before_torch = False


def pin_before_torch() -> bool:
    """Set :data:`LOAD_ENV` in ``os.environ`` where unset, if torch is not loaded yet. Returns
    whether it did; :func:`pinned_before_torch` tells later."""
    global _pinned_before_torch
    if "torch" in sys.modules or "numpy" in sys.modules:
        return False
    for name, value in LOAD_ENV.items():
        os.environ.setdefault(name, value)
    _pinned_before_torch = True
    return True


def pinned_before_torch() -> bool:
    """Whether :func:`pin_before_torch` pinned this process before torch loaded: then its own
    kernels are the pinned ones, and so are those of a child it forks."""
    return _pinned_before_torch


@contextlib.contextmanager
def pinned_environ() -> Iterator[None]:
    """``os.environ`` with :data:`LOAD_ENV` set where unset, for the duration: a process started
    inside (a spawned rank, a fork server) loads numpy's OpenBLAS on the pinned kernels, which it
    could no longer change once torch is imported, with one thread. Restored afterwards."""
    added = [name for name in LOAD_ENV if name not in os.environ]
    for name in added:
        os.environ[name] = LOAD_ENV[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
