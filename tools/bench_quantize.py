#!/usr/bin/env python
"""Quantize throughput of parity.fp8 (blockwise 1x128, 128x128, MXFP8) next to the device's copy bandwidth.

Throughput counts bytes read (the high-precision input) plus bytes written (every storage tensor
of the result: data and scale grids of both usages). The copy bandwidth is measured in the same
run with ``dst.copy_(x)`` on a tensor of the same size (read + write bytes), so the ratio says how
far the quantizer is from a memory-bound kernel on that device.

    python tools/bench_quantize.py                      # CPU (and CUDA when available), default sizes
    python tools/bench_quantize.py --sizes 8192x8192 --devices cuda --repeat 20
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.fp8 import quantize  # noqa: E402

RECIPES = [("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", "1x32")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, repeat: int, warmup: int) -> float:
    """Median wall time of fn() in seconds."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _parse_size(s: str):
    try:
        m, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 4096x4096, got {s!r}") from None
    return m, k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated MxK sizes (default: 1024x4096,4096x4096; adds 8192x8192 on CUDA)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    ap.add_argument("--devices", default=None,
                    help="comma-separated devices (default: cpu, plus cuda when available)")
    ap.add_argument("--repeat", type=int, default=None, help="timed repetitions (default 3 on CPU, 20 on CUDA)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed warm-up calls (default 1)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for the CPU runs")
    ap.add_argument("--rowwise-only", action="store_true", help="quantize the rowwise usage only")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = args.devices.split(",") if args.devices else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    dtype = DTYPES[args.dtype]
    print(f"torch {torch.__version__}, CPU threads {torch.get_num_threads()}, input {args.dtype}, "
          f"usages {'rowwise' if args.rowwise_only else 'rowwise+columnwise'}")
    for dev_name in devices:
        device = torch.device(dev_name)
        if device.type == "cuda":
            if not torch.cuda.is_available():
                print("cuda: not available, skipped")
                continue
            print(f"device cuda: {torch.cuda.get_device_name(device)}")
        else:
            print("device cpu")
        if args.sizes:
            sizes = [_parse_size(s) for s in args.sizes.split(",")]
        else:
            sizes = [(1024, 4096), (4096, 4096)] + ([(8192, 8192)] if device.type == "cuda" else [])
        repeat = args.repeat or (20 if device.type == "cuda" else 3)
        header = f"  {'recipe':<20} {'shape':>11} {'ms':>9} {'GB/s':>8} {'copy GB/s':>10} {'% of copy':>9}"
        print(header)
        for (M, K) in sizes:
            g = torch.Generator(device=device).manual_seed(0)
            x = torch.randn(M, K, device=device, dtype=torch.float32, generator=g).to(dtype)
            dst = torch.empty_like(x)
            t_copy = _time(lambda: dst.copy_(x), device, max(repeat, 5), args.warmup)
            copy_bw = 2 * x.numel() * x.element_size() / t_copy / 1e9
            for recipe, block in RECIPES:
                kw = dict(block=block, columnwise=not args.rowwise_only)
                q = quantize(x, recipe, **kw)
                nbytes = x.numel() * x.element_size() + q.nbytes
                t = _time(lambda: quantize(x, recipe, **kw), device, repeat, args.warmup)
                bw = nbytes / t / 1e9
                print(f"  {recipe + ' ' + block:<20} {f'{M}x{K}':>11} {t * 1e3:9.2f} {bw:8.2f} "
                      f"{copy_bw:10.1f} {100 * bw / copy_bw:8.1f}%")
            del x, dst
    return 0


if __name__ == "__main__":
    sys.exit(main())
