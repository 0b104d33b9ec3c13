"""Alternated in-process A/B of parity.fp8.gemm (A) against a variant copy of gemm.py (B), on the GEMMs
of a world-1 MoE step captured by adhoc_gemm_stages.py (run from this folder).

    python adhoc_gemm_variant_ab.py blockwise|mxfp8 VARIANT.py
"""
import sys, time, types, torch
variant = sys.argv.pop(2)
src = open(__import__('os').path.join(__import__('os').path.dirname(__file__) or '.', 'adhoc_gemm_stages.py')).read().split("def ms(f")[0]
exec(src)
mod = types.ModuleType("parity.fp8.gemm_variant"); mod.__package__ = "parity.fp8"; sys.modules[mod.__name__] = mod
exec(compile(open(variant).read(), variant, "exec"), mod.__dict__)
mod.Operand = G.Operand
def same(x, y):
    iv = torch.int16 if x.dtype == torch.bfloat16 else torch.int32
    return torch.equal(x.view(iv), y.view(iv))
for a, b, kw, want in calls:
    assert same(mod.fp8_gemm(a, b, **kw), want)
A = lambda: [G.fp8_gemm(a, b, **kw) for a, b, kw, _ in calls]
B = lambda: [mod.fp8_gemm(a, b, **kw) for a, b, kw, _ in calls]
ta, tb = [], []
for r in range(21):
    for f, ts in ((A, ta), (B, tb)) if r % 2 else ((B, tb), (A, ta)):
        t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
ta.sort(); tb.sort()
print(f"{recipe}: A {ta[10]*1e3:.2f} ms, B {tb[10]*1e3:.2f} ms (medians of 21, alternated); B/A {tb[10]/ta[10]:.3f}")
