"""The stress inputs reach FP8's edges within 4 steps, and that matters: a fault that only shows
when a pow2 scale flips is caught exactly at the first flip, which the stress init brings to step 0.
(ON == OFF on every shipped stress scenario is test_scenarios.py::test_scenario_passes.)"""

import pytest
import torch

from parity.distributed.groups import build_groups
from parity.harness.faults import Injection
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario
from parity.model import is_quantized_param
from parity.model.edges import FlipCounter
from parity.optim.stack import Stack
from parity.vocab import Fault

STRESS = ["zero_blocks", "pow2_edge", "tiny_values", "dead_expert"]


class Ctx:
    device = "cpu"


def scenario(recipe="blockwise", stress=STRESS, steps=4, lr=1e-2):
    return make_scenario({"name": "t", "world": 1, "moe": True, "recipe": recipe, "steps": steps,
                          "lr": lr, "stress": stress, "model": {"moe_ffn_hidden": 256}})


def flip_table(s) -> list[dict]:
    """Per look (init, then after each step): the stack under test's persisted FP8 weights."""
    stack = Stack(s.stack_configs()[0], build_groups(1), torch.device("cpu"))
    fp8 = [(stack.names[p], p) for p in stack.params if is_quantized_param(p)]
    counter = FlipCounter()
    table = [counter.observe((n, p.qt) for n, p in fp8)]
    for step in range(s.steps):
        stack.step(step, lambda step, phase, tensors, complete=True: None)
        table.append(counter.observe((n, p.qt) for n, p in fp8))
    return table


def first_flip(table, *, unzeroed=False):
    """Step of the first pow2 flip (with ``unzeroed``: of any scale change, a block leaving the
    zero rule included)."""
    return next((i - 1 for i, t in enumerate(table) if t["flips"] or (unzeroed and t["unzeroed"])), None)


def first_caught(s, fault):
    res = rank_main(Ctx(), s, RunOptions(injections=(Injection("fault", name=fault),), fail_fast=True,
                                         progress=False, golden_digests=False, snapshot="none"))
    return min(((d["step"], d["path"]) for d in res["divergences"]), default=None)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_stress_reaches_every_edge_within_4_steps(single_rank, recipe):
    s = scenario(recipe)
    table = flip_table(s)
    assert first_flip(table) is not None and first_flip(table) <= 3
    assert table[1]["unzeroed"] > 0  # the zero attn.proj tile leaves the zero rule at step 0
    for t in table:  # init and every step: zero blocks and clamped blocks are there all along
        assert t["zero"] > 0 and t["clamp"] > 0, t
    # the dead expert's blocks persist (its fc1 stays all zero, its tiny fc2 block stays clamped),
    # while every other expert's weights flip some scale
    n = s.model_config().num_experts
    flipped = {name.split(".experts.")[1].split(".")[0] for t in table for name in t["flipped"] if ".experts." in name}
    assert flipped == {str(e) for e in range(n - 1)}, flipped


@pytest.mark.slow
def test_stale_scale_inv_is_caught_at_the_first_flip(single_rank):
    """At world 1 every FP8 param is written from its master, so a write that forgets the scale
    grid is visible exactly when some block's scale first changes: step 0 with the stress init,
    a later step with the plain one."""
    stress = scenario(steps=4)
    flip = first_flip(flip_table(stress), unzeroed=True)
    caught = first_caught(stress, Fault.STALE_SCALE_INV)
    assert flip == 0 and caught is not None and caught[0] == flip, (flip, caught)
    assert ".fp8." in caught[1]

    # The plain init at the same lr: its first scale change comes after step 0 (step 1, measured),
    # and the fault is caught there, not before.
    plain = scenario(stress=[], steps=3)
    flip = first_flip(flip_table(plain), unzeroed=True)
    caught = first_caught(plain, Fault.STALE_SCALE_INV)
    assert flip is not None and flip > 0, flip  # the stress init is what brings it to step 0
    assert caught is not None and caught[0] == flip, (flip, caught)


@pytest.mark.slow
def test_ftz_scale_inv_needs_a_tiny_block(single_rank):
    """The flushed subnormal scale_inv is caught at step 0 where a tiny block lives, and cannot
    be seen without one (no clamped block at any step)."""
    caught = first_caught(scenario(steps=2), Fault.FTZ_SUBNORMAL_SCALE_INV)
    assert caught is not None and caught[0] == 0, caught
    plain = scenario(stress=[], steps=2)
    assert all(t["clamp"] == 0 for t in flip_table(plain))
    assert first_caught(plain, Fault.FTZ_SUBNORMAL_SCALE_INV) is None


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_fail_fast_stops_every_rank_when_one_diverges():
    """Regression: a divergence only EP rank 1 sees (one ULP in a grad of expert 7, which rank 1
    alone holds). fail_fast used to stop that rank alone; rank 0 then waited in the next step's
    collectives until the timeout, and the run was reported as a hang."""
    from parity.harness.driver import run_scenario
    from parity.harness.faults import parse_injection
    from parity.harness.scenario import load_all

    (s,) = [x for x in load_all() if x.name == "stress-blockwise-moe-w2-ep2"]
    s = make_scenario({**s.to_dict(), "steps": 3})
    inj = parse_injection("ulp:0:grad_reduce:layers.1.mlp.experts.7.fc2.weight")
    entry, results = run_scenario(s, RunOptions(injections=(inj,), fail_fast=True, progress=False,
                                                snapshot="none", golden_digests=False), timeout_s=60)
    assert entry["status"] == "fail", (entry.get("error"), entry.get("failure"))
    assert {d["step"] for r in results for d in r["divergences"]} == {0}  # every rank stopped there
    # ...before running step 1, although step 0's params are reported only in the next forward
    assert [[st["step"] for st in r["steps"]] for r in results] == [[0], [0]]
    fd = entry["first_divergence"]
    assert (fd["step"], fd["phase"], fd["tensor"], fd["rank"]) == (0, "grad_reduce", inj.param, 1), fd


@pytest.mark.slow
@pytest.mark.ranks(2)
@pytest.mark.parametrize("fault", [Fault.STALE_SCALE_INV, Fault.FTZ_SUBNORMAL_SCALE_INV])
def test_scale_faults_are_caught_on_the_gathered_write(fault):
    """At DP 2 the FP8 params are written by the gather's copy-back, not by the master copy: the
    same write (parity.ddp.param_sync.write_fp8), so the same faults, caught at step 0."""
    from parity.harness.driver import run_scenario

    s = make_scenario({"name": "t", "world": 2, "recipe": "blockwise", "steps": 2, "lr": 1e-2,
                       "stress": ["zero_blocks", "pow2_edge", "tiny_values"]})
    entry, _ = run_scenario(s, RunOptions(injections=(Injection("fault", name=fault),), progress=False,
                                          golden_digests=False, snapshot="none"), timeout_s=60)
    fd = entry["first_divergence"]
    assert str(fault) in entry["faults_fired"], entry.get("error")
    assert fd is not None and (fd["step"], fd["phase"]) == (0, "param_sync") and ".fp8." in fd["tensor"], fd
