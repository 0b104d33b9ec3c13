"""Busy CPU-seconds (/proc/stat, the whole machine) and wall time of launches from a fork server
started by an unpinned process, as a pytest worker launches: 3 launches per step count.

    python launch_cost.py SCENARIO STEPS [STEPS ...]      # e.g. blockwise-moe-w8-ep8-overlap-off 8
    python launch_cost.py detail SCENARIO STEPS            # the report's start-up and harness timings
    PYTHONPATH=/other/tree python launch_cost.py ...       # another tree
"""
import time, sys, tempfile
import torch
torch.set_num_threads(1)
from parity.harness.forkserver import start_early
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_all
def main():
    S={s.name:s for s in load_all()}
    global busy
    def busy():
        v=list(map(int,open("/proc/stat").readline().split()[1:]))
        return (sum(v)-v[3]-v[4])/100.0
    name=sys.argv[1]
    for steps in map(int, sys.argv[2:]):
        s=S[name]
        import dataclasses
        s=s.prefix(steps) if steps<=s.steps else dataclasses.replace(s, steps=steps)
        for rep in range(3):
            b0=busy(); t0=time.time()
            with tempfile.TemporaryDirectory() as d:
                e,_=run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=True, out_dir=d))
            print(name, steps, e["status"], f"wall {time.time()-t0:.2f} busy {busy()-b0:.2f}", flush=True)

def detail(name, steps):
    import json, tempfile, dataclasses
    S={s.name:s for s in load_all()}
    s=S[name].prefix(steps)
    for rep in range(3):
        with tempfile.TemporaryDirectory() as d:
            t0=time.time()
            e,_=run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=True, out_dir=d))
            w=time.time()-t0
        t=e["timing"]
        print(f"wall {w:.2f}", {k:t[k] for k in ("start_s","start_parts","rest_s","build_s")}, t["totals"]["harness"], t.get("cpu"))

if __name__=='__main__':
    start_early(checkpoints=True)
    main() if sys.argv[1] != "detail" else detail(sys.argv[2], int(sys.argv[3]))
