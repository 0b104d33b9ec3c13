import os, sys, time
import numpy as np, torch
torch.set_num_threads(1)
calls=500
for m,k,n in ((128,128,128),(128,256,128),(256,128,256),(128,64,128)):
    x,y=torch.randn(m,k),torch.randn(k,n)
    xn,yn=x.numpy(),y.numpy()
    for f,lab in ((lambda: x@y,"torch"),(lambda: xn@yn,"numpy")):
        for _ in range(30): f()
        t=time.perf_counter()
        for _ in range(calls): f()
        dt=(time.perf_counter()-t)/calls
        print(f"{lab} {m}x{k}x{n}: {dt*1e6:7.1f} us")
