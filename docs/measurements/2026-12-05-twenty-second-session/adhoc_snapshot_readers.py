"""The ad hoc comparison behind cpu-snapshot-readers.txt: one snapshot file read by e563ac1's
triage loader (whole file into bytes, then safetensors.torch.load), by read_snapshot(copy=False)
and by read_snapshot(); 5 repeats each, warm page cache.

    git show e563ac1:parity/harness/triage.py > /tmp/old_triage.py
    python adhoc_snapshot_readers.py FILE.safetensors [FILE...]
"""
import importlib.util
import sys
import time
from pathlib import Path

from parity.harness.snapshot import read_snapshot

spec = importlib.util.spec_from_file_location("old_triage", "/tmp/old_triage.py")
old = importlib.util.module_from_spec(spec)
spec.loader.exec_module(old)
for f in sys.argv[1:]:
    for name, fn in [("old bytes loader", lambda: old._load_snapshot(Path(f))),
                     ("read_snapshot views", lambda: read_snapshot(f, copy=False)[0]),
                     ("read_snapshot copies", lambda: read_snapshot(f)[0])]:
        ts = []
        for _ in range(5):
            t = time.perf_counter()
            d = fn()
            ts.append(time.perf_counter() - t)
            del d
        print(f"{Path(f).stat().st_size >> 20:5d} MB {len(fn()):4d} tensors  {name:22s} "
              f"min {min(ts) * 1000:8.1f} ms  median {sorted(ts)[2] * 1000:8.1f} ms")
