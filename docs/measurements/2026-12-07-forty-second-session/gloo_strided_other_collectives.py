import os, torch, torch.distributed as dist, torch.multiprocessing as mp
def rank(r):
    dist.init_process_group("gloo", rank=r, world_size=2)
    for name, fn in (("reduce_scatter_tensor out[::2]", lambda: _rs(r)), ("all_gather_into_tensor out[::2]", lambda: _ag(r)),
                     ("reduce_scatter_tensor inp[::2]", lambda: _rs_in(r))):
        try:
            got = fn()
        except Exception as e:
            got = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
        if r == 0: print(name, "->", got, flush=True)
    dist.destroy_process_group()
def _rs(r):
    big = torch.full((8,), -7.0); out = big[::2]
    dist.reduce_scatter_tensor(out, torch.arange(8, dtype=torch.float32) * (r + 1)); return (out.tolist(), "want", [0.0, 3.0, 6.0, 9.0])
def _rs_in(r):
    out = torch.empty(2); inp = (torch.arange(8, dtype=torch.float32) * (r + 1))[::2]
    dist.reduce_scatter_tensor(out, inp); return (out.tolist(), "want", [0.0, 6.0])
def _ag(r):
    big = torch.full((8,), -7.0); out = big[::2]
    dist.all_gather_into_tensor(out, torch.tensor([r + 1.0, r + 2.0])); return (out.tolist(), "want", [1.0, 2.0, 2.0, 3.0])
if __name__ == "__main__":
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29534"); mp.spawn(rank, nprocs=2)
