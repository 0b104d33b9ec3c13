"""parity's E8M0 encode, decode and quantization scale against the plain field-by-field bit rules
(the form docs/spec/te.md 2.2 states them in, and parity's code before the table / carry forms):
bit equality on all 256 codes, or with --exhaustive on every one of the 2^32 fp32 bit patterns
(about 10 minutes on one core), and the time per call of both forms on MXFP8 scale-grid shapes.
Prints numbers; asserts nothing.

    python tools/bench_e8m0.py [--exhaustive] [--calls 2000]
"""

from __future__ import annotations

import argparse
import time


def rule_encode(v):
    """E8M0 of v rounded up, from the exponent field E and mantissa field F."""
    import torch

    bits = v.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    round_up = (man > 0) & (exp != 254) & ~((exp == 0) & (man <= 0x400000))
    e = exp + round_up.to(torch.int32)
    return torch.where(exp == 255, torch.where(man == 0, 254, 255), e).to(torch.uint8)


def rule_decode(e):
    import torch

    ei = e.to(torch.int32)
    bits = torch.where(ei == 0, 0x00400000, ei << 23)
    return torch.where(ei == 255, 0x7FC00000, bits).view(torch.float32)


def rule_quant_scale(e):
    import torch

    k = 254 - e.to(torch.int32)
    bits = torch.where(k >= 1, k << 23, 0x00400000)
    return torch.where(k < 0, 0x7FC00000, bits).view(torch.float32)


def _per_call_us(fn, arg, calls):
    for _ in range(20):
        fn(arg)
    t = time.perf_counter()
    for _ in range(calls):
        fn(arg)
    return (time.perf_counter() - t) / calls * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exhaustive", action="store_true", help="encode: all 2^32 fp32 bit patterns")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    import torch

    from parity.fp8.formats import e8m0_from_fp32, e8m0_quant_scale, e8m0_to_fp32

    torch.set_num_threads(1)
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    for name, fast, rule in (("decode", e8m0_to_fp32, rule_decode), ("quant scale", e8m0_quant_scale, rule_quant_scale)):
        n = int((fast(codes).view(torch.int32) != rule(codes).view(torch.int32)).sum())
        print(f"{name}: {n} of 256 codes differ from the bit rule")
    if args.exhaustive:
        t0, bad = time.time(), 0
        for c in range(256):  # 2^24 patterns at a time
            lo = (c << 24) - (1 << 31)
            v = torch.arange(lo, lo + (1 << 24), dtype=torch.int64).to(torch.int32).view(torch.float32)
            bad += int((e8m0_from_fp32(v) != rule_encode(v)).sum())
        print(f"encode: {bad} of 2^32 fp32 bit patterns differ from the bit rule ({time.time() - t0:.0f} s)")
    for shape in ((64, 8), (256, 8), (1024, 32)):
        v = torch.rand(shape) * 2.0 ** torch.randint(-130, 10, shape).float()
        e = e8m0_from_fp32(v)
        row = []
        for name, fast, rule, arg in (("encode", e8m0_from_fp32, rule_encode, v),
                                      ("decode", e8m0_to_fp32, rule_decode, e),
                                      ("quant scale", e8m0_quant_scale, rule_quant_scale, e)):
            row.append(f"{name} {_per_call_us(rule, arg, args.calls):.1f} -> {_per_call_us(fast, arg, args.calls):.1f} us")
        print(f"{shape[0]}x{shape[1]} (bit rule -> parity): " + ", ".join(row))


if __name__ == "__main__":
    main()
