import time, torch, sys
torch.set_num_threads(1)
from parity.harness.launch import _retain_freed_memory
_retain_freed_memory()
from parity.fp8 import gemm as G
def bench(f,n=600):
    for _ in range(20): f()
    ts=[]
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(n//5): f()
        ts.append((time.perf_counter()-t)/(n//5)*1e6)
    return round(min(ts),1)
def mk(R,K,bl,tiny=False):
    g=torch.Generator().manual_seed(R)
    data=torch.randint(0,120,(R,K),dtype=torch.uint8,generator=g)
    s=torch.full((R,K//bl),2.0**-8)
    if tiny: s[0,0]=2.0**-127; data[0,:bl]=0
    return G.Operand(data,"e4m3",s,bl)
for M,N in [(128,128),(128,256),(256,128)]:
    a=mk(M,128,32); b=mk(N,128,32); at=mk(M,128,32,True)
    p=G._block_dots(a,b,0,4); pt=G._block_dots(at,b,0,4)
    print(M,N,"emulated normal", bench(lambda: G._emulated(a,b,torch.bfloat16)), "2^-127", bench(lambda: G._emulated(at,b,torch.bfloat16)),
      "| epilogue normal", bench(lambda: G.accumulate_blocks(p,a,b,None)), "2^-127", bench(lambda: G.accumulate_blocks(pt,at,b,None)))
