"""The shipped H100 goldens against the H200 ones, record for record (run from the repo root):
python docs/measurements/2026-12-06-thirty-second-session/adhoc_h100_vs_h200.py"""
import pathlib

from parity.harness import golden

recs = {}
for r in golden.list_goldens(pathlib.Path("goldens")):
    if r.scenario.startswith("cuda-"):
        recs.setdefault(r.scenario, {})[r.platform_id] = r
for name, by in sorted(recs.items()):
    h100 = next(k for k in by if "h100" in k)
    h200 = next(k for k in by if "h200" in k)
    c = golden.compare(golden.load(by[h100].path), golden.load(by[h200].path))
    print(f"{name}: {h200} vs {h100}: {c.status}, {sum(c.n_compared.values())} records compared; {c.messages()[0]}")
