import sys, time
sys.path.insert(0, "tools")
from bench_ep8 import _busy_core_seconds as busy
import torch
torch.set_num_threads(1)
from parity.harness import goldens_cli
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_all
if __name__ == '__main__':
    S = {s.name: s for s in load_all()}
    for name in sys.argv[1:]:
        for steps in (1, 2, 8, 1, 8):
            s = S[name].prefix(steps)
            b0, w0 = busy(), time.monotonic()
            found = goldens_cli.prepare([s], allow_other_platform=True)[s.name]
            b1 = busy()
            entry, results = run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=True))
            b2, w2 = busy(), time.monotonic()
            print(f"{name} steps={steps}: prepare {b1-b0:.2f} CPU-s, run {b2-b1:.2f} CPU-s, wall {w2-w0:.2f} s, {entry['status']}", flush=True)
