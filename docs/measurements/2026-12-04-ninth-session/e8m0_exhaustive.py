"""Old (bit rule, HEAD~) vs new e8m0_from_fp32 over all 2**32 fp32 bit patterns, 2**24 at a time."""
import sys, time, torch
sys.path.insert(0, "/work/old")
import importlib.util
spec = importlib.util.spec_from_file_location("old_formats", "/work/old/parity/fp8/formats.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
sys.path[0] = "/work/main"
from parity.fp8.formats import e8m0_from_fp32 as new
torch.set_num_threads(1)
t0 = time.time(); bad = 0
CH = 1 << 24
for c in range(1 << 8):
    lo = (c << 24) - (1 << 31)
    bits = torch.arange(lo, lo + CH, dtype=torch.int64).to(torch.int32)
    v = bits.view(torch.float32)
    bad += int((old.e8m0_from_fp32(v) != new(v)).sum())
print(f"all 2**32 patterns: {bad} differ; {time.time() - t0:.0f} s")
