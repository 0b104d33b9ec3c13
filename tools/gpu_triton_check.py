#!/usr/bin/env python
"""Triton quantizers (parity/fp8/triton_quantize.py) == torch quantizers (parity/fp8/quantize.py),
byte for byte, on one CUDA GPU; then their throughput next to the torch path and copy bandwidth.

    python tools/gpu_triton_check.py --json triton_check.json

Sections (each prints as it goes and is also written to the JSON file after it finishes):

1. probes: fp32 division (inline PTX div.rn.f32, tl.math.div_rn, Triton ``/``), multiply
   (mul.rn.f32, ``*``) and the fp32 -> fp8 cast of Triton, each against torch on special operands
   (subnormals included). They say which primitive is wrong if a case below differs.
2. cases: OK / DIFF / ERROR per case (math mode "asm"). A DIFF prints the first differing index,
   part, both values in hex and the input element (data) or block (scale grid). An ERROR prints
   the exception (Triton compile errors included); later cases of the same kernel variant that
   would fail the same way are skipped. Failing cases are re-run in math mode "tl".
3. dispatch: quantize() with PARITY_TRITON_QUANTIZE routing, and requantize_().
4. bench: GB/s of torch vs triton vs copy (bf16 4096x4096 and 8192x8192; rowwise+columnwise and
   rowwise only), plus a few alternative tile configs of the Triton kernels (checked byte-equal).

Exit status: 0 only if every case of section 2 (default math mode) and the dispatch checks are
identical; 1 otherwise; 2 without CUDA or triton.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parity.fp8 import quantize  # noqa: E402
from parity.fp8 import triton_quantize as tq  # noqa: E402
from parity.fp8.formats import cast_to_fp8  # noqa: E402

qmod = importlib.import_module("parity.fp8.quantize")  # the module (parity.fp8.quantize is also the function)

PARTS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv")
RESULTS: dict = {"env": {}, "probes": {}, "cases": [], "retry_tl": [], "dispatch": [], "bench": [], "configs": []}
JSON_PATH = None


def out(*a):
    print(*a, flush=True)


def save():
    if JSON_PATH:
        Path(JSON_PATH).write_text(json.dumps(RESULTS, indent=1, default=str))


def f32_from_bits(bits):
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


def hexbits(t: torch.Tensor) -> str:
    t = t.detach().cpu().reshape(1)
    if t.dtype == torch.float32:
        return f"0x{int(t.view(torch.int32)[0]) & 0xFFFFFFFF:08X}"
    if t.dtype == torch.int32:
        return f"0x{int(t[0]) & 0xFFFFFFFF:08X}"
    if t.dtype in (torch.bfloat16, torch.float16):
        return f"0x{int(t.view(torch.int16)[0]) & 0xFFFF:04X}"
    return f"0x{int(t[0]) & 0xFF:02X}"


def err_text(exc: BaseException, limit: int = 60) -> str:
    lines = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).splitlines()
    if len(lines) > limit:
        lines = lines[:10] + ["    ..."] + lines[-(limit - 11):]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# 1. probes
# ------------------------------------------------------------------------------------------------

def probe_operands(dev):
    """Positive fp32 operands over the whole range: random, subnormal, powers of two, maxima."""
    g = torch.Generator().manual_seed(11)
    def bits_range(lo, hi, n):
        return torch.randint(lo, hi, (n,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)

    rnd = bits_range(1, 0x7F800000, 200_000)
    special = f32_from_bits([0x00000001, 0x00000002, 0x003FFFFF, 0x00400000, 0x007FFFFF, 0x00800000,
                             0x00800001, 0x0DA24260, 0x3F800000, 0x3F800001, 0x43E00000, 0x47600000,
                             0x7F000000, 0x7F7F0000, 0x7F7FFFFF, 0x7F800000, 0x00000000])
    sub = bits_range(1, 0x00800000, 20_000)
    return torch.cat([rnd, special, sub]).to(dev)


def probe_kernels():
    """The three probe kernels (division, multiply, fp8 cast)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _probe_div(n_ptr, d_ptr, o_asm, o_tl, o_slash, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        n = tl.load(n_ptr + i, mask=m, other=1.0)
        d = tl.load(d_ptr + i, mask=m, other=1.0)
        tl.store(o_asm + i, tl.inline_asm_elementwise("div.rn.f32 $0, $1, $2;", "=f,f,f", [n, d],
                                                      dtype=tl.float32, is_pure=True, pack=1), mask=m)
        tl.store(o_tl + i, tl.math.div_rn(n, d), mask=m)
        tl.store(o_slash + i, n / d, mask=m)

    @triton.jit
    def _probe_mul(a_ptr, b_ptr, o_asm, o_tl, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        a = tl.load(a_ptr + i, mask=m, other=1.0)
        b = tl.load(b_ptr + i, mask=m, other=1.0)
        tl.store(o_asm + i, tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                                      dtype=tl.float32, is_pure=True, pack=1), mask=m)
        tl.store(o_tl + i, a * b, mask=m)

    @triton.jit
    def _probe_cast(y_ptr, o4, o5, o4raw, o5raw, N, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = i < N
        y = tl.load(y_ptr + i, mask=m, other=0.0)
        c4 = tl.minimum(tl.maximum(y, -448.0), 448.0)
        c5 = tl.minimum(tl.maximum(y, -57344.0), 57344.0)
        tl.store(o4 + i, c4.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=m)
        tl.store(o5 + i, c5.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=m)
        tl.store(o4raw + i, y.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=m)
        tl.store(o5raw + i, y.to(tl.float8e5, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=m)

    return _probe_div, _probe_mul, _probe_cast


def run_probes(dev):
    import triton

    _probe_div, _probe_mul, _probe_cast = probe_kernels()
    B = 1024
    opts = dict(enable_fp_fusion=False, enable_reflect_ftz=False)

    def launch(k, n, *args):
        try:
            k[(triton.cdiv(n, B),)](*args, n, BLOCK=B, **opts)
        except KeyError:
            k[(triton.cdiv(n, B),)](*args, n, BLOCK=B)

    def compare(name, got, ref, a, b=None):
        gi, ri = got.view(torch.int32), ref.view(torch.int32)
        nan_both = torch.isnan(got) & torch.isnan(ref)
        bad = (gi != ri) & ~nan_both
        n = int(bad.sum())
        rec = {"mismatches": n}
        if n:
            j = int(bad.nonzero()[0, 0])
            rec["first"] = {"a": hexbits(a[j]), "b": hexbits(b[j]) if b is not None else None,
                            "got": hexbits(got[j]), "want": hexbits(ref[j])}
        out(f"  {name:<34} {'OK' if n == 0 else 'MISMATCH'} ({n} of {got.numel()})"
            + (f" first a={rec['first']['a']} b={rec['first']['b']} got={rec['first']['got']} "
               f"want={rec['first']['want']}" if n else ""))
        RESULTS["probes"][name] = rec

    ops = probe_operands(dev)
    N = ops.numel()
    # division: numerators as the scale rule uses them (fp8 max, 1.0), denominators over the range
    for num in (448.0, 57344.0, 1.0):
        n_t = torch.full_like(ops, num)
        o = [torch.empty_like(ops) for _ in range(3)]
        try:
            launch(_probe_div, N, n_t, ops, *o)
            ref = torch.div(n_t, ops)
            compare(f"div {num:g}/d asm div.rn.f32", o[0], ref, n_t, ops)
            compare(f"div {num:g}/d tl.math.div_rn", o[1], ref, n_t, ops)
            compare(f"div {num:g}/d triton '/' (expected inexact)", o[2], ref, n_t, ops)
        except Exception as exc:
            out(f"  div probe ERROR:\n{err_text(exc)}")
            RESULTS["probes"]["div_error"] = err_text(exc)
            break
    # multiply: x * s with subnormal x and subnormal / huge s
    g = torch.Generator().manual_seed(12)
    a = ops[torch.randperm(N, generator=g).to(dev)]
    s = f32_from_bits([0x00400000, 0x7F000000, 0x3F800000, 0x43000000]).to(dev)
    for sv in s:
        b = torch.full_like(a, float(sv))
        o = [torch.empty_like(a) for _ in range(2)]
        try:
            launch(_probe_mul, N, a, b, *o)
            ref = torch.mul(a, b)
            compare(f"mul x*{hexbits(sv)} asm mul.rn.f32", o[0], ref, a, b)
            compare(f"mul x*{hexbits(sv)} triton '*'", o[1], ref, a, b)
        except Exception as exc:
            out(f"  mul probe ERROR:\n{err_text(exc)}")
            RESULTS["probes"]["mul_error"] = err_text(exc)
            break
    # fp8 cast: all fp32 values near the fp8 grid, signs, specials
    g = torch.Generator().manual_seed(13)
    y = torch.cat([torch.randn(100_000, generator=g) * s_ for s_ in (1e-3, 1.0, 30.0, 500.0, 6e4)]
                  + [torch.linspace(-600, 600, 240_001),
                     f32_from_bits([0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x7F800000, 0xFF800000,
                                    0x7FC00000, 0xFFC00000, 0x7F7FFFFF, 0xFF7FFFFF, 0x43E00000, 0x43E80000,
                                    0x43F00000, 0x47600000, 0x47700000, 0x3A800000, 0x3A000000, 0xBA000000])]).to(dev)
    o = [torch.empty(y.numel(), dtype=torch.uint8, device=dev) for _ in range(4)]
    try:
        launch(_probe_cast, y.numel(), y, *o)
        for name, got, fmt in (("cast e4m3 (clamped)", o[0], "e4m3"), ("cast e5m2 (clamped)", o[1], "e5m2"),
                               ("cast e4m3 (no clamp, satfinite?)", o[2], "e4m3"),
                               ("cast e5m2 (no clamp, satfinite?)", o[3], "e5m2")):
            ref = cast_to_fp8(y, fmt)
            nan = torch.isnan(y)
            bad = (got != ref) & ~nan  # NaN bytes are forced to 0x7F by the kernels anyway
            n = int(bad.sum())
            rec = {"mismatches": n, "nan_bytes": sorted({int(v) for v in got[nan].tolist()})}
            if n:
                j = int(bad.nonzero()[0, 0])
                rec["first"] = {"y": hexbits(y[j]), "got": hexbits(got[j]), "want": hexbits(ref[j])}
            out(f"  {name:<34} {'OK' if n == 0 else 'MISMATCH'} ({n} of {y.numel()}) NaN bytes {rec['nan_bytes']}"
                + (f" first y={rec['first']['y']} got={rec['first']['got']} want={rec['first']['want']}" if n else ""))
            RESULTS["probes"][name] = rec
    except Exception as exc:
        out(f"  cast probe ERROR:\n{err_text(exc)}")
        RESULTS["probes"]["cast_error"] = err_text(exc)


# ------------------------------------------------------------------------------------------------
# 2. cases
# ------------------------------------------------------------------------------------------------

def edge_input(dtype, M=512, K=640):
    """Zero tile, subnormal tile, +-max tiles, inf, -inf, NaN, -NaN, an all-NaN tile, a -0.0 block,
    a saturating (non-pow2) block, and random data elsewhere."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(M, K, generator=g) * 3
    x[:128, :128] = 0.0
    x[128:256, :128] = 1e-39 if dtype == torch.float32 else 1e-38  # fp32 / bf16 subnormal (fp16: 0)
    x[128:130, 128:256] = 3e-41 if dtype == torch.float32 else 1e-40
    fmax = torch.finfo(dtype).max
    x[256:384, :128] = fmax
    x[256:300, 128:256] = -fmax
    x[5, 300] = math.inf
    x[6, 301] = -math.inf
    x[7, 302] = math.nan
    x[8, 303] = f32_from_bits([0xFFC00000])[0]
    x[384:512, :128] = math.nan
    x[0:32, 512:544] = -0.0
    x[40, 512:640] = 0.5
    x[40, 515] = 1.0000001  # saturation on a rounded-up non-pow2 scale somewhere nearby
    x[41, 512:640] = torch.linspace(-1e-30, 1e-30, 128)
    x[480:512, 600:640] = 65504.0 if dtype == torch.float16 else 1e5
    return x.to(dtype)


def build_cases():
    """(name, x_cpu, recipe, kwargs, variant) in an order that compiles each kernel variant once."""
    g = torch.Generator().manual_seed(0)
    rnd = lambda m, k, scale=10.0: torch.randn(m, k, generator=g) * scale  # noqa: E731
    cases = []
    BW = (("blockwise", "1x128"), ("blockwise", "128x128"))
    dts = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    aligned = {"edge512x640": edge_input, "rand256x384": lambda dt: rnd(256, 384).to(dt)}

    def add(tag, x, recipe, block, fmt, pow2=True, eps=0.0, row=True, col=True):
        usage = "both" if row and col else "row" if row else "col"
        name = f"{tag}/{str(x.dtype)[6:]}/{recipe}-{block}/{fmt}/pow2={pow2}/eps={eps}/{usage}"
        kw = dict(block=block, fp8_dtype=fmt, pow2_scales=pow2, eps=eps, rowwise=row, columnwise=col)
        variant = f"{recipe}-{block}/{x.dtype}/{fmt}/{usage}"
        cases.append((name, x, recipe, kw, variant))

    # A: aligned inputs, full matrix, both usages
    for dn in ("bf16", "fp32"):
        xs = {t: f(dts[dn]) for t, f in aligned.items()}
        for recipe, block in BW:
            for fmt in ("e4m3", "e5m2"):
                for pow2 in (True, False):
                    for eps in (0.0, 1.0):
                        for t, x in xs.items():
                            add(t, x, recipe, block, fmt, pow2, eps)
        for fmt in ("e4m3", "e5m2"):
            for t, x in xs.items():
                add(t, x, "mxfp8", "1x32", fmt)
    # B: partial blocks
    for dn in ("bf16", "fp32"):
        for t, (m, k) in (("rand303x300", (303, 300)), ("rand65x96", (65, 96))):
            x = rnd(m, k).to(dts[dn])
            for recipe, block in BW:
                for fmt in ("e4m3", "e5m2"):
                    for pow2 in (True, False):
                        add(t, x, recipe, block, fmt, pow2)
                add(t, x, recipe, block, "e4m3", True, 1.0)
        x = rnd(96, 160).to(dts[dn])
        for fmt in ("e4m3", "e5m2"):
            add("rand96x160", x, "mxfp8", "1x32", fmt)
    # C: one usage only
    for dn in ("bf16", "fp32"):
        x = edge_input(dts[dn])
        for recipe, block in BW + (("mxfp8", "1x32"),):
            for fmt in ("e4m3", "e5m2"):
                for row, col in ((True, False), (False, True)):
                    add("edge512x640", x, recipe, block, fmt, True, 0.0, row, col)
        xp = rnd(303, 300).to(dts[dn])
        for recipe, block in BW:
            for row, col in ((True, False), (False, True)):
                add("rand303x300", xp, recipe, block, "e4m3", False, 0.0, row, col)
    # D: fp16 input and N-D shapes
    x = edge_input(torch.float16)
    for recipe, block in BW + (("mxfp8", "1x32"),):
        add("edge512x640", x, recipe, block, "e4m3", True)
        if recipe == "blockwise":
            add("edge512x640", x, recipe, block, "e5m2", False, 1.0)
    x3 = rnd(6, 50, 1.0).reshape(2, 3, 50).repeat(1, 1, 4).to(torch.bfloat16)  # [2, 3, 200]
    for recipe, block in BW:
        add("nd2x3x200", x3, recipe, block, "e4m3")
    x3 = rnd(128, 64, 1.0).reshape(2, 64, 64).to(torch.bfloat16)
    add("nd2x64x64", x3, "mxfp8", "1x32", "e4m3")
    return cases


def bits_of(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t


def describe_diff(part, idx, ref, got, x2, recipe, block):
    """Human-readable context of the first differing element."""
    M, K = x2.shape
    i, j = idx
    d = {"part": part, "index": [i, j], "torch": hexbits(ref[i, j]), "triton": hexbits(got[i, j])}
    if ref.dtype == torch.int32:  # fp32 scale_inv bits
        d["torch_value"] = repr(float(ref[i, j].reshape(1).view(torch.float32)[0]))
        d["triton_value"] = repr(float(got[i, j].reshape(1).view(torch.float32)[0]))
    if part.endswith("_data"):
        m, k = (i, j) if (part == "rowwise_data" or recipe == "mxfp8") else (j, i)
        v = x2[m, k]
        d["input"] = {"m": m, "k": k, "value": repr(float(v)), "bits": hexbits(v)}
        return d
    if recipe == "mxfp8":
        rows, cols = ((slice(i, i + 1), slice(32 * j, 32 * j + 32)) if part == "rowwise_scale_inv"
                      else (slice(32 * i, 32 * i + 32), slice(j, j + 1)))
    elif block == "1x128":
        rows, cols = ((slice(j, j + 1), slice(128 * i, 128 * i + 128)) if part == "rowwise_scale_inv"
                      else (slice(128 * i, 128 * i + 128), slice(j, j + 1)))
    else:
        mb, kb = (i, j) if part == "rowwise_scale_inv" else (j, i)
        rows, cols = slice(128 * mb, 128 * mb + 128), slice(128 * kb, 128 * kb + 128)
    blk = x2[rows, cols].float()
    if blk.numel() == 0:
        d["block"] = "padding (outside the tensor)"
    else:
        a = blk.abs().masked_fill(torch.isnan(blk), 0.0)
        d["block"] = {"rows": [rows.start, min(rows.stop, M)], "cols": [cols.start, min(cols.stop, K)],
                      "amax": repr(float(a.max())), "amax_bits": hexbits(a.max()),
                      "nan": int(torch.isnan(blk).sum()), "inf": int(torch.isinf(blk).sum())}
    return d


def compare_q(ref, got, x2, recipe, block):
    """None if identical, else a dict describing the first difference (x2: the 2-D input)."""
    M, K = x2.shape
    for part in PARTS:
        a, b = getattr(ref, part), getattr(got, part)
        if a is None and b is None:
            continue
        if (a is None) != (b is None):
            return {"part": part, "problem": f"present in {'torch' if b is None else 'triton'} only"}
        if a.shape != b.shape or a.dtype != b.dtype:
            return {"part": part, "problem": f"shape/dtype torch {tuple(a.shape)} {a.dtype} "
                                             f"vs triton {tuple(b.shape)} {b.dtype}"}
        if part.endswith("_data"):
            shape2 = (M, K) if (part == "rowwise_data" or recipe == "mxfp8") else (K, M)
        else:
            shape2 = tuple(a.shape)
        a2 = bits_of(a.contiguous()).reshape(shape2).cpu()
        b2 = bits_of(b.contiguous()).reshape(shape2).cpu()
        neq = a2 != b2
        n = int(neq.sum())
        if n:
            i, j = (int(v) for v in neq.nonzero()[0])
            d = describe_diff(part, (i, j), a2, b2, x2, recipe, block)
            d["count"] = n
            return d
    return None


def run_cases(cases, dev, mode, only=None):
    """Run the cases in one math mode; returns the list of records."""
    tq.set_math_mode(mode)
    qmod.USE_TRITON = False
    records, variant_errors = [], {}
    for name, x, recipe, kw, variant in cases:
        if only is not None and name not in only:
            continue
        rec = {"case": name, "mode": mode}
        if variant_errors.get(variant, 0) >= 2:
            rec["status"] = "SKIP"
            rec["why"] = "two earlier cases of this kernel variant raised"
            records.append(rec)
            out(f"  SKIP  {name} (variant {variant} raised twice)")
            continue
        xd = x.to(dev)
        try:
            ref = quantize(xd, recipe, **kw)
            t0 = time.perf_counter()
            got = tq.quantize_triton(xd, recipe, **kw)
            if xd.is_cuda:
                torch.cuda.synchronize()
            rec["seconds"] = round(time.perf_counter() - t0, 3)
            x2 = x.reshape(-1, x.shape[-1]).cpu()
            d = compare_q(ref, got, x2, recipe, kw["block"])
        except Exception as exc:
            variant_errors[variant] = variant_errors.get(variant, 0) + 1
            rec["status"] = "ERROR"
            rec["error"] = err_text(exc)
            records.append(rec)
            out(f"  ERROR {name}\n" + "\n".join("      " + ln for ln in rec["error"].splitlines()))
            continue
        if d is None:
            rec["status"] = "OK"
            out(f"  OK    {name}")
        else:
            rec["status"] = "DIFF"
            rec["diff"] = d
            out(f"  DIFF  {name}: {json.dumps(d, default=str)}")
        records.append(rec)
    return records


# ------------------------------------------------------------------------------------------------
# 3. dispatch
# ------------------------------------------------------------------------------------------------

def run_dispatch(dev):
    ok = True
    tq.set_math_mode("asm")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(4, 96, 256, generator=g) * 5).to(torch.bfloat16).to(dev)
    for recipe, block in (("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", "1x32")):
        name = f"dispatch {recipe}-{block}"
        try:
            qmod.USE_TRITON = False
            ref = quantize(x, recipe, block=block)
            ref_rq = ref.clone().requantize_(x * 0.5)
            qmod.USE_TRITON = True
            got = quantize(x, recipe, block=block)
            got_rq = got.clone().requantize_(x * 0.5)
            if block == "128x128":
                ref_rq.post_all_gather_processing()
                got_rq.post_all_gather_processing()
            x2 = x.reshape(-1, x.shape[-1]).cpu()
            d = (compare_q(ref, got, x2, recipe, block)
                 or compare_q(ref_rq, got_rq, (x * 0.5).reshape(-1, 256).cpu(), recipe, block))
            status = "OK" if d is None else "DIFF"
        except Exception as exc:
            d, status = err_text(exc), "ERROR"
        finally:
            qmod.USE_TRITON = False
        ok &= status == "OK"
        RESULTS["dispatch"].append({"case": name, "status": status, "detail": d})
        out(f"  {status:<5} {name}" + ("" if status == "OK" else f": {d}"))
    return ok


# ------------------------------------------------------------------------------------------------
# 4. bench
# ------------------------------------------------------------------------------------------------

def timeit(fn, reps=20, warmup=3):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def run_bench(dev):
    tq.set_math_mode("asm")
    qmod.USE_TRITON = False
    out(f"  {'recipe':<18} {'shape':>10} {'usage':>5} {'torch GB/s':>10} {'triton GB/s':>11} {'copy GB/s':>9} "
        f"{'triton/copy':>11} {'speedup':>7} {'triton ms':>9}")
    for (M, K) in ((4096, 4096), (8192, 8192)):
        g = torch.Generator(device=dev).manual_seed(0)
        x = torch.randn(M, K, device=dev, generator=g).to(torch.bfloat16)
        dst = torch.empty_like(x)
        t_copy = timeit(lambda: dst.copy_(x), reps=50)
        copy_bw = 2 * x.numel() * x.element_size() / t_copy / 1e9
        for recipe, block in (("blockwise", "1x128"), ("blockwise", "128x128"), ("mxfp8", "1x32")):
            for usage, col in (("both", True), ("row", False)):
                kw = dict(block=block, columnwise=col)
                rec = {"recipe": f"{recipe}-{block}", "shape": f"{M}x{K}", "usage": usage, "copy_GBps": copy_bw}
                try:
                    q = quantize(x, recipe, **kw)
                    nbytes = x.numel() * x.element_size() + q.nbytes
                    t_torch = timeit(lambda: quantize(x, recipe, **kw), reps=10, warmup=2)
                    qt = tq.quantize_triton(x, recipe, **kw)
                    same = compare_q(q, qt, x.cpu(), recipe, block) is None if M == 4096 else None
                    t_tri = timeit(lambda: tq.quantize_triton(x, recipe, **kw), reps=30)
                    rec.update(torch_GBps=nbytes / t_torch / 1e9, triton_GBps=nbytes / t_tri / 1e9,
                               triton_ms=t_tri * 1e3, torch_ms=t_torch * 1e3, bytes=nbytes, identical=same)
                    out(f"  {recipe + ' ' + block:<18} {f'{M}x{K}':>10} {usage:>5} {rec['torch_GBps']:10.1f} "
                        f"{rec['triton_GBps']:11.1f} {copy_bw:9.1f} {rec['triton_GBps'] / copy_bw:10.2f}x "
                        f"{rec['triton_GBps'] / rec['torch_GBps']:6.1f}x {t_tri * 1e3:9.3f}"
                        + ("" if same is not False else "  (NOT IDENTICAL)"))
                except Exception as exc:
                    rec["error"] = err_text(exc)
                    out(f"  {recipe + ' ' + block:<18} {f'{M}x{K}':>10} {usage:>5} ERROR\n{rec['error']}")
                RESULTS["bench"].append(rec)
                save()
        x = dst = None  # free before the next size
        torch.cuda.empty_cache()


ALT_CONFIGS = {
    "1x128_both": [dict(BR=128, BC=128, num_warps=8), dict(BR=128, BC=128, num_warps=32)],
    "1x128_row": [dict(BR=32, BC=128, num_warps=4), dict(BR=128, BC=128, num_warps=16)],
    "1x128_col": [dict(BR=128, BC=32, num_warps=4), dict(BR=128, BC=128, num_warps=16)],
    "128x128": [dict(num_warps=8), dict(num_warps=32)],
    "mxfp8": [dict(NSUB=8, num_warps=4), dict(NSUB=2, num_warps=2), dict(NSUB=4, num_warps=8)],
}
CONFIG_USE = {"1x128_both": ("blockwise", "1x128", True, True), "1x128_row": ("blockwise", "1x128", True, False),
              "1x128_col": ("blockwise", "1x128", False, True), "128x128": ("blockwise", "128x128", True, True),
              "mxfp8": ("mxfp8", "1x32", True, True)}


def run_configs(dev):
    """Alternative tiles at 8192x8192 bf16: GB/s, and bytes equal to the default config's."""
    tq.set_math_mode("asm")
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(8192, 8192, device=dev, generator=g).to(torch.bfloat16)
    for key, alts in ALT_CONFIGS.items():
        recipe, block, row, col = CONFIG_USE[key]
        kw = dict(block=block, rowwise=row, columnwise=col)
        default = dict(tq.CONFIG[key])
        try:
            base = tq.quantize_triton(x, recipe, **kw)
            nbytes = x.numel() * x.element_size() + base.nbytes
        except Exception as exc:
            out(f"  {key}: default config ERROR {exc!r}")
            continue
        for cfg in [default] + alts:
            rec = {"key": key, "config": cfg}
            tq.CONFIG[key] = dict(cfg)
            try:
                q = tq.quantize_triton(x, recipe, **kw)
                same = all(torch.equal(getattr(q, p), getattr(base, p))
                           for p in PARTS if getattr(q, p) is not None)
                t = timeit(lambda: tq.quantize_triton(x, recipe, **kw), reps=30)
                rec.update(GBps=nbytes / t / 1e9, ms=t * 1e3, identical=same)
                out(f"  {key:<11} {json.dumps(cfg):<42} {rec['GBps']:8.1f} GB/s {t * 1e3:8.3f} ms"
                    + ("" if same else "  (BYTES DIFFER FROM DEFAULT CONFIG)")
                    + ("  [default]" if cfg == default else ""))
            except Exception as exc:
                rec["error"] = err_text(exc, 20)
                first = str(exc).splitlines()[0] if str(exc) else repr(exc)
                out(f"  {key:<11} {json.dumps(cfg):<42} ERROR {first}")
            finally:
                tq.CONFIG[key] = default
            RESULTS["configs"].append(rec)
            save()


# ------------------------------------------------------------------------------------------------

def main(argv=None) -> int:
    global JSON_PATH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="write all results to this JSON file")
    ap.add_argument("--skip-bench", action="store_true", help="correctness only")
    ap.add_argument("--filter", default=None, help="only cases whose name contains this string")
    ap.add_argument("--interpret", action="store_true",
                    help="debug on a CPU with TRITON_INTERPRET=1: cases only, math mode tl")
    args = ap.parse_args(argv)
    JSON_PATH = args.json
    t_start = time.time()
    import importlib.util
    RESULTS["env"] = {
        "torch": torch.__version__,
        "triton": getattr(tq.triton, "__version__", None),
        "cuda": torch.cuda.is_available(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "capability": torch.cuda.get_device_capability() if torch.cuda.is_available() else None,
        "triton_unavailable_reason": tq.triton_unavailable_reason(),
        "PARITY_TRITON_MATH": os.environ.get("PARITY_TRITON_MATH"),
        "triton_spec": importlib.util.find_spec("triton") is not None,
    }
    out("env:", json.dumps(RESULTS["env"]))
    save()
    if args.interpret:
        if os.environ.get("TRITON_INTERPRET") != "1" or not tq.triton_available():
            out("--interpret needs TRITON_INTERPRET=1 and an importable triton")
            return 2
        cases = build_cases()
        if args.filter:
            cases = [c for c in cases if args.filter in c[0]]
        recs = run_cases(cases, torch.device("cpu"), "tl")
        RESULTS["cases"] = recs
        save()
        n_ok = sum(r["status"] == "OK" for r in recs)
        out(f"RESULT (interpreter): {n_ok}/{len(recs)} cases OK")
        return 0 if n_ok == len(recs) else 1
    if not torch.cuda.is_available() or not tq.triton_available():
        out(f"cannot run: {tq.triton_unavailable_reason() or 'CUDA is not available'}")
        return 2
    dev = torch.device("cuda")

    out("\n== 1. probes (primitives vs torch) ==")
    try:
        run_probes(dev)
    except Exception as exc:
        out(f"  probes ERROR:\n{err_text(exc)}")
        RESULTS["probes"]["error"] = err_text(exc)
    save()

    out("\n== 2. cases (math mode asm) ==")
    cases = build_cases()
    if args.filter:
        cases = [c for c in cases if args.filter in c[0]]
    recs = run_cases(cases, dev, "asm")
    RESULTS["cases"] = recs
    save()
    bad = [r["case"] for r in recs if r["status"] != "OK"]
    n_ok = sum(r["status"] == "OK" for r in recs)
    out(f"  cases: {n_ok} OK, {len(recs) - n_ok} not OK "
        f"({sum(r['status'] == 'DIFF' for r in recs)} DIFF, {sum(r['status'] == 'ERROR' for r in recs)} ERROR, "
        f"{sum(r['status'] == 'SKIP' for r in recs)} SKIP) [{time.time() - t_start:.0f} s]")
    if bad:
        out("\n== 2b. failing cases again in math mode tl (tl.math.div_rn and '*') ==")
        RESULTS["retry_tl"] = run_cases(cases, dev, "tl", only=set(bad))
        tq.set_math_mode("asm")
        save()

    out("\n== 3. dispatch (PARITY_TRITON_QUANTIZE routing, requantize_) ==")
    dispatch_ok = run_dispatch(dev)
    save()

    if not args.skip_bench:
        out("\n== 4. bench (bf16; GB/s = (input bytes + all storage bytes) / time; wall clock per call) ==")
        try:
            run_bench(dev)
        except Exception as exc:
            out(f"  bench ERROR:\n{err_text(exc)}")
        out("\n== 4b. alternative tile configs (8192x8192 bf16) ==")
        try:
            run_configs(dev)
        except Exception as exc:
            out(f"  configs ERROR:\n{err_text(exc)}")
    save()
    if bad:  # repeated here so that the tail of the output has it
        out("\n== summary of failing cases (details above and in the JSON) ==")
        retry = {r["case"]: r["status"] for r in RESULTS["retry_tl"]}
        for r in recs:
            if r["status"] == "OK":
                continue
            detail = json.dumps(r.get("diff"), default=str) if r["status"] == "DIFF" else \
                (r.get("error", r.get("why", "")).strip().splitlines() or [""])[-1]
            out(f"  {r['status']:<5} {r['case']} | tl mode: {retry.get(r['case'], '-')} | {detail[:300]}")
    all_ok = not bad and dispatch_ok
    RESULTS["all_identical"] = all_ok
    RESULTS["seconds"] = round(time.time() - t_start, 1)
    save()
    out(f"\nRESULT: {'ALL IDENTICAL' if all_ok else 'NOT IDENTICAL'}: {n_ok}/{len(recs)} cases OK, "
        f"dispatch {'OK' if dispatch_ok else 'NOT OK'} [{RESULTS['seconds']} s]")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
