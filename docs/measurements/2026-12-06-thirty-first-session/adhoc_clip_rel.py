"""Relative difference of the post-clip norm of the stepped grads from coefficient x norm, on clipped steps."""
import sys
import torch, torch.distributed as dist
from parity.harness import runner
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
rels = []
orig = runner.LockstepRunner._clip_check
def spy(self, step, side, stack):
    st = stack.last_grad_stats
    now = float(stack.stepped_grad_norm()); coef, norm = float(st.clip_coef), float(st.norm)
    if coef < 1:
        rels.append(abs(now - coef * norm) / (coef * norm))
    return orig(self, step, side, stack)
runner.LockstepRunner._clip_check = spy
class Ctx: device = "cpu"
for kw in (dict(moe=True), dict(), dict(recipe="mxfp8", moe=True), dict(model={"fp8_head": True})):
    s = make_scenario({"name": "t", "world": 1, "steps": 6, "clip_grad": 0.3, **kw})
    res = rank_main(Ctx(), s, RunOptions(progress=False, golden_digests=False, snapshot="none"))
    assert not [c for c in res["checks"] if not c["ok"]]
print(f"{len(rels)} clipped steps (both sides, 4 world-1 scenarios, clip_grad 0.3): relative difference max {max(rels):.3g}, median {sorted(rels)[len(rels)//2]:.3g}")
