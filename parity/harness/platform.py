"""Platform fingerprints: what must match for an exact (bitwise) golden to apply.

Bits of a training step depend on which kernels ran and how reductions were
ordered. That is decided by:

* the device kind and model: a different GPU SKU (or CPU model: oneDNN/MKL
  pick kernels per ISA) runs different kernels;
* the torch version (its kernels, and the cuBLAS/cuDNN/NCCL it bundles), the
  CUDA version it was built for and the TransformerEngine version; the last
  two only on CUDA, and the torch version without its local build tag
  (``2.13.0+cpu`` and ``2.13.0+cu130`` run the same CPU kernels);
* the process-group backend (gloo and nccl order their reductions differently).

Those fields form :data:`EXACT_MATCH_KEYS`: an exact golden applies only where
all of them are equal. Everything else in the fingerprint (Python version, OS,
machine architecture, NCCL and cuDNN versions, driver) is informative: stored
with the golden and shown on a mismatch, but not compared. The TE version only
matters on CUDA (TE has no CPU kernels), so it is not compared for CPU
platforms.

:func:`platform_id` turns the compared fields into a short filesystem-safe
slug used as a golden directory name, e.g.
``cpu-intel-xeon-platinum-8481c-torch2.13.0`` or
``cuda-nvidia-h200-torch2.11.0-cu13.0-te2.3.0``. The slug is a name, not the
check: loading a golden compares the full fingerprints.
"""

from __future__ import annotations

import importlib.metadata
import platform as _stdlib_platform
import re
import sys

import torch

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

EXACT_MATCH_KEYS: tuple[str, ...] = ("device_kind", "device_name", "torch", "cuda", "te", "backend")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _stdlib_platform.processor() or _stdlib_platform.machine() or "unknown-cpu"


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
        ``{str: str}``: ``device_kind``, ``device_name``, ``torch``, ``cuda``,
        ``te``, ``backend`` (the compared fields) and ``python``, ``machine``,
        ``os``, ``nccl``, ``cudnn`` (informative).
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
        "python": _stdlib_platform.python_version(),
        "machine": _stdlib_platform.machine(),
        "os": sys.platform,
        "nccl": nccl,
        "cudnn": str(cudnn) if cudnn else "none",
    }


def match_keys(fp: dict[str, str]) -> tuple[str, ...]:
    """The fingerprint keys that must be equal for an exact golden.

    CUDA and TE versions are compared only on CUDA platforms: CPU kernels do
    not depend on them.
    """
    if fp.get("device_kind") == "cpu":
        return tuple(k for k in EXACT_MATCH_KEYS if k not in ("cuda", "te"))
    return EXACT_MATCH_KEYS


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

    ``{kind}-{device model}-torch{X.Y.Z}[-cu{C}][-te{T}][-{backend}]``; the
    CUDA and TE parts appear on CUDA platforms only (TE when installed), the
    backend only when it is not the default for the device.
    """
    kind = fp.get("device_kind", "unknown")
    parts = [_slug(kind, 8), _slug(fp.get("device_name", "unknown"), model=True)]
    torch_public = fp.get("torch", "unknown").split("+", 1)[0]
    parts.append("torch" + _slug(torch_public, 16))
    if kind == "cuda" and fp.get("cuda", "none") != "none":
        parts.append("cu" + _slug(fp["cuda"], 8))
    if kind == "cuda" and fp.get("te", "none") != "none":
        parts.append("te" + _slug(fp["te"].split("+", 1)[0], 16))
    backend = fp.get("backend")
    if backend and backend != DEFAULT_BACKEND.get(kind):
        parts.append(_slug(backend, 8))
    return "-".join(parts)
