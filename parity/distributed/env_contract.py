"""The determinism environment's contract: the variables every rank runs with, and the validator
that refuses a contradicting environment. No torch here: the command line checks the environment
before torch loads (a refusal takes a fraction of a second), as it checks its other input.
:mod:`parity.distributed.determinism` applies the contract in the ranks.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
from collections.abc import Mapping

__all__ = [
    "ACCEPTED_CUBLAS_WORKSPACE_CONFIGS",
    "ACCEPTED_NCCL_ALGO_TOKENS",
    "DETERMINISM_ENV",
    "DeterminismError",
    "validate_determinism_env",
]


def _torch_minor_version() -> tuple[int, ...]:
    """torch's (major, minor): from the loaded module where there is one, else from its installed
    metadata, without importing it; (0, 0) where neither says (the torch import reports that)."""
    torch = sys.modules.get("torch")
    try:
        text = torch.__version__ if torch is not None else importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return (0, 0)
    return _leading_pair(text)


def _leading_pair(version: str) -> tuple[int, int]:
    """(major, minor) from the leading digits of a version's first two fields ("2.13.0+cpu" ->
    (2, 13), "2.13rc1" -> (2, 13)); a field without leading digits counts 0, so an odd local
    build's version string cannot stop the command before it has said anything."""
    fields = (version.split(".") + ["", ""])[:2]
    return tuple(int(m.group()) if (m := re.match(r"\d+", f)) else 0 for f in fields)


DETERMINISM_ENV: dict[str, str] = {
    # Ring's reduction order is fixed by the ring; Tree's depends on the topology NCCL detects.
    "NCCL_ALGO": "Ring",
    # NVLink SHARP reduces inside the switch, in an order the user cannot control.
    "NCCL_NVLS_ENABLE": "0",
    # cuBLAS is deterministic only with a fixed workspace (see the cuBLAS "Results reproducibility"
    # notes); torch.use_deterministic_algorithms refuses CUDA matmuls without it.
    "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
    # TransformerEngine: no atomics-based kernels (e.g. some fused attention / grouped-MLP backward).
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0",
    # One hardware queue: kernels (compute and communication) start in issue order.
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
}
if _torch_minor_version() < (2, 11):
    # Free NCCL buffers by stream synchronisation rather than recordStream, so memory is reused in
    # the same order every run. From torch 2.11 on this is the default and setting the variable
    # only makes every NCCL rank print a deprecation warning (seen with 2.11 on H200).
    DETERMINISM_ENV["TORCH_NCCL_AVOID_RECORD_STREAMS"] = "1"

# NCCL_ALGO is a comma-separated list. Ring and the CollNet variants reduce in a fixed order;
# "^NVLS" (everything except NVLS) is accepted as Megatron does. Tree is rejected: its reduction
# order follows the detected topology and is not user-controllable. Anything else is rejected too,
# including NCCL's per-collective "allreduce:ring;..." syntax, which this check does not parse.
ACCEPTED_NCCL_ALGO_TOKENS: frozenset[str] = frozenset({"Ring", "CollnetDirect", "CollnetChain", "^NVLS"})

# The two workspace sizes cuBLAS documents as reproducible.
ACCEPTED_CUBLAS_WORKSPACE_CONFIGS: frozenset[str] = frozenset({":4096:8", ":16:8"})

# Variables with exactly one accepted value.
_SINGLE_VALUED = {"NCCL_NVLS_ENABLE": "0", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


class DeterminismError(Exception):
    """The environment asks for a nondeterministic setting; raised before anything runs."""

    exit_code = 2


def _check_nccl_algo(value: str) -> str | None:
    """The reason ``NCCL_ALGO=value`` is rejected, or None when it is accepted."""
    tokens = [t.strip() for t in value.split(",")]
    if not value.strip() or any(not t for t in tokens):
        return "empty token (an empty NCCL_ALGO lets NCCL pick, which may pick Tree)"
    accepted = {t.lower(): t for t in ACCEPTED_NCCL_ALGO_TOKENS}  # NCCL matches case-insensitively
    bad = [t for t in tokens if t.lower() not in accepted]
    if not bad:
        return None
    if any(t.lower() == "tree" for t in bad):
        return "Tree's reduction order depends on the detected topology"
    return f"unknown token(s) {', '.join(repr(t) for t in bad)}"


def validate_determinism_env(env: Mapping[str, str]) -> list[str]:
    """Check an environment mapping against the determinism rules.

    Only variables that are set are checked; unset ones get their default from
    :data:`DETERMINISM_ENV` in :func:`apply_determinism`.

    Args:
        env: the environment to check, e.g. ``os.environ``.

    Returns:
        One line per violation, naming the variable, its value and the accepted values;
        empty when the environment is acceptable.
    """
    violations: list[str] = []
    algo = env.get("NCCL_ALGO")
    if algo is not None:
        reason = _check_nccl_algo(algo)
        if reason is not None:
            accepted = ", ".join(sorted(ACCEPTED_NCCL_ALGO_TOKENS))
            violations.append(
                f"NCCL_ALGO={algo!r}: {reason}; accepted: a comma-separated list of {accepted}"
            )
    for name, good in _SINGLE_VALUED.items():
        value = env.get(name)
        if value is not None and value.strip() != good:
            violations.append(f"{name}={value!r}: accepted: {good!r}")
    cublas = env.get("CUBLAS_WORKSPACE_CONFIG")
    if cublas is not None and cublas.strip() not in ACCEPTED_CUBLAS_WORKSPACE_CONFIGS:
        accepted = " or ".join(repr(v) for v in sorted(ACCEPTED_CUBLAS_WORKSPACE_CONFIGS))
        violations.append(f"CUBLAS_WORKSPACE_CONFIG={cublas!r}: accepted: {accepted}")
    # Fail closed: every other variable of the contract (e.g. CUDA_DEVICE_MAX_CONNECTIONS) has
    # exactly its default as accepted value; a contradicting value is a violation, not a pass.
    for name, good in DETERMINISM_ENV.items():
        if name in _SINGLE_VALUED or name in ("NCCL_ALGO", "CUBLAS_WORKSPACE_CONFIG"):
            continue
        value = env.get(name)
        if value is not None and value.strip() != good:
            violations.append(f"{name}={value!r}: accepted: {good!r}")
    return violations
