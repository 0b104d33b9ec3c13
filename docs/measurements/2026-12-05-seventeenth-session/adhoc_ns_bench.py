import time, torch, statistics
torch.set_num_threads(1)
from parity.optim.muon import newton_schulz, fp32_matmul_precision
xs=[torch.randn(128,128), torch.randn(384,128), torch.randn(256,128)]
def run():
    with fp32_matmul_precision("medium"):
        for x in xs: newton_schulz(x)
for _ in range(5): run()
ts=[]
for _ in range(15):
    t=time.process_time()
    for _ in range(10): run()
    ts.append((time.process_time()-t)/10*1e3)
print("ms per 3 NS", round(statistics.median(ts),3), round(min(ts),3))
