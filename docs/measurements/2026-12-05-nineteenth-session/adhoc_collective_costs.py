import os, sys, time, resource, torch, torch.distributed as dist, torch.multiprocessing as mp
W = 8; N = 200
def rank(r, kinds, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29612")
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
    dist.init_process_group("gloo", rank=r, world_size=W)
    x1 = torch.zeros(1); xb = torch.zeros(4096); a2a = torch.zeros(W * 16); out = torch.empty_like(a2a)
    res = {}
    for k in kinds:
        dist.barrier()
        ru0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        for _ in range(N):
            if k == "ar1": dist.all_reduce(x1)
            elif k == "a2a": dist.all_to_all_single(out, a2a)
            elif k == "bcast8": 
                for s in range(W): dist.broadcast(x1, src=s)
            elif k == "ag": dist.all_gather_into_tensor(torch.empty(W * 16), torch.zeros(16))
            elif k == "ago": dist.all_gather_object([None]*W, {"a": "x"*64, "b": "y"*64})
            elif k == "ar4k": dist.all_reduce(xb)
            elif k == "ag_a2a": dist.all_to_all_single(torch.empty(W * 16), torch.zeros(16).repeat(W))
            elif k == "a2a1": dist.all_to_all_single(torch.empty(W), torch.zeros(W))
        t1 = time.perf_counter(); ru1 = resource.getrusage(resource.RUSAGE_SELF)
        res[k] = ((t1-t0)/N*1e6, (ru1.ru_utime-ru0.ru_utime)/N*1e6, (ru1.ru_stime-ru0.ru_stime)/N*1e6, (ru1.ru_nvcsw-ru0.ru_nvcsw)/N)
    q.put((r, res))
    dist.barrier(); dist.destroy_process_group()
if __name__ == "__main__":
    kinds = sys.argv[1:]
    ctx = mp.get_context("fork"); q = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, kinds, q)) for r in range(W)]
    [p.start() for p in ps]
    out = [q.get() for _ in range(W)]
    [p.join() for p in ps]
    for k in kinds:
        v = [o[1][k] for o in out]
        m = [sum(x[i] for x in v)/W for i in range(4)]
        print(f"{k:7s} wall {m[0]:7.0f} us  user {m[1]:6.0f} us  sys {m[2]:6.0f} us  nvcsw {m[3]:5.1f}  per rank per call (CPU total all ranks {8*(m[1]+m[2]):.0f} us)")
