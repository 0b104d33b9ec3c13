"""Times every call of parity.fp8.quantize._block_amax in one world-1 run of a shipped scenario (its
world and EP set to 1), grouped by block shape: python adhoc_block_amax_calls.py SCENARIO (twenty-first session;
quick-w4-moe: 28-36 us a call, default: 28-64 us)."""
import os, sys, time, collections
import torch, torch.distributed as dist, socket
s=socket.socket(); s.bind(("127.0.0.1",0)); port=s.getsockname()[1]; s.close()
os.environ["MASTER_ADDR"]="127.0.0.1"; os.environ["MASTER_PORT"]=str(port)
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
import threadpoolctl; threadpoolctl.threadpool_limits(1, user_api="blas")
import importlib; q = importlib.import_module("parity.fp8.quantize")  # the package re-exports a function of that name
calls = []
orig = q._block_amax
def rec(xb, dims):
    t=time.perf_counter(); r = orig(xb, dims); calls.append((tuple(xb.shape), xb.dtype, dims, r[1], time.perf_counter()-t)); return r
q._block_amax = rec
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import load_all
import dataclasses
sc = {s.name: s for s in load_all()}[sys.argv[1]]
sc = dataclasses.replace(sc, world=1, ep=1)
class Ctx: device="cpu"
rank_main(Ctx(), sc, RunOptions(progress=False, golden_digests=True, snapshot="none"))
agg = collections.defaultdict(lambda: [0,0.0])
for sh, dt, dims, c, t in calls:
    a = agg[(sh, dt, dims, c)]; a[0]+=1; a[1]+=t
tot = sum(t for *_, t in calls)
print("total", len(calls), tot)
for k, (n, t) in sorted(agg.items(), key=lambda kv: -kv[1][1])[:15]:
    print(n, f"{t*1e3:.1f} ms", f"{t/n*1e6:.0f} us", k)
