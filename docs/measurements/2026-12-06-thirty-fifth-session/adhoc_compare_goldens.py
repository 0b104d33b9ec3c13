"""Ad hoc: two platforms' goldens of the same scenarios, digest for digest (every rank, key, step,
and the loss). Run from the repository root; prints h200-vs-h100-moe-goldens.txt."""
from parity.harness import golden

print("# the three world-1 MoE CUDA goldens: H200 (recorded 2026-12-06 22:38 UTC) vs H100 (shipped), record for record")
for s in ["cuda-blockwise-moe-w1-overlap-off", "cuda-mxfp8-moe-w1-overlap-off", "cuda-mxfp8-moe-w1-mb4-stress"]:
    a = golden.load(f"goldens/{s}/cuda-nvidia-h200-torch2.11.0-cu13.0")
    b = golden.load(f"goldens/{s}/cuda-nvidia-h100-80gb-hbm3-torch2.11.0-cu13.0")
    n = same = 0
    for r in a.ranks:
        ra, rb = a.ranks[r], b.ranks[r]
        assert ra.keys == rb.keys
        for k in ra.digests:
            for x, y in zip(ra.digests[k], rb.digests[k]):
                n += 1
                same += x == y
        for x, y in zip(ra.loss, rb.loss):
            n += 1
            same += x == y
    print(f"{s}: steps {a.steps}/{b.steps}, fingerprint equal {a.fingerprint == b.fingerprint}, {same} of {n} digests identical")
