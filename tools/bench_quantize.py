#!/usr/bin/env python
"""Quantizer throughput (blockwise 1x128, 128x128, MXFP8; torch and Triton) next to a bf16 copy.

GB/s counts bytes read (the high-precision input) plus bytes written (every storage tensor of the
result: data and scale grids of both usages), so a quantizer that reads x once and writes both FP8
usages moves as many bytes as ``dst.copy_(x)``; "x copy" is the ratio to the copy's GB/s, measured
the same way in the same process right before. Each figure is the median over ``--repeat`` batches
of ``--calls`` back-to-back calls timed with CUDA events (what a stream of quantize() calls gets,
Python and launch overhead included). On CUDA the Triton rows add two diagnostics: "graph", the
same calls replayed from a CUDA graph (device time alone, no host overhead), and "host us", the
host time to issue one call.

    python tools/bench_quantize.py                          # CUDA when available, else CPU
    python tools/bench_quantize.py --devices cpu --calls 2 --repeat 3
    python tools/bench_quantize.py --sizes 8192x8192 --backends triton
    python tools/bench_quantize.py --sweep                  # alternative Triton tiles at 8192x8192
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time

import torch


from parity.fp8 import quantize  # noqa: E402
from parity.fp8 import triton_quantize as tq  # noqa: E402

qmod = importlib.import_module("parity.fp8.quantize")  # the module (parity.fp8.quantize is also the function)

RECIPES = [("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", "1x32")]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: alternatives tried by --sweep (the current tq.CONFIG entry is always timed first)
SWEEP = {
    # one program per 128x128 tile, or the tile shared by rowwise and columnwise programs (PAIR)
    "1x128_both": [{"SUB": 32, "BC": 128, "num_warps": 4}, {"SUB": 32, "BC": 128, "num_warps": 8}] + [
        {"PAIR": True, "RSUB": r, "CBC": c, "num_warps": w}
        for r, c, w in ((8, 32, 1), (8, 32, 2), (8, 32, 4), (16, 32, 2), (16, 32, 4), (16, 64, 4),
                        (4, 32, 1), (4, 32, 2), (8, 16, 1), (8, 64, 2))],
    "1x128_row": [{"SUB": 8, "BC": 128, "num_warps": 4}, {"SUB": 16, "BC": 128, "num_warps": 8}],
    "1x128_col": [{"SUB": 32, "BC": 32, "num_warps": 2}, {"SUB": 32, "BC": 64, "num_warps": 4}],
    "128x128": [{"num_warps": 2}, {"num_warps": 4}, {"num_warps": 8}],
    "mxfp8": [{"NB": 1, "num_warps": 1}, {"NB": 2, "num_warps": 1}, {"NB": 2, "num_warps": 2},
              {"NB": 4, "num_warps": 1}, {"NB": 4, "num_warps": 2}, {"NB": 4, "num_warps": 4},
              {"NB": 8, "num_warps": 2}, {"NB": 8, "num_warps": 4}],
}
SWEEP_CALL = {"1x128_both": ("blockwise", "1x128", True, True),
              "1x128_row": ("blockwise", "1x128", True, False),
              "1x128_col": ("blockwise", "1x128", False, True),
              "128x128": ("blockwise", "128x128", True, True),
              "mxfp8": ("mxfp8", "1x32", True, True)}


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device, calls: int, repeat: int, warmup: int = 2) -> float:
    """Median seconds per call over `repeat` batches of `calls` back-to-back calls."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3 / calls)
        else:
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - t0) / calls)
    return statistics.median(times)


def _graph_time(fn, calls: int, repeat: int):
    """Seconds per call with `calls` calls captured in one CUDA graph (device time only), or None."""
    try:
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        return _time(graph.replay, torch.device("cuda"), 1, repeat, warmup=1) / calls
    except Exception as exc:  # a diagnostic column: report why it is missing, keep the table
        print(f"    (graph timing unavailable: {type(exc).__name__}: {exc})")
        return None


def _host_time(fn, calls: int) -> float:
    """Host seconds to issue one call (the GPU queue is deep enough that `calls` never block)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t = (time.perf_counter() - t0) / calls
    torch.cuda.synchronize()
    return t


def _parse_size(s: str):
    try:
        m, k = (int(v) for v in s.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size must look like 4096x4096, got {s!r}") from None
    return m, k


def _set_backend(name: str):
    qmod.USE_TRITON = name == "triton"


def bench(device, sizes, dtype, backends, calls, repeat, rowwise_only) -> None:
    print(f"  {'recipe':<18} {'size':>10} {'backend':>7} {'us/call':>9} {'GB/s':>8} {'x copy':>7}"
          f" {'graph us':>9} {'graph x':>8} {'host us':>8}")
    for (M, K) in sizes:
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randn(M, K, device=device, dtype=torch.float32, generator=g).to(dtype)
        dst = torch.empty_like(x)
        t_copy = _time(lambda: dst.copy_(x), device, calls, repeat)
        copy_bw = 2 * x.numel() * x.element_size() / t_copy / 1e9
        print(f"  {'copy_':<18} {f'{M}x{K}':>10} "
              f"{'torch':>7} {t_copy * 1e6:9.1f} {copy_bw:8.1f} {1.0:7.2f}")
        for recipe, block in RECIPES:
            kw = dict(block=block, columnwise=not rowwise_only)
            for backend in backends:
                _set_backend(backend)
                fn = lambda: quantize(x, recipe, **kw)  # noqa: E731
                nbytes = x.numel() * x.element_size() + fn().nbytes
                t = _time(fn, device, calls, repeat)
                bw = nbytes / t / 1e9
                line = (f"  {recipe + ' ' + block:<18} {f'{M}x{K}':>10} {backend:>7} {t * 1e6:9.1f} "
                        f"{bw:8.1f} {bw / copy_bw:7.2f}")
                if backend == "triton":
                    th = statistics.median(_host_time(fn, calls) for _ in range(repeat))
                    tg = _graph_time(fn, calls, repeat)
                    if tg is not None:
                        line += f" {tg * 1e6:9.1f} {nbytes / tg / 1e9 / copy_bw:8.2f}"
                    else:
                        line += f" {'n/a':>9} {'n/a':>8}"
                    line += f" {th * 1e6:8.1f}"
                print(line)
        x = dst = None  # free before the next size
        if device.type == "cuda":
            torch.cuda.empty_cache()
    _set_backend("triton")


def _same(a, b) -> bool:
    return all(torch.equal(getattr(a, p), getattr(b, p)) for p in
               ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
               if getattr(a, p) is not None or getattr(b, p) is not None)


def sweep(device, dtype, calls, repeat) -> None:
    """Alternative Triton tile configs at 8192x8192: device time (graph), and whether they give the
    bytes of the current config there and of the torch path on a 992x1024 slice in every input
    dtype ("BYTES DIFFER" otherwise)."""
    _set_backend("triton")
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(8192, 8192, device=device, dtype=torch.float32, generator=g).to(dtype)
    dst = torch.empty_like(x)
    copy_bw = 2 * x.numel() * x.element_size() / _time(lambda: dst.copy_(x), device, calls, repeat) / 1e9
    print(f"  copy {copy_bw:.1f} GB/s")
    for key, alts in SWEEP.items():
        recipe, block, row, col = SWEEP_CALL[key]
        kw = dict(block=block, rowwise=row, columnwise=col)
        default = dict(tq.CONFIG[key])
        base = quantize(x, recipe, **kw)
        nbytes = x.numel() * x.element_size() + base.nbytes
        small = [x[:992, :1024].to(dt).contiguous() for dt in DTYPES.values()]  # partial 128-row tiles
        _set_backend("torch")
        small_ref = [quantize(s, recipe, **kw) for s in small]
        _set_backend("triton")
        for cfg in [default] + [a for a in alts if a != default]:
            tq.CONFIG[key] = dict(cfg)
            try:
                same = all(_same(quantize(s, recipe, **kw), r) for s, r in zip(small, small_ref))
                q = quantize(x, recipe, **kw)
                compiled = next(reversed(tq._PLANS.values())).compiled  # the kernel this config compiled
                same = same and _same(q, base)
                tg = _graph_time(lambda: quantize(x, recipe, **kw), calls, repeat)
                t = _time(lambda: quantize(x, recipe, **kw), device, calls, repeat)
                print(f"  {key:<11} {str(cfg):<44} regs {compiled.n_regs:3d} spills {compiled.n_spills} "
                      f"calls {nbytes / t / 1e9 / copy_bw:5.2f}x  graph "
                      + (f"{nbytes / tg / 1e9 / copy_bw:5.2f}x {tg * 1e6:7.1f} us" if tg else "n/a")
                      + ("" if same else "  BYTES DIFFER") + ("  [current]" if cfg == default else ""))
            except Exception as exc:
                print(f"  {key:<11} {str(cfg):<44} ERROR {type(exc).__name__}: {str(exc).splitlines()[0][:100]}")
            finally:
                tq.CONFIG[key] = default
    old = tq.get_math_mode()
    tq.set_math_mode("tl" if old == "asm" else "asm")
    for key in ("1x128_both", "128x128", "mxfp8"):
        recipe, block, row, col = SWEEP_CALL[key]
        fn = lambda: quantize(x, recipe, block=block)  # noqa: E731
        nbytes = x.numel() * x.element_size() + fn().nbytes
        tg = _graph_time(fn, calls, repeat)
        print(f"  {key:<11} math mode {tq.get_math_mode()!r}: graph {nbytes / tg / 1e9 / copy_bw:5.2f}x {tg * 1e6:7.1f} us")
    tq.set_math_mode(old)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default=None,
                    help="comma-separated MxK sizes (default: 1024x1024,4096x4096,8192x8192 on CUDA, "
                         "1024x1024,4096x4096 on CPU)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="input dtype (default bf16)")
    ap.add_argument("--devices", "--device", dest="devices", default=None,
                    help="comma-separated cuda,cpu (default: cuda when available, else cpu)")
    ap.add_argument("--backends", default=None,
                    help="comma-separated: torch,triton (default: both on CUDA when triton imports)")
    ap.add_argument("--calls", type=int, default=20, help="back-to-back calls per timed batch (default 20)")
    ap.add_argument("--repeat", type=int, default=5, help="timed batches; the median is shown (default 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for CPU runs")
    ap.add_argument("--rowwise-only", action="store_true", help="quantize the rowwise usage only")
    ap.add_argument("--sweep", action="store_true", help="time alternative Triton tile configs instead")
    args = ap.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    devices = [torch.device(d) for d in (args.devices or ("cuda" if torch.cuda.is_available() else "cpu")).split(",")]
    if any(d.type == "cuda" for d in devices) and not torch.cuda.is_available():
        print("error: CUDA is not available", file=sys.stderr)
        return 2
    triton_ok = torch.cuda.is_available() and tq.triton_available()
    wanted = args.backends.split(",") if args.backends else None
    if wanted and any(b not in ("torch", "triton") for b in wanted):
        print(f"error: unknown backend in {args.backends!r} (torch, triton)", file=sys.stderr)
        return 2
    if wanted and "triton" in wanted and not (triton_ok and all(d.type == "cuda" for d in devices)):
        print(f"error: the Triton backend needs CUDA and triton ({tq.triton_unavailable_reason()})",
              file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    print(f"torch {torch.__version__}, triton {getattr(tq.triton, '__version__', 'n/a')}, input {args.dtype}, "
          f"usages {'rowwise' if args.rowwise_only else 'rowwise+columnwise'}, "
          f"{args.calls} calls x {args.repeat} batches")
    if args.sweep:
        if not triton_ok:
            print("error: --sweep needs CUDA and triton", file=sys.stderr)
            return 2
        print(f"device cuda: {torch.cuda.get_device_name()}")
        sweep(torch.device("cuda"), dtype, args.calls, args.repeat)
        return 0
    for device in devices:
        print(f"device {device.type}: " + (torch.cuda.get_device_name(device) if device.type == "cuda"
                                           else f"{torch.get_num_threads()} threads"))
        if args.sizes:
            sizes = [_parse_size(s) for s in args.sizes.split(",")]
        else:
            sizes = [(1024, 1024), (4096, 4096)] + ([(8192, 8192)] if device.type == "cuda" else [])
        backends = wanted or (["torch", "triton"] if device.type == "cuda" and triton_ok else ["torch"])
        bench(device, sizes, dtype, backends, args.calls, args.repeat, args.rowwise_only)
    return 0


if __name__ == "__main__":
    sys.exit(main())
