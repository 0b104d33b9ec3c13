import os, sys, time, resource, torch, torch.distributed as dist, torch.multiprocessing as mp
W = int(os.environ.get("W", 4)); N = 40
SIZES = [int(a) for a in sys.argv[1:]]
def rank(r, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29619")
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=W)
    from parity.distributed import collectives as C
    res = {}
    for kind in ("per_bucket", "coalesced", "per_bucket", "coalesced"):
        ts = [torch.randn(n) for n in SIZES]
        dist.barrier()
        ru0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
        for _ in range(N):
            if kind == "per_bucket":
                for t in ts: C.all_reduce_sum(t, None)
            else:
                C.sums_coalesced(ts, [], None)
        t1 = time.perf_counter(); ru1 = resource.getrusage(resource.RUSAGE_SELF)
        res.setdefault(kind, []).append(((t1-t0)/N*1e3, (ru1.ru_utime-ru0.ru_utime + ru1.ru_stime-ru0.ru_stime)/N*1e3))
    q.put(res); dist.barrier(); dist.destroy_process_group()
if __name__ == "__main__":
    ctx = mp.get_context("fork"); q = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, q)) for r in range(W)]
    [p.start() for p in ps]; out = [q.get() for _ in range(W)]; [p.join() for p in ps]
    for kind in out[0]:
        for i in range(2):
            wall = sum(o[kind][i][0] for o in out)/W; cpu = sum(o[kind][i][1] for o in out)
            print(f"W{W} {kind:10s} wall {wall:6.2f} ms  CPU all ranks {cpu:6.2f} ms   buckets {SIZES}")
