import os, sys, time, resource, torch, torch.distributed as dist, torch.multiprocessing as mp
W = int(os.environ.get("W", 8)); N = 60
def rank(r, sizes, q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29618")
    os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0)); torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=r, world_size=W)
    from parity.distributed import collectives as C
    def rsag(t):
        n = t.numel()
        parts = C.ring_chunk_sizes(n, W, t.element_size())
        starts = [sum(parts[:i]) for i in range(W)]
        mine = parts[r]
        recv = torch.empty(W * mine, dtype=t.dtype)
        dist.all_to_all_single(recv, t, output_split_sizes=[mine] * W, input_split_sizes=parts)
        part = torch.empty(mine, dtype=t.dtype)
        C._ring_sum_into(part, recv.view(W, mine), starts[r], n)
        C._gather_by_exchange(t, part, parts, r, None).wait()
    res = {}
    for n in sizes:
        x = torch.randn(n) * 1e3
        a, b = x.clone(), x.clone()
        dist.all_reduce(a); rsag(b)
        same = torch.equal(a.view(torch.int32), b.view(torch.int32))
        for kind in ("ring", "exchange", "rsag"):
            t = x.clone()
            dist.barrier()
            ru0 = resource.getrusage(resource.RUSAGE_SELF); t0 = time.perf_counter()
            for _ in range(N):
                if kind == "ring": dist.all_reduce(t)
                elif kind == "exchange": C._exchange_and_sum(t.view(-1), t.view(-1).expand(W, -1), 0, n, None, False)
                else: rsag(t)
            t1 = time.perf_counter(); ru1 = resource.getrusage(resource.RUSAGE_SELF)
            res[(n, kind)] = ((t1-t0)/N*1e3, (ru1.ru_utime-ru0.ru_utime + ru1.ru_stime-ru0.ru_stime)/N*1e3, same)
    q.put(res)
    dist.barrier(); dist.destroy_process_group()
if __name__ == "__main__":
    sizes = [int(a) for a in sys.argv[1:]]
    ctx = mp.get_context("fork"); q = ctx.Queue()
    ps = [ctx.Process(target=rank, args=(r, sizes, q)) for r in range(W)]
    [p.start() for p in ps]
    out = [q.get() for _ in range(W)]
    [p.join() for p in ps]
    for key in out[0]:
        wall = sum(o[key][0] for o in out)/W; cpu = sum(o[key][1] for o in out)
        print(f"W{W} {key[0]:7d} {key[1]:9s} wall {wall:6.2f} ms  CPU all ranks {cpu:6.2f} ms  same bits {all(o[key][2] for o in out)}")
