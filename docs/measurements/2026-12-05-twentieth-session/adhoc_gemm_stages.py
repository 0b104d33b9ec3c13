"""Where the emulated FP8 GEMM's time goes, on the GEMMs a real step makes: capture every
fp8_gemm call of the second step of a world-1 MoE stack (both sides) in this process, then time
them all again, whole and by stage (median of 7 sweeps, one thread, the ranks' allocator setting).

    python adhoc_gemm_stages.py blockwise|mxfp8
Prints numbers; asserts nothing but that the replayed GEMMs give the captured bits."""

import os
import socket
import sys
import time
from collections import Counter

import threadpoolctl
import torch
import torch.distributed as dist

import parity.fp8.gemm as G
import parity.model.fp8_linear as FL
from parity.harness.launch import _retain_freed_memory
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario

recipe = sys.argv[1] if len(sys.argv) > 1 else "blockwise"
torch.set_num_threads(1)
threadpoolctl.threadpool_limits(1, user_api="blas")
_retain_freed_memory()
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
dist.init_process_group("gloo", rank=0, world_size=1)

calls = []


def _copy(op: G.Operand) -> G.Operand:
    """The operand as it is now: the stack later overwrites a persisted weight's bytes in place."""
    tile = None if op.tile_2d is None else op.tile_2d.clone()
    return G.Operand(data=op.data.clone(), fp8_dtype=op.fp8_dtype, scale_inv=op.scale_inv.clone(),
                     block_len=op.block_len, tile_2d=tile)


def recording(a, b, **kw):
    out = G.fp8_gemm(a, b, **kw)
    calls.append((_copy(a), _copy(b), kw, out.clone()))
    return out


FL.fp8_gemm = recording


class Ctx:
    device = "cpu"


rank_main(Ctx(), make_scenario({"name": "t", "world": 1, "steps": 2, "recipe": recipe, "moe": True}),
          RunOptions(progress=False, golden_digests=False, snapshot="none"))
calls = calls[len(calls) // 2:]  # the second step
shapes = Counter((tuple(a.data.shape), tuple(b.data.shape)) for a, b, _, _ in calls)
print(f"{recipe}: {len(calls)} GEMMs a step (both sides); most common [M,K] x [N,K]: {shapes.most_common(4)}")
for a, b, kw, want in calls:
    got = G.fp8_gemm(a, b, **kw)
    assert torch.equal(got.view(torch.int16 if got.dtype == torch.bfloat16 else torch.int32),
                       want.view(torch.int16 if want.dtype == torch.bfloat16 else torch.int32))


def ms(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


partials = [G._block_dots(a, b, 0, a.scale_inv.shape[1]) for a, b, _, _ in calls]
f64 = [(G._as_float64(a.data, a.fp8_dtype), G._as_float64(b.data, b.fp8_dtype), a.block_len, a.scale_inv.shape[1])
       for a, b, _, _ in calls]


def dgemms():
    for va, vb, blk, nb in f64:
        if va.shape[1] == nb * blk:
            G._exact_bmm(va.view(va.shape[0], nb, blk).permute(1, 0, 2), vb.view(vb.shape[0], nb, blk).permute(1, 2, 0))


full = ms(lambda: [G.fp8_gemm(a, b, **kw) for a, b, kw, _ in calls])
dots = ms(lambda: [G._block_dots(a, b, 0, a.scale_inv.shape[1]) for a, b, _, _ in calls])
conv = ms(lambda: [(G._as_float64(a.data, a.fp8_dtype), G._as_float64(b.data, b.fp8_dtype)) for a, b, _, _ in calls])
dg = ms(dgemms)
acc = ms(lambda: [G.accumulate_blocks(p, a, b, None) for p, (a, b, _, _) in zip(partials, calls)])
rng = ms(lambda: [G._fp32_steps_exact(a, b, a.scale_inv.t().unsqueeze(2), b.scale_inv.t().unsqueeze(1))
                  for a, b, _, _ in calls])
print(f"  all GEMMs of the step: {full:.1f} ms; block dots {dots:.1f} ms (fp8 -> float64 lookups {conv:.1f}, "
      f"float64 GEMMs {dg:.1f}); epilogue {acc:.1f} ms (of which the scale-range checks {rng:.1f})")
