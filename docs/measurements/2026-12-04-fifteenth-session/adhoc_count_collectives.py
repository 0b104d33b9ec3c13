"""Count torch.distributed calls per rank by kind and by the parity caller (ad hoc)."""
import collections, os, sys, traceback, atexit, json
import torch.distributed as dist

COUNTS = collections.Counter()
NAMES = ["all_to_all_single", "all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_object",
         "reduce_scatter_tensor", "all_gather", "barrier", "all_to_all", "send", "recv", "gather_object", "broadcast_object_list"]

def wrap(name, fn):
    def w(*a, **k):
        st = [f for f in traceback.extract_stack(limit=8)[:-1] if "/parity/" in f.filename]
        callers = " <- ".join(f"{os.path.basename(f.filename)}:{f.name}" for f in reversed(st[-3:]))
        COUNTS[(name, callers)] += 1
        return fn(*a, **k)
    return w

for n in NAMES:
    if hasattr(dist, n):
        setattr(dist, n, wrap(n, getattr(dist, n)))

def dump():
    if dist.is_initialized():
        with open(f"/tmp/colls/rank{dist.get_rank()}.json", "w") as f:
            json.dump([[k[0], k[1], v] for k, v in COUNTS.items()], f)
os.makedirs("/tmp/colls", exist_ok=True)

import parity.harness.runner as runner
orig = runner.rank_main
def rm(*a, **k):
    try:
        return orig(*a, **k)
    finally:
        dump()
runner.rank_main = rm
import parity.harness.driver as driver
driver.rank_main = rm

if __name__ == "__main__":
    from parity.cli import main
    sys.exit(main(sys.argv[1:]))
