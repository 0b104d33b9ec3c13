"""One digest over 84 fp32 GEMMs through numpy (its OpenBLAS), on the shapes of parity's CPU GEMMs
(parity.model.matmul) and odd ones: normal, bf16-valued and exponent-spread inputs, plain and
transposed operands. Prints the CPU, numpy's BLAS and its kernel set, and the digest; asserts
nothing. Run it on two CPUs with the pin (docs/spec/platform.md s1.2) and compare the digests:

    OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=Haswell python tools/openblas_bits.py [-v]
"""
import hashlib, os, sys
import numpy as np
from threadpoolctl import threadpool_info
from parity.distributed.pins import cpuinfo_field  # torch-free; numpy above loaded OpenBLAS already
rng = np.random.default_rng(1234)
def bf16(x):  # round-to-nearest-even to bf16 values held in fp32
    b = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)
shapes = [(128,128,128),(128,256,128),(128,128,256),(256,128,256),(128,64,128),(192,320,192),(160,192,160),(128,512,128),(64,128,128),(128,128,8),(8,128,128),(1,128,128),(130,257,129),(32,32,32)]
h = hashlib.sha256(); per = []
for m,k,n in shapes:
    for kind in ("normal","bf16","wide"):
        a = rng.standard_normal((m,k)).astype(np.float32); b = rng.standard_normal((k,n)).astype(np.float32)
        if kind == "bf16": a, b = bf16(a / 20), bf16(b / 20)
        if kind == "wide": a = a * np.exp2(rng.integers(-30, 30, size=(m,k))).astype(np.float32)
        for trans in (False, True):
            bb = np.ascontiguousarray(b.T).T if trans else b   # a transposed (Fortran-order) operand
            c = np.matmul(a, bb)
            d = hashlib.sha256(c.tobytes()).hexdigest()[:12]
            per.append(f"{m}x{k}x{n}-{kind}-{'T' if trans else 'N'} {d}")
            h.update(c.tobytes())
info = [{k: i.get(k) for k in ("internal_api","version","architecture","num_threads")} for i in threadpool_info()]
print("cpu:", cpuinfo_field("model name") or "unknown (no model name in /proc/cpuinfo)")
print("numpy", np.__version__, "OPENBLAS_CORETYPE", os.environ.get("OPENBLAS_CORETYPE"), info)
print("ALL", h.hexdigest())
if "-v" in sys.argv: print("\n".join(per))
