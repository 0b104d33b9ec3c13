import time, statistics, sys
from parity.harness import golden
from parity.harness.scenario import load_all, make_scenario
from parity.harness.platform import platform_fingerprint
S={s.name:s for s in load_all()}
plat=platform_fingerprint("cpu","gloo")
d=S["default"]; ep8=make_scenario({**d.to_dict(),"name":"default[recipe=blockwise+ep=8+moe=True+world=8]","ep":8,"world":8})
pre=S["blockwise-moe-w8-ep8-overlap-off"].prefix(8)
for sc in (pre, ep8):
    ts=[]
    for _ in range(7):
        t=time.perf_counter(); golden.find("goldens", sc, plat); ts.append(time.perf_counter()-t)
    print(sc.name, "median %.4f s" % statistics.median(ts))
