import time, torch
from parity.fp8 import quantize, fp8_gemm
torch.manual_seed(0); torch.set_num_threads(1)
E=8; Me=32; K=128; N=256
for recipe, ab, wb, pad in (("blockwise","1x128","128x128",128),("mxfp8","1x32","1x32",32)):
    xs=[torch.randn(Me,K,dtype=torch.bfloat16) for _ in range(E)]
    ws=[quantize(torch.randn(N,K,dtype=torch.bfloat16)*0.02, recipe, block=wb, rowwise=True, columnwise=True) for _ in range(E)]
    def per():
        for x,w in zip(xs,ws):
            q=quantize(x, recipe, block=ab, rowwise=True, columnwise=True)
            fp8_gemm(q.gemm_operand("rowwise"), w.gemm_operand("rowwise"), out_dtype=torch.bfloat16)
    xp=torch.cat([torch.cat([x, x.new_zeros(pad - Me % pad if Me%pad else 0, K)]) for x in xs])
    def grp():
        q=quantize(xp, recipe, block=ab, rowwise=True, columnwise=True)
        fp8_gemm(q.gemm_operand("rowwise"), ws[0].gemm_operand("rowwise"), out_dtype=torch.bfloat16)
    for fn in (per,grp,per,grp):
        fn(); n=20; t=time.perf_counter()
        for _ in range(n): fn()
        print(recipe, fn.__name__, xp.shape, f"{(time.perf_counter()-t)/n*1e3:.2f} ms")
