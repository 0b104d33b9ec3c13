"""Platform fingerprints: what must match for an exact (bitwise) golden to apply.

Bits of a training step depend on which kernels ran and how reductions were ordered:

* CUDA: the GPU model, the torch version (its kernels and the cuBLAS/NCCL it bundles), the CUDA
  version it was built for and the TransformerEngine version, and the process-group backend.
* CPU: NOT the CPU model. The ranks pin the CPU kernels (``parity.distributed.determinism.CPU_PINS``:
  ATen's kernels at AVX2, MKL on its strict reproducible COMPATIBLE branch, numpy's OpenBLAS on
  its Haswell kernels) and the model runs no oneDNN GEMM, so what still decides the bits is the
  ATen kernel set in effect (``cpu_isa``: avx2 on any x86-64 CPU that has it), the MKL mode
  (``mkl_cbwr``), numpy's BLAS and its kernels (``numpy_blas``), the machine architecture, the
  torch version and the backend. Measured: docs/measurements/2026-12-01-cpu-platform-independence.md.

Those fields (:func:`match_keys`) must all be equal for an exact golden to apply; the torch
version is compared without its local build tag (``2.13.0+cpu`` and ``2.13.0+cu130`` run the same
CPU kernels). Everything else in the fingerprint (CPU or GPU name on CPU, Python, OS, NCCL and
cuDNN versions) is informative: stored with the golden and shown on a mismatch, not compared.

:func:`platform_id` turns the compared fields into a short filesystem-safe slug used as a golden
directory name, e.g. ``cpu-avx2-torch2.13.0`` or ``cuda-nvidia-h200-torch2.11.0-cu13.0-te2.3.0``.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform as _stdlib_platform
import re
import sys

import torch

from parity.distributed.determinism import CPU_PINS, blas_pools, cpu_isa
from parity.distributed.pins import OPENBLAS_CORETYPE, cpuinfo_field
from parity.harness.errors import UsageError

__all__ = [
    "EXACT_MATCH_KEYS",
    "DEFAULT_BACKEND",
    "platform_fingerprint",
    "platform_id",
    "match_keys",
    "fingerprint_diff",
]

DEFAULT_BACKEND = {"cpu": "gloo", "cuda": "nccl"}
_PINNED_BLAS = f"openblas-{OPENBLAS_CORETYPE.lower()}"

EXACT_MATCH_KEYS: dict[str, tuple[str, ...]] = {
    "cpu": ("device_kind", "cpu_isa", "mkl_cbwr", "numpy_blas", "machine", "torch", "backend"),
    "cuda": ("device_kind", "device_name", "torch", "cuda", "te", "backend"),
}


def _numpy_blas() -> str:
    """The BLAS numpy's fp32 GEMMs run in the ranks (parity.model.matmul): ``openblas-<kernels>``
    with the kernel set the ranks' environment asks for (a rank whose OpenBLAS runs other kernels
    than the pin is refused: parity.distributed.determinism.apply_cpu_pins), ``openblas-auto``
    where nothing is pinned (OpenBLAS picks by CPU), else the library's name."""
    apis = [lib.get("internal_api") for lib in blas_pools()]
    if "openblas" not in apis:  # numpy built on another BLAS (torch's MKL is linked statically)
        return apis[0] if apis else "none"
    coretype = os.environ.get("OPENBLAS_CORETYPE", CPU_PINS.get("OPENBLAS_CORETYPE", "auto"))
    return f"openblas-{coretype.lower()}"


def _cpu_model() -> str:
    return (cpuinfo_field("model name") or _stdlib_platform.processor() or _stdlib_platform.machine()
            or "unknown-cpu")


def _dist_version(*names: str) -> str:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def platform_fingerprint(device: str = "cpu", backend: str | None = None) -> dict[str, str]:
    """Describe the platform a run executes on.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        backend: the torch.distributed backend; defaults to gloo on CPU and
            nccl on CUDA.

    Returns:
        ``{str: str}``: ``device_kind``, ``device_name``, ``torch``, ``cuda``, ``te``,
        ``backend``, ``cpu_isa``, ``mkl_cbwr``, ``numpy_blas``, ``machine``, ``python``, ``os``, ``nccl``,
        ``cudnn`` (see :func:`match_keys` for the compared ones).
    """
    dev = torch.device(device)
    kind = dev.type
    if kind not in DEFAULT_BACKEND:
        raise UsageError(f"unsupported device {device!r}: use cpu or cuda")
    backend = backend or DEFAULT_BACKEND[kind]
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"device {device!r} requested but CUDA is not available")
        name = torch.cuda.get_device_name(dev)
    else:
        name = _cpu_model()
    nccl = "none"
    if kind == "cuda":
        try:
            nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001 - builds without NCCL
            nccl = "none"
    cudnn = torch.backends.cudnn.version() if kind == "cuda" else None
    return {
        "device_kind": kind,
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda or "none",
        "te": _dist_version("transformer_engine", "transformer-engine", "transformer_engine_torch"),
        "backend": backend,
        "cpu_isa": cpu_isa(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", CPU_PINS["MKL_CBWR"]),
        "numpy_blas": _numpy_blas(),
        "python": _stdlib_platform.python_version(),
        "machine": _stdlib_platform.machine(),
        "os": sys.platform,
        "nccl": nccl,
        "cudnn": str(cudnn) if cudnn else "none",
    }


def match_keys(fp: dict[str, str]) -> tuple[str, ...]:
    """The fingerprint keys that must be equal for an exact golden (per device kind)."""
    return EXACT_MATCH_KEYS.get(fp.get("device_kind", ""), EXACT_MATCH_KEYS["cuda"])


def _compared(key: str, value: str) -> str:
    # The local version part ("+cpu", "+cu130") names the build flavour, which
    # the "cuda" field already covers where it matters.
    return value.split("+", 1)[0] if key == "torch" else value


def fingerprint_diff(expected: dict[str, str], actual: dict[str, str]) -> dict[str, tuple[str, str]]:
    """The compared fields that differ: ``{key: (expected, actual)}`` (empty if compatible)."""
    keys = dict.fromkeys(match_keys(expected) + match_keys(actual))
    return {
        k: (expected.get(k, "?"), actual.get(k, "?"))
        for k in keys
        if _compared(k, expected.get(k, "?")) != _compared(k, actual.get(k, "?"))
    }


_VENDOR_NOISE = re.compile(r"\((?:r|tm|c)\)|\bcpu\b|\bprocessor\b|@.*$|\b\d+-core\b", re.IGNORECASE)


def _slug(text: str, limit: int = 40, *, model: bool = False) -> str:
    text = text.lower()
    if model:
        text = _VENDOR_NOISE.sub(" ", text)
    text = re.sub(r"[^a-z0-9.]+", "-", text).strip("-.")
    return text[:limit].rstrip("-.") or "unknown"


def platform_id(fp: dict[str, str]) -> str:
    """A short filesystem-safe slug of the compared fields of a fingerprint.

    CPU: ``cpu-{isa}-torch{X.Y.Z}``, plus ``-mkl-{mode}`` when MKL_CBWR is not the pin,
    ``-blas-{numpy's BLAS}`` when that is not OpenBLAS on the pinned kernels, and the architecture
    when it is not x86_64. CUDA: ``cuda-{GPU}-torch{X.Y.Z}[-cu{C}][-te{T}]``. Either
    ends with the backend when it is not the device's default.
    """
    kind = fp.get("device_kind", "unknown")
    torch_public = fp.get("torch", "unknown").split("+", 1)[0]
    if kind == "cpu":
        parts = ["cpu", _slug(fp.get("cpu_isa", "unknown"), 16), "torch" + _slug(torch_public, 16)]
        if fp.get("mkl_cbwr", CPU_PINS["MKL_CBWR"]) != CPU_PINS["MKL_CBWR"]:
            parts.append("mkl-" + _slug(fp["mkl_cbwr"], 24))
        if fp.get("numpy_blas", _PINNED_BLAS) != _PINNED_BLAS:
            parts.append("blas-" + _slug(fp["numpy_blas"], 24))
        if fp.get("machine", "x86_64") != "x86_64":
            parts.append(_slug(fp["machine"], 16))
    else:
        parts = [_slug(kind, 8), _slug(fp.get("device_name", "unknown"), model=True),
                 "torch" + _slug(torch_public, 16)]
        if fp.get("cuda", "none") != "none":
            parts.append("cu" + _slug(fp["cuda"], 8))
        if fp.get("te", "none") != "none":
            parts.append("te" + _slug(fp["te"].split("+", 1)[0], 16))
    backend = fp.get("backend")
    if backend and backend != DEFAULT_BACKEND.get(kind):
        parts.append(_slug(backend, 8))
    return "-".join(parts)
