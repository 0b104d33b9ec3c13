"""A 12-step single-rank mxfp8 MoE stack in this process (as tests/integration/test_stack_single_rank.py
runs it): wall, process CPU, and each thread's CPU. Run as is, then with the threadpoolctl line
removed, to see numpy's second OpenBLAS thread."""
import os, sys, time
sys.path.insert(0, "tests")
import torch, torch.distributed as dist, socket
s=socket.socket(); s.bind(("127.0.0.1",0)); port=s.getsockname()[1]; s.close()
os.environ["MASTER_ADDR"]="127.0.0.1"; os.environ["MASTER_PORT"]=str(port)
dist.init_process_group("gloo", rank=0, world_size=1)
torch.set_num_threads(1)
import threadpoolctl; threadpoolctl.threadpool_limits(1, user_api="blas")
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario
class Ctx: device="cpu"
t0=time.time(); c0=time.process_time()
s = make_scenario({"name": "t", "world": 1, "steps": 12, "recipe": "mxfp8", "moe": True})
rank_main(Ctx(), s, RunOptions(progress=False, golden_digests=False, snapshot="none"))
print("wall", time.time()-t0, "cpu", time.process_time()-c0, "torch threads", torch.get_num_threads())
tck = os.sysconf("SC_CLK_TCK")
for tid in os.listdir("/proc/self/task"):
    st = open(f"/proc/self/task/{tid}/stat").read().split(")")[1].split()
    comm = open(f"/proc/self/task/{tid}/comm").read().strip()
    print(tid, comm, (int(st[11])+int(st[12]))/tck)
import threadpoolctl; print([ (p['internal_api'], p['num_threads']) for p in threadpoolctl.threadpool_info()])
