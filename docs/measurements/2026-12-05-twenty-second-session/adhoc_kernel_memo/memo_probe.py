import hashlib, os, collections
import torch
import parity.fp8.gemm as G
import parity.fp8.quantize as Q
seen = collections.Counter(); qseen = collections.Counter()
def h(*ts):
    m = hashlib.sha256()
    for t in ts:
        if isinstance(t, torch.Tensor):
            t = t.detach().contiguous().reshape(-1)
            m.update(str((t.dtype, tuple(t.shape))).encode()); m.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            m.update(repr(t).encode())
    return m.hexdigest()
def dump(seen=seen, qseen=qseen, os=os):
    with open(f"/tmp/memo_probe.{os.getpid()}", "w") as f:
        f.write(f"gemm calls {sum(seen.values())} distinct {len(seen)}; quant calls {sum(qseen.values())} distinct {len(qseen)}\n")
def em(a, b, out_dtype, orig=G._emulated, seen=seen, h=h, dump=dump):
    seen[h(a.data, a.scale_inv, b.data, b.scale_inv, a.block_len, a.fp8_dtype, b.fp8_dtype, a.tile_2d is None, b.tile_2d is None, out_dtype)] += 1
    if sum(seen.values()) % 50 == 0: dump()
    return orig(a, b, out_dtype)
G._emulated = em
def qp(x2, *args, oq=Q._quantize_parts, qseen=qseen, h=h, **kw):
    qseen[h(x2, *args, *sorted(kw.items()))] += 1
    return oq(x2, *args, **kw)
Q._quantize_parts = qp
