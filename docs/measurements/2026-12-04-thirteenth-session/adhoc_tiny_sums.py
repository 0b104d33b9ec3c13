"""Ad hoc (thirteenth session): the exchange's ring-order sum vs gloo's all_reduce for fewer than
2 x world fp32 elements. Run from the repository root:
    PYTHONPATH=docs/measurements/2026-12-04-thirteenth-session:. python -c "import adhoc_tiny_sums as m; m.main()"
"""
import torch, torch.distributed as dist, sys
sys.path.insert(0, "tests/integration")  # run from the repository root
from parity.distributed import collectives as C
from parity.harness.launch import LaunchConfig, launch
from test_gloo_sums import _inputs, _bits

def rank_fn(ctx):
    r, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for salt in range(20):
        for n in range(1, 2 * world):
            x = _inputs(r, n, torch.float32, 1000 * salt + n)
            native = x.clone(); dist.all_reduce(native)
            mine = torch.empty_like(x)
            C._exchange_and_sum(mine, x.view(-1).expand(world, -1), 0, n, None, False)
            out[(salt, n)] = (_bits(mine), _bits(native))
    return out

def main():
  for w in (2, 3, 4, 8):
    res = launch(rank_fn, LaunchConfig(world_size=w, start_method="spawn", deadline_s=240))
    bad = [(r, k) for r, d in enumerate(res) for k, (m, n) in d.items() if m != n]
    print("world", w, "cases", sum(len(d) for d in res), "mismatches", len(bad), bad[:5])
