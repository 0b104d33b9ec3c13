"""Determinism environment: defaults, a fail-closed validator, and the switch that applies them.

Entry points:

- :data:`DETERMINISM_ENV`: the environment variables every rank runs with unless told otherwise.
- :func:`validate_determinism_env`: the list of violations in an environment mapping.
  (These two live in :mod:`parity.distributed.env_contract`, which imports no torch.)
- :func:`apply_determinism`: validate, fill in the defaults, and put torch in deterministic mode.
- :func:`empty`: the stack's uninitialized allocations, filled so that a read of them shows.

The environment must be applied *before* any communicator or CUDA context exists: NCCL reads
``NCCL_*`` when a communicator is created and cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when its
handle is created, so a value set afterwards is silently ignored. :mod:`parity.harness.launch` applies
it in every rank before ``init_process_group``.

Like Megatron's ``megatron/training/determinism.py`` the validator fails closed: a value it does not
know is a violation, not a pass.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, MutableMapping
from typing import Any

import threadpoolctl
import torch

from parity.distributed.env_contract import (
    ACCEPTED_CUBLAS_WORKSPACE_CONFIGS,
    ACCEPTED_NCCL_ALGO_TOKENS,
    DETERMINISM_ENV,
    DeterminismError,
    validate_determinism_env,
)
from parity.distributed.pins import CPU_PINS, OPENBLAS_CORETYPE

__all__ = [
    "ACCEPTED_CUBLAS_WORKSPACE_CONFIGS",
    "ACCEPTED_NCCL_ALGO_TOKENS",
    "CPU_PINS",
    "DETERMINISM_ENV",
    "DeterminismError",
    "apply_cpu_pins",
    "apply_determinism",
    "blas_pools",
    "cpu_isa",
    "empty",
    "openblas_coretype",
    "validate_determinism_env",
]

_ISA_ORDER = ("default", "avx2", "avx512")


def cpu_isa(env: Mapping[str, str] = os.environ) -> str:
    """The ATen CPU kernel set a rank runs with under ``env`` and the pins: the requested one
    (the pin unless ``env`` sets ATEN_CPU_CAPABILITY), capped by what this CPU supports."""
    want = env.get("ATEN_CPU_CAPABILITY", CPU_PINS["ATEN_CPU_CAPABILITY"]).strip().lower()
    have = torch.backends.cpu.get_cpu_capability().lower()
    if want not in _ISA_ORDER:
        return have
    if have not in _ISA_ORDER:  # e.g. ZVECTOR, VSX on other architectures
        return have
    return _ISA_ORDER[min(_ISA_ORDER.index(want), _ISA_ORDER.index(have))]


def apply_cpu_pins(env: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """Set :data:`CPU_PINS` where ``env`` lacks them; returns the ones set by this call.

    Takes effect only before the process's first CPU kernel dispatch (ATen reads
    ATEN_CPU_CAPABILITY once, MKL reads MKL_CBWR at its first call) and, for OpenBLAS, before
    numpy loads: the launcher starts ranks and the fork server with them in the environment
    (:func:`parity.distributed.pins.pinned_environ`), and each rank applies them again. A rank
    whose ATen or OpenBLAS already runs other kernels than the pins ask for is refused.
    """
    set_now = {}
    for name, value in CPU_PINS.items():
        if name not in env:
            env[name] = value
            set_now[name] = value
    if env is os.environ:
        # ATen fixes its kernel set at its first dispatch in this process: if that came before
        # the pin, the process runs wider kernels than the pin asks for; refuse to go on.
        want = env["ATEN_CPU_CAPABILITY"].strip().lower()
        have = torch.backends.cpu.get_cpu_capability().lower()
        if want in _ISA_ORDER and have in _ISA_ORDER and _ISA_ORDER.index(have) > _ISA_ORDER.index(want):
            raise DeterminismError(
                f"ATen already runs its {have} CPU kernels in this process, but ATEN_CPU_CAPABILITY "
                f"asks for {want}: set ATEN_CPU_CAPABILITY={want} in the environment before starting it"
            )
        # OpenBLAS picks its kernels when numpy loads it, before any pin set in this process.
        want = env.get("OPENBLAS_CORETYPE")
        have = openblas_coretype()
        if want == OPENBLAS_CORETYPE and have not in (None, want):
            raise DeterminismError(
                f"numpy's OpenBLAS already runs its {have} kernels in this process, but "
                f"OPENBLAS_CORETYPE asks for {want}: set OPENBLAS_CORETYPE={want} in the environment "
                f"before starting it (an OpenBLAS built for one CPU only: set OPENBLAS_CORETYPE={have}, "
                "a platform of its own)"
            )
    return set_now


def blas_pools() -> list[dict]:
    """threadpoolctl's description of each BLAS loaded in this process (numpy's, and any other):
    ``internal_api`` (e.g. ``openblas``), ``architecture`` (its kernel set), ``num_threads``."""
    return [lib for lib in threadpoolctl.threadpool_info() if lib.get("user_api") == "blas"]


def openblas_coretype() -> str | None:
    """The kernel set numpy's OpenBLAS runs in this process (e.g. ``Haswell``), or None when numpy's
    BLAS is another library."""
    for lib in blas_pools():
        if lib.get("internal_api") == "openblas":
            return lib.get("architecture")
    return None


def empty(shape, *, dtype: torch.dtype, device) -> torch.Tensor:
    """A new tensor for the caller to overwrite, filled as torch's deterministic mode fills
    ``torch.empty``: NaN for floating dtypes, the largest value for integer ones. An element the
    caller forgets to write then reads as NaN (caught by the finite check) or as an absurd count,
    the same in every run, instead of as whatever the allocator's reused memory held.

    torch's own fill is switched off in the ranks (:func:`apply_determinism`): it also fills the
    scratch output of every non-structured op, memory that op always overwrites (a dtype cast or
    a clone writes it twice), up to a tenth of a CPU rank's time (the EP-8 run; docs/measurements.md,
    fourteenth session). The stack's own buffers, whose every element is written by a collective
    or a checkpoint load, are allocated here instead."""
    t = torch.empty(shape, dtype=dtype, device=device)
    if dtype.is_floating_point or dtype.is_complex:
        return t.fill_(float("nan"))
    if dtype == torch.bool:
        return t.fill_(True)
    return t.fill_(torch.iinfo(dtype).max)


def _deterministic_algorithms(mode: bool) -> None:
    """torch.use_deterministic_algorithms(mode, warn_only=False), less its one other effect: it also
    sets torch._inductor.config.deterministic, and importing inductor's config imports
    torch._dynamo, about 1 s of CPU in every rank process (docs/measurements.md, sixth session),
    for a flag that only torch.compile reads; the stack never compiles. The public function where
    a torch release lacks the setter it calls."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:
        torch.use_deterministic_algorithms(mode, warn_only=False)
    else:
        setter(mode, warn_only=False)


def apply_determinism(
    env: MutableMapping[str, str] = os.environ,
    *,
    allow_nondeterministic: bool = False,
    configure_torch: bool = True,
    num_threads: int | None = 1,
) -> dict[str, Any]:
    """Validate ``env``, fill in the defaults, and switch torch to deterministic algorithms.

    Call it in each rank before ``init_process_group`` and before the first CUDA call.

    Args:
        env: the environment to update in place (``os.environ`` by default).
        allow_nondeterministic: report violations as warnings instead of raising. The offending
            values are left as they are.
        configure_torch: also set the process-wide torch switches (deterministic algorithms,
            cuDNN, thread count). Pass False to touch only ``env``.
        num_threads: ``torch.set_num_threads`` value; None leaves it alone. The default 1 keeps
            ranks that share a few cores from oversubscribing them, and makes CPU reductions that
            torch splits across threads independent of the host's core count.

    Returns:
        What was applied, for reports: ``env`` (every determinism variable's value now),
        ``set_by_default`` (the ones this call set), ``violations``, ``warnings`` and, when
        ``configure_torch``, ``torch`` (the switches).

    Raises:
        DeterminismError: ``env`` has violations and ``allow_nondeterministic`` is False.
    """
    violations = validate_determinism_env(env)
    warning_lines: list[str] = []
    if violations and not allow_nondeterministic:
        raise DeterminismError(
            "nondeterministic environment (unset these variables or set them to an accepted "
            "value; allow_nondeterministic=True runs anyway):\n  " + "\n  ".join(violations)
        )
    if violations:
        warning_lines = [f"allow_nondeterministic: running with {v}" for v in violations]
        for line in warning_lines:
            warnings.warn(line, RuntimeWarning, stacklevel=2)

    set_by_default: dict[str, str] = {}
    for name, value in DETERMINISM_ENV.items():
        if name not in env:
            env[name] = value
            set_by_default[name] = value

    set_by_default.update(apply_cpu_pins(env))

    applied: dict[str, Any] = {
        "env": {name: env[name] for name in (*DETERMINISM_ENV, *CPU_PINS)},
        "set_by_default": set_by_default,
        "violations": violations,
        "warnings": warning_lines,
    }
    if configure_torch:
        # warn_only=False on CPU too: the ops the stack uses on CPU (matmul and its backward,
        # index_add_, scatter_add_, index_put_ with accumulate, sort, cumsum, softmax/norm
        # backward, fp8 casts, ...) all have deterministic CPU kernels in torch 2.13, checked
        # one by one; a nondeterministic op should fail loudly here, not drift quietly.
        _deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # the stack fills its own: empty()
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False  # benchmarking picks kernels by timing
        if num_threads is not None:
            torch.set_num_threads(num_threads)
            # numpy's BLAS (the emulated GEMM's exact float64 block dots, parity.fp8.gemm) keeps a
            # pool of its own, sized to the host: its idle threads spin, and 8 ranks on 2 cores
            # then run 3x slower. Its sums are exact, so the count changes time, not bits.
            threadpoolctl.threadpool_limits(num_threads, user_api="blas")
        applied["torch"] = {
            "use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn.deterministic": torch.backends.cudnn.deterministic,
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
            # torch's fill of every new tensor (off: the stack's buffers come from empty(), filled)
            "fill_uninitialized_memory": torch.utils.deterministic.fill_uninitialized_memory,
            "num_threads": torch.get_num_threads(),
            "blas_threads": [pool["num_threads"] for pool in blas_pools()],
        }
    return applied
