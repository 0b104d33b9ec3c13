"""Ad hoc: `import torch` and reading every golden manifest under goldens/, with the garbage collector as
it was (on), or off during the import and frozen after it (offfreeze). Run from the repo root:
    for i in 1 2 3 4 5 6; do for m in on offfreeze; do python adhoc_gc_import.py $m; done; done
"""
import gc, sys, time
mode = sys.argv[1]
if mode in ("off", "offfreeze"): gc.disable()
t0=time.perf_counter()
import torch
t1=time.perf_counter()
if mode in ("off", "offfreeze"): gc.enable()
if mode in ("freeze","offfreeze"): gc.freeze()
from parity.harness import golden
t2=time.perf_counter()
for ref in golden.list_goldens('goldens'):
    try: golden.load(ref.path, verify_files=False)
    except golden.GoldenError: pass
t3=time.perf_counter()
print(f"{mode}: import torch {t1-t0:.3f} s, manifests {t3-t2:.3f} s")
