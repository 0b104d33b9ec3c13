"""ON == OFF at world 1, in this process: every phase compared, bit for bit, and each comparison
shown to fail when one bit of one tensor moves."""

import time

import pytest
import torch

from parity.harness.faults import Injection
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario
from parity.model import GPT, ModelConfig, fp8_linear, is_quantized_param
from parity.vocab import STEP_PHASES, Fault


class Ctx:
    device = "cpu"


def run(single_rank, steps=6, injections=(), digests=False, **kw):
    s = make_scenario({"name": "t", "world": 1, "steps": steps, **kw})
    return rank_main(Ctx(), s, RunOptions(injections=tuple(injections), progress=False,
                                          golden_digests=digests, snapshot="none"))


def failures(res):
    return res["divergences"], [c for c in res["checks"] if not c["ok"]]


# Blockwise's plain init flips its first weight scale only at step 11-13 (docs/measurements.md,
# "Numeric edges"); with the stress init and lr 0.01 the dense blockwise case flips 6 block scales at
# step 0 and keeps all-zero and clamped blocks throughout (tools/scale_flips.py; ninth session), so
# 4 steps cross what 30 plain steps did. mxfp8's 1x32 blocks flip from step 0 on, every step.
STRESS = {"stress": ["zero_blocks", "pow2_edge", "tiny_values"], "lr": 0.01}


@pytest.mark.parametrize("recipe,moe,steps,edges", [
    pytest.param("blockwise", False, 4, STRESS, id="blockwise-dense-stress-4"),
    pytest.param("mxfp8", True, 12, {}, id="mxfp8-moe-12"),
    pytest.param("blockwise", True, 8, {}, id="blockwise-moe-8"),
    pytest.param("mxfp8", False, 8, {}, id="mxfp8-dense-8"),
])
def test_on_equals_off(single_rank, recipe, moe, steps, edges):
    res = run(single_rank, steps=steps, recipe=recipe, moe=moe, digests=True, **edges)
    divs, bad = failures(res)
    assert not divs and not bad, (res["messages"], bad)
    # Every phase was compared, and the compared sets are not empty.
    for ph in ("init",) + STEP_PHASES:
        assert res["compared_by_phase"].get(ph, 0) > 0, ph
    # ON's FP8 bytes and scales were compared against OFF's on-the-fly quantization at every step,
    # for every FP8 weight (the tested side's param_sync tensors, as its record lists them; a key
    # the other side lacked would have failed the run above).
    model = GPT(make_scenario({"name": "t", "moe": moe}).model_config(), recipe=recipe, fp8_param=True, seed=0)
    fp8_weights = {n for n, p in model.named_parameters() if is_quantized_param(p)}
    assert fp8_weights
    for step in range(steps):
        keys = res["golden"]["digests"][step]
        for name in fp8_weights:
            assert {f"param_sync/{name}.fp8.rowwise_data", f"param_sync/{name}.fp8.rowwise_scale_inv"} <= keys.keys(), \
                (step, name)
    assert len(res["steps"]) == steps
    # The report's persistent bytes of the Muon matrices: ON keeps each FP8 weight as its FP8 parts;
    # OFF keeps it in bf16 (2 bytes an element) and quantizes an FP8 copy of it each forward. Where
    # both quantize alike, ON's bytes plus the bf16 ones it no longer keeps are OFF's total.
    on, off = res["persistent_bytes"]["test"], res["persistent_bytes"]["ref"]
    bf16_bytes = 2 * sum(p.numel() for p in model.parameters() if is_quantized_param(p))
    assert on["off_fp8_weight_copy_bytes"] == 0 and off["off_fp8_weight_copy_bytes"] > 0
    assert on["muon_param_bytes"] + bf16_bytes == off["muon_total_bytes"], (on, off, bf16_bytes)


@pytest.mark.parametrize("fault", [Fault.STALE_SCALE_INV, Fault.FTZ_SUBNORMAL_SCALE_INV])
def test_the_stress_case_catches_scale_faults_at_step_0(single_rank, fault):
    """The 4-step stress case above is a proof only if it reaches the edges: both faults that hide
    until a scale flips or a block is tiny show at step 0 (with the plain init, 30 steps caught the
    first at step 8 and never the second: docs/measurements/2026-12-04-ninth-session)."""
    res = run(single_rank, steps=2, recipe="blockwise", moe=False, injections=[Injection("fault", name=fault)],
              **STRESS)
    divs, _ = failures(res)
    first = min(divs, key=lambda d: (d["step"], STEP_PHASES.index(d["phase"])), default=None)
    assert first is not None and (first["step"], first["phase"]) == (0, "param_sync")


def test_partial_blocks(single_rank):
    res = run(single_rank, steps=4, recipe="blockwise", moe=True,
              model={"hidden": 192, "ffn_hidden": 320, "num_heads": 3, "moe_ffn_hidden": 160})
    divs, bad = failures(res)
    assert not divs and not bad


@pytest.mark.parametrize("phase", STEP_PHASES)
def test_one_ulp_in_any_phase_is_caught_there(single_rank, phase):
    res = run(single_rank, steps=3, injections=[Injection("ulp", step=1, phase=phase, param="*")])
    divs, _ = failures(res)
    assert divs, f"a 1-ULP change in {phase} went unnoticed"
    first = min(divs, key=lambda d: (d["step"], STEP_PHASES.index(d["phase"])))
    assert (first["step"], first["phase"]) == (1, phase)
    assert first["max_ulp"] in (1, None) or phase == "param_sync"


def test_masters_equal_at_construction_and_dequant_seeding_fails(single_rank):
    ok = run(single_rank, steps=1)
    assert ok["compared_by_phase"]["init"] > 0
    assert not [d for d in ok["divergences"] if d["phase"] == "init"]
    bad = run(single_rank, steps=1, injections=[Injection("fault", name="master-from-fp8-dequant")])
    init = [d for d in bad["divergences"] if d["phase"] == "init"]
    assert init, "a master seeded from the FP8 dequantization must differ before any update"


@pytest.mark.parametrize("overlap", [False, True])
def test_a_classifier_that_calls_every_param_quantized_is_caught(single_rank, overlap):
    """docs/spec/megatron.md s5 item 3: probing `dequantize` classifies every param as quantized, so
    ON reports only FP8 bytes at param_sync and every bf16/fp32 param leaves the comparison. Bits
    still agree; dropped-set-replaced sees it, the dropped set holds more than the FP8 linears'
    weights, and the coverage of ON's params sees it too."""
    res = run(single_rank, steps=2, overlap=overlap,
              injections=[Injection("fault", name=Fault.QUANTIZED_CLASSIFIER_ALWAYS_TRUE)])
    divs, bad = failures(res)
    assert not divs
    assert {(c["check"], c["step"]) for c in bad} == {(check, step) for step in (0, 1) for check in
                                                      ("dropped-set-replaced", "dropped-set", "param-sync-covers")}
    assert all("ON holds" in c["message"] for c in bad if c["check"] == "param-sync-covers")


def test_fp8_params_are_quantized_and_persist_fewer_bytes():
    cfg = ModelConfig()
    on = GPT(cfg, recipe="blockwise", fp8_param=True, seed=1)
    off = GPT(cfg, recipe="blockwise", fp8_param=False, seed=1)
    q_on = [n for n, p in on.named_parameters() if is_quantized_param(p)]
    q_off = [n for n, p in off.named_parameters() if is_quantized_param(p)]
    assert q_on and not q_off
    assert not is_quantized_param(torch.zeros(2, 2))  # every tensor has .dequantize: not a test
    # Same init: the preserved high-precision value equals OFF's bf16 param bit for bit.
    p_on = dict(on.named_parameters())[q_on[0]]
    p_off = dict(off.named_parameters())[q_on[0]]
    assert torch.equal(p_on.get_high_precision_init_val().view(torch.int16), p_off.detach().view(torch.int16))


def test_param_sync_dropped_set_checks_can_fail():
    """The set of OFF-only param keys must be exactly the expected one (the FP8 linears' weights
    where only ON persists FP8, else none), and each key must be replaced by ON's FP8 bytes of that
    param. (Runs that fail these checks: the selftest cases of fp8-params-not-built,
    expert-fp8-params-not-built and quantized-classifier-always-true.)"""
    from parity.harness.runner import _check_dropped_set

    t = torch.zeros(1)
    on = {"w.fp8.rowwise_data": t, "v.fp8.rowwise_data": t, "norm": t}
    off = {"w": t, "w.fp8.rowwise_data": t, "v": t, "v.fp8.rowwise_data": t, "norm": t}
    results = []
    check = lambda step, name, ok, msg, examined=None: results.append((name, ok))
    _check_dropped_set(on, off, 0, check, ["v", "w"])
    assert results == [("dropped-set-replaced", True), ("dropped-set", True)]
    _check_dropped_set(on, off, 0, check, [])  # nothing expected, two dropped
    assert results[-1] == ("dropped-set", False)
    # ON holds v in bf16 (as OFF does): the set is not empty, but v is missing from it
    _check_dropped_set({**on, "v": t}, off, 1, check, ["v", "w"])
    assert results[-2:] == [("dropped-set-replaced", True), ("dropped-set", False)]
    # OFF reports a key ON lacks and no FP8 bytes stand in for: lost, and not expected
    _check_dropped_set(on, {**off, "extra": t}, 2, check, ["v", "w"])
    assert results[-2:] == [("dropped-set-replaced", False), ("dropped-set", False)]
    # ON lost "norm" (no FP8 bytes stand in for it)
    _check_dropped_set({"w.fp8.rowwise_data": t, "v.fp8.rowwise_data": t}, off, 3, check, ["norm", "v", "w"])
    assert results[-2:] == [("dropped-set-replaced", False), ("dropped-set", True)]


def test_params_named_apart_leave_nothing_to_compare_and_that_is_caught(single_rank):
    """docs/spec/megatron.md s5 item 27: ON names its params as a wrapper module would, so no tensor
    key of ON's meets one of OFF's. No bit differs (nothing is compared but the loss and the grad
    statistics); the key and non-empty checks are what fail, from the masters at construction on."""
    res = run(single_rank, steps=2, injections=[Injection("fault", name=Fault.WRAPPER_PREFIXED_NAMES)])
    divs, bad = failures(res)
    assert not divs
    failed = {(c["check"], c["step"]) for c in bad}
    for step, phases in ((-1, ["init"]), (0, ["grad_local", "grad_reduce", "param_sync"]), (1, ["param_sync"])):
        for phase in phases:
            assert {(f"nonempty/{phase}", step), (f"keys/{phase}", step)} <= failed, (phase, step)


def test_a_phase_reported_at_the_first_step_only_is_caught(single_rank):
    """A phase one side stops reporting leaves the comparison at every later step, while the run's
    totals still show it compared (at step 0); every step checks that each phase came whole from
    both sides."""
    res = run(single_rank, steps=3, injections=[Injection("fault", name=Fault.OPTIMIZER_REPORTED_ONCE)])
    divs, bad = failures(res)
    assert not divs and res["compared_by_phase"]["optimizer"] > 0
    assert {(c["check"], c["step"]) for c in bad} == {("reported/optimizer", 1), ("reported/optimizer", 2)}


@pytest.mark.parametrize("overlap", [False, True])
def test_time_in_a_capturing_forward_is_charged_to_the_phase_that_spent_it(single_rank, monkeypatch, overlap):
    # Params are captured inside the next forward. A sleep after every module's forward must count
    # as forward; one inside the DDP's pre-hooks (the overlapped gather) as gather (param_sync).
    from torch.nn.modules.module import register_module_forward_hook

    from parity.ddp.ddp import DDP

    nap = 0.005
    calls = {"forward": 0, "pre_hook": 0}
    make = DDP._make_pre_hook

    def slow_pre_hook(self, groups):
        hook = make(self, groups)

        def timed(module, args):
            calls["pre_hook"] += 1
            time.sleep(nap)
            return hook(module, args)
        return timed

    def slow_forward(module, args, out):
        if not list(module.children()):  # leaves only: each nap counted once
            calls["forward"] += 1
            time.sleep(nap)

    monkeypatch.setattr(DDP, "_make_pre_hook", slow_pre_hook)
    handle = register_module_forward_hook(slow_forward)
    try:
        res = run(single_rank, steps=2, overlap=overlap)
    finally:
        handle.remove()
    assert not any(failures(res))
    spent = {"forward": 0.0, "param_sync": 0.0}
    for acc in res["timing"].values():
        for side in ("test", "ref"):
            for ph in spent:
                spent[ph] += acc.get(side, {}).get(ph, 0.0)
    flush = sum(acc.get("harness", {}).get("flush", 0.0) for acc in res["timing"].values())
    # every forward's leaves napped; the flush forward's naps are the harness's (one forward per side)
    per_forward = calls["forward"] // 6  # 2 steps + the flush, 2 sides
    assert spent["forward"] >= (calls["forward"] - 2 * per_forward) * nap * 0.95
    assert flush >= 2 * per_forward * nap * 0.95
    assert spent["param_sync"] >= calls["pre_hook"] * nap * 0.95
    assert spent["param_sync"] < (calls["pre_hook"] + 2) * nap + 0.5  # no forward time in it
    assert calls["pre_hook"] > 0 if overlap else calls["pre_hook"] == 0


def test_a_compared_phase_holds_no_tensors_while_its_step_waits(single_rank):
    # A step closes only when the next forward reported its params; the phases compared before
    # that keep nothing (without snapshots), or two steps of ref clones would be held at once.
    from parity.harness.runner import LockstepRunner

    s = make_scenario({"name": "t", "world": 1, "steps": 2})
    runner = LockstepRunner(Ctx(), s, RunOptions(progress=False, golden_digests=False, snapshot="none"))
    runner.clock.start()
    runner._run_step(0)
    runner._run_step(1)
    st = runner.states[1]  # open: its param_sync comes in the next forward
    done = [ph for ph, cap in st.ref.items() if cap.complete and st.test[ph].complete]
    assert "optimizer" in done and "param_sync" not in done
    assert all(not st.ref[ph].tensors and not st.test[ph].tensors for ph in done)
    assert 0 not in runner.states  # step 0 closed in step 1's forward


def test_two_microbatches_of_one_batch_accumulate_one_microbatchs_grads(single_rank, monkeypatch):
    """Each of M microbatches backpropagates loss/M; with M = 2 copies of one batch the halving is
    exact (a power of two: the FP8 scales absorb it), so the accumulated main_grads are the bits of
    one microbatch of that batch. A shared accumulation bug that moves ON and OFF alike shows here
    without a golden: a fused wgrad that overwrites main_grad on every microbatch, not only the
    first (docs/spec/te.md s9; spec s5 item 46), keeps half of each FP8 weight's grad."""
    import parity.optim.stack as stack_module

    one_batch = stack_module.batch
    monkeypatch.setattr(stack_module, "batch", lambda *a, microbatch=0, **k: one_batch(*a, microbatch=0, **k))

    def reduced_grads(microbatches, injections=()):
        res = run(single_rank, steps=1, microbatches=microbatches, digests=True, injections=injections)
        assert not any(failures(res)), failures(res)
        return {k: v for k, v in res["golden"]["digests"][0].items() if k.startswith("grad_reduce/")}

    once = reduced_grads(1)
    assert once and reduced_grads(2) == once
    lost = reduced_grads(2, [Injection("fault", name=Fault.WGRAD_OVERWRITES_EVERY_MICROBATCH)])
    model = GPT(make_scenario({"name": "t"}).model_config(), recipe="blockwise", fp8_param=True, seed=0)
    fp8 = {f"grad_reduce/{n}" for n, p in model.named_parameters() if is_quantized_param(p)}
    assert fp8 and {k for k in once if lost[k] != once[k]} == fp8  # exactly the FP8 linears' weights


@pytest.mark.parametrize("overlap", [False, True], ids=["no-overlap", "overlap"])
def test_forward_work_is_charged_to_the_forward_not_to_the_param_sync_it_captures(single_rank, monkeypatch,
                                                                                   overlap):
    """Where the time goes: a forward that captures the last step's params reports param_sync
    from inside it, and only the time spent bringing the params in (the pre-hooks' gathers) may
    be charged to param_sync. Forward work stays forward work: OFF's on-the-fly quantization of
    each FP8 weight (ON's persist as FP8) and each FP8 linear's GEMM. Both are made slow here to
    be seen; under overlap the pre-hooks run inside the forward, so the forward so far is charged
    before each module's pre-hooks begin. (The test above bounds param_sync by the whole run's
    totals with half a second of slack, too loose to see these per-forward charges.)"""
    delay, quantize, forward = 0.02, fp8_linear.quantize_weight, fp8_linear.FP8Linear.forward

    def slow_quantize(w, recipe):
        time.sleep(delay)
        return quantize(w, recipe)

    def slow_forward(module, x):
        out = forward(module, x)
        time.sleep(delay)  # after the weight is in hand: the GEMM's part of the forward
        return out

    monkeypatch.setattr(fp8_linear, "quantize_weight", slow_quantize)
    monkeypatch.setattr(fp8_linear.FP8Linear, "forward", slow_forward)
    res = run(single_rank, steps=2, recipe="blockwise", overlap=overlap)
    assert not any(failures(res)), failures(res)
    model = GPT(make_scenario({"name": "t"}).model_config(), recipe="blockwise", fp8_param=False, seed=0)
    linears = sum(isinstance(m, fp8_linear.FP8Linear) for m in model.modules())
    assert linears > 0
    slow_s = linears * delay
    # step 1's forward captures step 0's param_sync (step 0's forward captures nothing)
    assert res["timing"][1]["ref"]["forward"] >= 2 * slow_s, res["timing"][1]
    assert res["timing"][1]["test"]["forward"] >= slow_s, res["timing"][1]
    for step in range(2):
        for side in ("ref", "test"):
            assert res["timing"][step][side].get("param_sync", 0.0) < slow_s / 2, (side, res["timing"][step])
