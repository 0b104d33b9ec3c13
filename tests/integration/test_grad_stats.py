"""The grad norm and zero count are those of the whole model, each element counted once.

ON == OFF cannot see a norm that is wrong the same way on both sides (a wrong group, a wrong
count), so this test checks the value itself: 4 gloo ranks (MoE, EP 2, an FP8 output projection
in a uint8 DistOpt buffer) capture every reduced grad they hold; the parent rebuilds each distinct
param's reduced grad (LayerWise from any replica, DistOpt from the shards of all ranks) and
computes the norm in fp64 and the zeros exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from parity.harness.launch import LaunchConfig, launch

WORLD, EP = 4, 2

pytestmark = [pytest.mark.slow, pytest.mark.ranks(WORLD)]


def _rank(ctx, fp8: bool) -> dict:
    from parity.distributed.groups import build_groups
    from parity.harness.scenario import make_scenario
    from parity.optim.stack import Stack

    s = make_scenario({"name": "norm", "world": WORLD, "ep": EP, "moe": True, "steps": 2, "overlap": True,
                       "model": {"fp8_head": True}})
    cfg = s.stack_configs()[0 if fp8 else 1]
    stack = Stack(cfg, build_groups(EP), ctx.device)
    lw = {p for b in stack.layerwise.lw_buffers for p in b.params}
    out = {"steps": []}

    def on_phase(step, phase, tensors, complete=True):
        if phase != "grad_reduce":
            return
        full = {stack.names[p]: p.main_grad.clone() for p in lw}
        pieces = [(stack.names[pc.param], pc.lo - pc.buf.layout.index[pc.param][0], pc.grad.clone())
                  for pc in stack.distopt.pieces]
        shapes = {stack.names[p]: tuple(p.shape) for b in stack.distopt.buffers for p in b.params}
        out["steps"].append({"full": full, "pieces": pieces, "shapes": shapes})

    for step in range(2):
        stack.step(step, on_phase)
        out["steps"][-1].update(norm=stack.last_grad_stats.norm.clone(),
                                zeros=int(stack.last_grad_stats.num_zeros))
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["ON", "OFF"])
def per_rank(request):
    return launch(_rank, LaunchConfig(world_size=WORLD, start_method="forkserver", deadline_s=300),
                  request.param)


@pytest.mark.parametrize("step", [0, 1])
def test_norm_and_zeros_count_every_element_once(per_rank, step):
    grads: dict[str, torch.Tensor] = {}
    for r in per_rank:
        rec = r["steps"][step]
        for name, g in rec["full"].items():
            if name in grads:  # a replica (DP or expert-DP): all-reduced, so identical
                assert torch.equal(grads[name].view(torch.int32), g.view(torch.int32)), name
            grads[name] = g
    sharded: dict[str, torch.Tensor] = {}
    covered: dict[str, torch.Tensor] = {}
    for r in per_rank:
        rec = r["steps"][step]
        for name, lo, g in rec["pieces"]:
            shape = rec["shapes"][name]
            flat = sharded.setdefault(name, torch.zeros(math.prod(shape)))
            seen = covered.setdefault(name, torch.zeros(math.prod(shape), dtype=torch.int32))
            flat[lo:lo + g.numel()] = g
            seen[lo:lo + g.numel()] += 1
    # Every element of every DistOpt param lies in exactly one rank's shard.
    assert sharded and all(int(c.min()) == 1 == int(c.max()) for c in covered.values())
    assert not set(sharded) & set(grads)
    grads.update(sharded)
    # Every expert of the model appears (4 per EP rank, 8 in all, per MoE layer).
    assert len({n for n in grads if ".experts." in n}) == 2 * 8

    ref_sq = sum(float(g.double().square().sum()) for g in grads.values())
    ref_zeros = sum(g.numel() - int(torch.count_nonzero(g)) for g in grads.values())
    norms = [r["steps"][step]["norm"] for r in per_rank]
    assert all(torch.equal(n.view(torch.int32), norms[0].view(torch.int32)) for n in norms)
    assert math.isclose(float(norms[0]), math.sqrt(ref_sq), rel_tol=1e-5)
    assert all(r["steps"][step]["zeros"] == ref_zeros for r in per_rank)
    assert ref_zeros > 0  # the count is exercised (experts without tokens, FP8 flush to zero)
