"""Throughput of parity's bit-exact comparison against a bare torch.equal.

For each device (CPU, and CUDA when available) and dtype (fp32, bf16), two equal
tensors of --size-mib MiB each are compared with:

* ``torch.equal`` on their integer views (the floor: one pass, no bookkeeping);
* ``compare_tensors`` (parity's fast path: validation + the same torch.equal);
* ``compare_tensors`` when one element differs (the statistics path: ULP
  histogram, counts, first index), with --mismatch.

Throughput is the size of ONE operand divided by the median wall time, in GB/s
(10^9 bytes). CUDA timings synchronize before and after each call.

Usage:
    python tools/bench_compare.py                    # 256 MiB, CPU (+ CUDA)
    python tools/bench_compare.py --size-mib 64 --repeats 3 --mismatch
    python tools/bench_compare.py --devices cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch


from parity.harness.compare import bit_view, compare_tensors  # noqa: E402


def _time(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median seconds per call after one warm-up call."""

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(
    device: torch.device, dtype: torch.dtype, size_mib: int, repeats: int, mismatch: bool
) -> list[tuple[str, float, float]]:
    """Rows of (method, seconds per call, GB/s) for one device and dtype."""
    nbytes = size_mib * (1 << 20)
    numel = nbytes // torch.empty((), dtype=dtype).element_size()
    a = torch.randn(numel, device=device, dtype=torch.float32).to(dtype)
    b = a.clone()
    va, vb = bit_view(a), bit_view(b)
    rows = []
    for name, fn in (
        ("torch.equal (int views)", lambda: torch.equal(va, vb)),
        ("compare_tensors (equal)", lambda: compare_tensors(a, b, "bench")),
    ):
        t = _time(fn, device, repeats)
        rows.append((name, t, nbytes / t / 1e9))
    if mismatch:
        c = b.clone()
        bit_view(c)[numel // 2] ^= 1
        t = _time(lambda: compare_tensors(a, c, "bench"), device, max(1, repeats // 2))
        rows.append(("compare_tensors (1 differs)", t, nbytes / t / 1e9))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Throughput (GB/s) of parity's compare_tensors vs torch.equal on equal tensors."
    )
    p.add_argument("--size-mib", type=int, default=256, help="size of each tensor in MiB (default 256)")
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measurement; the median is shown")
    p.add_argument("--devices", nargs="+", default=None, help="devices to run on (default: cpu, and cuda if available)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], help="dtypes (default float32 bfloat16)")
    p.add_argument("--mismatch", action="store_true", help="also time the statistics path (one element differs)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.size_mib <= 0 or args.repeats <= 0:
        p.error("--size-mib and --repeats must be positive")

    devices = args.devices or (["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} CPU threads, {args.size_mib} MiB per tensor, "
          f"median of {args.repeats}")
    print(f"{'device':8s} {'dtype':9s} {'method':30s} {'ms':>9s} {'GB/s':>8s}")
    for dev_name in devices:
        device = torch.device(dev_name)
        if device.type == "cuda" and not torch.cuda.is_available():
            print(f"{dev_name}: CUDA not available, skipped")
            continue
        label = dev_name if device.type == "cpu" else f"{dev_name} ({torch.cuda.get_device_name(device)})"
        print(f"# {label}")
        for dt_name in args.dtypes:
            dtype = getattr(torch, dt_name, None)
            if not isinstance(dtype, torch.dtype):
                p.error(f"unknown dtype {dt_name!r}")
            for name, t, gbs in bench(device, dtype, args.size_mib, args.repeats, args.mismatch):
                print(f"{dev_name:8s} {dt_name:9s} {name:30s} {t * 1e3:9.2f} {gbs:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
