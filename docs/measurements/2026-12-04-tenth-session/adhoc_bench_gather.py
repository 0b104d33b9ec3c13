import time, resource, torch, torch.distributed as dist, sys
from parity.distributed import collectives as C
from parity.harness.launch import LaunchConfig, launch
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF); return r.ru_utime + r.ru_stime
def timed(fn, calls):
    dist.barrier(); w, c = time.perf_counter(), cpu()
    for _ in range(calls): fn()
    return (time.perf_counter() - w) / calls * 1e3, (cpu() - c) / calls * 1e3
def a2a_gather(out, send, sizes):
    world, me = dist.get_world_size(), dist.get_rank()
    m = max(sizes)
    rows = torch.zeros(world, m, dtype=send.dtype)
    rows[:, :send.numel()] = send
    recv = torch.empty(world, m, dtype=send.dtype)
    dist.all_to_all_single(recv, rows)
    off = 0
    for r, s in enumerate(sizes):
        out[off:off+s].copy_(recv[r, :s]); off += s
def bench(ctx, scale, calls):
    world, me = dist.get_world_size(), dist.get_rank()
    base = [65536, 49152, 32768, 16384, 8192, 0, 65536, 32768, 16384]
    sizes = [max(0, b // scale) for b in base[:world]]
    send = torch.randint(0, 255, (sizes[me],), dtype=torch.uint8)
    out1 = torch.empty(sum(sizes), dtype=torch.uint8); out2 = out1.clone()
    C.all_gather_uneven_into(out1, send, sizes); a2a_gather(out2, send, sizes)
    assert torch.equal(out1, out2)
    return timed(lambda: C.all_gather_uneven_into(out1, send, sizes), calls), timed(lambda: a2a_gather(out2, send, sizes), calls)
if __name__ == "__main__":
    for world in (4, 8):
        for scale in (1, 8):
            r = launch(bench, LaunchConfig(world_size=world, start_method="forkserver", deadline_s=600), scale, 40)
            bc = sum(x[0][1] for x in r) / world; aa = sum(x[1][1] for x in r) / world
            print(f"world {world} scale 1/{scale}: broadcasts {r[0][0][0]:.2f} ms wall {bc:.2f} cpu | all_to_all {r[0][1][0]:.2f} ms wall {aa:.2f} cpu")
