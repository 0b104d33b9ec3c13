import sys, os, collections
import torch
import parity.fp8.gemm as G
Q = sys.modules["parity.fp8.quantize"]
MODE = os.environ.get("MEMO", "")
def key(*xs):
    out = []
    for t in xs:
        if isinstance(t, torch.Tensor):
            t = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().reshape(-1))
            out.append((t.dtype, tuple(t.shape), t.view(torch.uint8).numpy().tobytes() if t.numel() else b""))
        else:
            out.append(t)
    return tuple(out)
def fifo(n=256):
    return collections.OrderedDict()
if "g" in MODE:
    gc = fifo()
    def em(a, b, out_dtype, orig=G._emulated, gc=gc, key=key):
        k = key(a.data, a.scale_inv, b.data, b.scale_inv, a.block_len, a.fp8_dtype, b.fp8_dtype,
                a.tile_2d, b.tile_2d, out_dtype)
        r = gc.get(k)
        if r is None:
            r = gc[k] = orig(a, b, out_dtype)
            if len(gc) > 256: gc.popitem(last=False)
        return r.clone()
    G._emulated = em
if "q" in MODE:
    qc = fifo()
    def qp(x2, *args, oq=Q._quantize_parts, qc=qc, key=key, **kw):
        args = args + tuple(sorted(kw.items()))
        k = key(x2, *args)
        r = qc.get(k)
        if r is None:
            r = qc[k] = {n: t.clone() for n, t in oq(x2, *args[:len(args)-len(kw)], **kw).items()}
            if len(qc) > 256: qc.popitem(last=False)
        return {n: t.clone() for n, t in r.items()}
    Q._quantize_parts = qp
import time, atexit
STATS = collections.Counter()
if "t" in MODE:
    _em = G._emulated
    def em2(a, b, out_dtype, _em=_em, STATS=STATS):
        t = time.thread_time(); r = _em(a, b, out_dtype); STATS["g_t"] += time.thread_time() - t; STATS["g_n"] += 1
        if STATS["g_n"] % 100 == 0:
            with open(f"/tmp/memo_stats.{os.getpid()}", "w") as f: f.write(f"{dict(STATS)} \n")
        return r
    G._emulated = em2
