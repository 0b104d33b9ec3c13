#!/usr/bin/env python
"""Registers, spills and SASS instructions per element of the Triton quantizer kernels, compiled
for a GPU target without a GPU (Triton ships ptxas and cuobjdump).

The kernels of parity/fp8/triton_quantize.py are compiled as a launch on aligned 8192x8192 bf16
tensors would specialise them (16-divisible pointers and sizes, full tiles), with the tile
configs of its CONFIG. "instr/elt" is the number of SASS instructions of the kernel divided by the
elements one thread quantizes: a memory-bound kernel must issue few, as every element of a
quantizer moves 4 bytes while an H200 SM issues 4 warp instructions a cycle.

    pip install triton                          # any machine; the CPU build of torch is enough
    python tools/triton_sass.py                 # sm_90 (Hopper)
    python tools/triton_sass.py --arch 100      # sm_100
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as exc:  # pragma: no cover - depends on the environment
    triton = None
    _IMPORT_ERROR = exc

from parity.fp8 import triton_quantize as tq

_DIVISIBLE = ("x_ptr", "rq_ptr", "rs_ptr", "cq_ptr", "cs_ptr", "M", "K")
_BW_SIG = dict(x_ptr="*bf16", rq_ptr="*u8", rs_ptr="*fp32", cq_ptr="*i32", cs_ptr="*fp32", M="i32", K="i32",
               rs_ld="i32", cs_ld="i32", eps="fp32", vinf_bits="i32")
_MX_SIG = dict(x_ptr="*bf16", rq_ptr="*u8", rs_ptr="*u8", cq_ptr="*u8", cs_ptr="*u8", M="i32", K="i32",
               rs_ld="i32", cs_ld="i32")
_FLAGS = dict(FMAX=448.0, E5=False, EVEN=True, OFF64=False, SAT=True, ASM=True)
_BW_FLAGS = dict(_FLAGS, FEXP=8, FFRAC=0x600000, POW2=True, PACK=True)


def _compile(fn, sig, consts, num_warps, arch):
    sig = dict(sig, **{k: "constexpr" for k in consts})
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in _DIVISIBLE}
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options=dict(num_warps=num_warps, enable_fp_fusion=False, enable_reflect_ftz=False))


def _resources(kernel) -> tuple[int, int, collections.Counter]:
    """(registers, stack bytes, SASS opcode counts) of a compiled kernel."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(f.name)
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            ops[m.group(2)] += 1
    return int(re.search(r"REG:(\d+)", usage).group(1)), int(re.search(r"STACK:(\d+)", usage).group(1)), ops


def cases():
    """(name, kernel, signature, constexprs, num_warps, elements per thread) for each CONFIG entry."""
    c = tq.CONFIG
    both = dict(c["1x128_both"])
    one = [("1x128 rowwise", True, False, c["1x128_row"]), ("1x128 columnwise", False, True, c["1x128_col"])]
    if both.pop("PAIR", False):
        # each program of _bw_pair_kernel runs one branch, the code of _bw_kernel for one usage
        # with these tiles: its cost per element of both usages is the sum of the two lines
        w = both["num_warps"]
        one += [("1x128 both: rows", True, False, dict(SUB=both["RSUB"], BC=128, num_warps=w)),
                ("1x128 both: columns", False, True, dict(SUB=32, BC=both["CBC"], num_warps=w))]
    else:
        one.append(("1x128 both", True, True, both))
    out = []
    for name, row, col, cfg in one:
        cfg = dict(cfg)
        w = cfg.pop("num_warps")
        out.append((name, tq._bw_kernel, _BW_SIG, dict(_BW_FLAGS, TILE2D=False, DO_ROW=row, DO_COL=col, **cfg), w,
                    4 * cfg["SUB"] * cfg["BC"] / (32 * w)))
    w = c["128x128"]["num_warps"]
    out.append(("128x128 both", tq._bw_kernel, _BW_SIG,
                dict(_BW_FLAGS, TILE2D=True, DO_ROW=True, DO_COL=True, SUB=32, BC=128), w, 128 * 128 / (32 * w)))
    cfg = dict(c["mxfp8"])
    w = cfg.pop("num_warps")
    out.append(("mxfp8 both", tq._mx_kernel, _MX_SIG,
                dict(_FLAGS, RCP=1 / 448.0, DO_ROW=True, DO_COL=True, **cfg), w, 32 * 32 * cfg["NB"] / (32 * w)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: sm_90)")
    args = ap.parse_args(argv)
    if triton is None:
        print(f"error: triton is not importable ({_IMPORT_ERROR})", file=sys.stderr)
        return 2
    print(f"triton {triton.__version__}, sm_{args.arch}, bf16 input, e4m3, power-of-two scales, full tiles")
    print(f"  {'kernel':<20} {'config':<48} {'regs':>4} {'stack':>5} {'sass':>5} {'instr/elt':>9}  top opcodes")
    for name, fn, sig, consts, w, elts in cases():
        regs, stack, ops = _resources(_compile(fn, sig, consts, w, args.arch))
        n = sum(ops.values())
        cfg = {k: v for k, v in consts.items() if k in ("SUB", "BC", "RSUB", "CBC", "NB")}
        top = " ".join(f"{op}:{k}" for op, k in ops.most_common(6))
        print(f"  {name:<20} {str(dict(cfg, num_warps=w)):<48} {regs:4d} {stack:5d} {n:5d} {n / elts:9.2f}  {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
