"""parity.distributed.pins: the CPU pins a process sets before torch loads (no ranks, one fresh
interpreter for the before-torch case; the pins' effect on the bits is in test_cpu_pins.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from parity.distributed import pins

CPUINFO = """processor\t: 0
vendor_id\t: TestVendor
model name\t: Test CPU @ 2.0GHz
flags\t\t: fpu sse2 avx2 fma
Flags-like\t: not this one

processor\t: 1
model name\t: Another CPU
flags\t\t: fpu
"""


@pytest.fixture
def cpuinfo(tmp_path, monkeypatch):
    """pins reads this file as /proc/cpuinfo."""
    f = tmp_path / "cpuinfo"
    real_open = open

    def fake_open(path, *args, **kwargs):
        return real_open(f if path == "/proc/cpuinfo" else path, *args, **kwargs)

    monkeypatch.setattr(pins, "open", fake_open, raising=False)
    return f


def test_cpuinfo_fields_are_the_first_cpus(cpuinfo):
    cpuinfo.write_text(CPUINFO)
    assert pins.cpuinfo_field("model name") == "Test CPU @ 2.0GHz"
    assert pins.cpuinfo_field("vendor_id") == "TestVendor"
    assert pins.cpuinfo_field("bogomips") is None
    assert pins.cpu_flags() == frozenset({"fpu", "sse2", "avx2", "fma"})
    cpuinfo.unlink()  # no /proc/cpuinfo (not Linux): unknown, not an error
    assert pins.cpuinfo_field("flags") is None and pins.cpu_flags() is None


@pytest.mark.parametrize("machine, flags, want", [
    ("x86_64", "avx2 fma", True),      # exactly the two it needs
    ("AMD64", "sse2 avx2 fma avx512f", True),
    ("x86_64", "sse2 avx2", False),    # no FMA: the Haswell kernels would stop numpy's import
    ("aarch64", "avx2 fma", False),
    ("x86_64", None, False),           # flags unknown
])
def test_haswell_kernels_only_where_the_cpu_runs_them(cpuinfo, monkeypatch, machine, flags, want):
    if flags is not None:
        cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(pins.platform, "machine", lambda: machine)
    assert pins._has_avx2_fma() is want


def test_pinned_environ_sets_the_unset_pins_for_its_duration(monkeypatch):
    # the pins and one BLAS thread: a fork server or spawned rank loads numpy's OpenBLAS that way
    assert pins.LOAD_ENV == {**pins.CPU_PINS, "OPENBLAS_NUM_THREADS": "1"}
    for name in pins.LOAD_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MKL_CBWR", "AUTO")  # the caller's own value stays, during and after
    with pins.pinned_environ():
        assert os.environ["MKL_CBWR"] == "AUTO"
        for name, value in pins.LOAD_ENV.items():
            if name != "MKL_CBWR":
                assert os.environ[name] == value
    assert os.environ["MKL_CBWR"] == "AUTO"
    assert not any(name in os.environ for name in pins.LOAD_ENV if name != "MKL_CBWR")


_FRESH = """
import json, os, sys
from parity.distributed.pins import CPU_PINS, pin_before_torch, pinned_before_torch
before = pinned_before_torch()
did = pin_before_torch()
out = {"before": before, "did": did, "after": pinned_before_torch(), "torch": "torch" in sys.modules,
       "env": {k: os.environ.get(k) for k in [*CPU_PINS, "OPENBLAS_NUM_THREADS"]}, "pins": CPU_PINS}
import numpy  # a process that loaded numpy (torch loads it) can no longer be pinned
out["again"] = pin_before_torch()
print(json.dumps(out))
"""


def test_pin_before_torch_pins_a_fresh_process_and_only_before_torch():
    import torch  # noqa: F401  (this process loaded torch long ago: too late to pin it)

    assert pins.pin_before_torch() is False
    env = {k: v for k, v in os.environ.items() if k not in (*pins.CPU_PINS, "OPENBLAS_NUM_THREADS")}
    env["MKL_CBWR"] = "AUTO"  # set by the caller: kept
    r = subprocess.run([sys.executable, "-c", _FRESH], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["before"], out["did"], out["after"], out["torch"], out["again"]) == (False, True, True, False, False)
    assert out["env"] == {**out["pins"], "MKL_CBWR": "AUTO", "OPENBLAS_NUM_THREADS": "1"}
