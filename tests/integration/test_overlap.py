"""The overlapped param gather as training runs it, and gradient accumulation, on real gloo ranks.

Every check added for them is shown to fail because of the stack (a fault injected into the
stack under test) and to pass on the same scenario without it."""

import json

import cli_fork
import pytest

from parity.harness.driver import run_scenario
from parity.harness.faults import Injection, parse_injection
from parity.harness.runner import RunOptions
from parity.harness.scenario import make_scenario
from parity.vocab import Fault


def run(raw: dict, *faults, steps=2):
    s = make_scenario({"name": "t-overlap", "steps": steps, **raw})
    inj = tuple(parse_injection(f) if isinstance(f, str) else f for f in faults)
    entry, results = run_scenario(s, RunOptions(injections=inj, progress=False, snapshot="none",
                                                golden_digests=False), timeout_s=60)
    assert entry["status"] != "error", entry.get("error")
    return entry, results


def checks(results, name):
    return [c for r in results for c in r["checks"] if c["check"] == name]


W4_OVERLAP = dict(world=4, moe=True, ep=2, overlap=True)


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_clean_overlap_run_checks_every_window():
    entry, results = run(W4_OVERLAP, steps=2)
    assert entry["status"] == "pass", (entry["first_divergence"], entry["failed_checks"])
    got = checks(results, "param-gather-once")
    # one check per rank and optimizer step (the last one closed by the extra forward)
    assert sorted((c["rank"], c["step"]) for c in got) == [(r, s) for r in range(4) for s in range(2)]
    assert all(c["ok"] for c in got)
    assert entry["compared_by_phase"]["param_sync"] > 0
    assert entry["steps"] == 2
    waits = checks(results, "param-gather-prefetched")  # the same windows, each wait looked at
    assert sorted((c["rank"], c["step"]) for c in waits) == [(r, s) for r in range(4) for s in range(2)]
    assert all(c["ok"] and c["examined"] > 0 for c in waits)


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_a_lost_prefetch_is_caught_though_every_bit_agrees():
    """Pre-hooks that never launch the next group's gather land the same bytes, each gather
    launched when its own params are needed: no comparison differs, and only the record of
    where each pre-hook found its gather shows the lost overlap, in the first window."""
    entry, results = run(W4_OVERLAP, Fault.NEXT_GATHER_NOT_PREFETCHED.value, steps=2)
    assert entry["status"] == "fail" and entry["first_divergence"] is None
    assert {c["check"] for c in entry["failed_checks"]} == {"param-gather-prefetched"}
    bad = [c for c in checks(results, "param-gather-prefetched") if not c["ok"]]
    assert {c["step"] for c in bad} == {0, 1} and {c["rank"] for c in bad} == set(range(4))
    # the first group the chain reaches after the forward's first one: layers.0's projection
    assert "layers.0.attn.proj.weight" in bad[0]["message"] and "expected in_flight" in bad[0]["message"]


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_missing_prehooks_fail_at_the_first_stale_weight():
    """Without the harness's forced gather the pre-hooks are the only gather: a group without
    them leaves its params stale in the next forward (the first use names the param)."""
    entry, results = run(W4_OVERLAP, Fault.PREHOOKS_NOT_REGISTERED.value, steps=2)
    assert entry["status"] == "fail"
    fd = entry["first_divergence"]
    assert (fd["step"], fd["phase"]) == (0, "param_sync")
    assert fd["tensor"].startswith("layers.0.attn.qkv.weight")
    bad = [c for c in checks(results, "param-gather-once") if not c["ok"]]
    assert bad and {c["step"] for c in bad} == {0, 1}
    assert "layers.0.attn.qkv.weight" in bad[0]["message"] and "none" in bad[0]["message"]


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_wait_on_the_wrong_handle_is_caught():
    entry, results = run(W4_OVERLAP, Fault.WAIT_WRONG_HANDLE.value, steps=2)
    assert entry["first_divergence"]["phase"] == "param_sync"
    assert any(not c["ok"] for c in checks(results, "param-gather-once"))


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_padded_pair_compares_the_pre_hook_gather_with_the_eager_one():
    """On the padded layout the overlapped side gathers the shard-aligned buffers (DistOpt style)
    in its pre-hooks, the reference right after the step: a broken pre-hook path fails the pair."""
    pair = dict(world=2, layout="padded", pair="overlap_param_gather", fp8_param_gather=False)
    clean, results = run(pair)
    assert clean["status"] == "pass"
    assert checks(results, "param-gather-once") and all(c["ok"] for c in checks(results, "param-gather-once"))
    entry, _ = run(pair, Fault.PREHOOKS_NOT_REGISTERED.value)
    assert (entry["first_divergence"]["step"], entry["first_divergence"]["phase"]) == (0, "param_sync")


@pytest.mark.slow
def test_cli_overlap_run_exits_1_naming_the_stale_param(tmp_path):
    out = tmp_path / "o"
    r = cli_fork.run(["run", "default", "--overlap", "--steps", "2", "--inject", "prehooks-not-registered",
                      "--out", out, "--golden", "off"], timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "param_sync" in r.stdout and "layers.0.attn.qkv.weight" in r.stdout
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    assert e["first_divergence"]["tensor"].startswith("layers.0.attn.qkv.weight")


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_one_ulp_in_a_weight_before_use_is_caught_at_param_sync():
    """Under overlap param_sync of step 1 is captured in step 2's forward, before the weight is
    used: a one-ULP change there is reported at (1, param_sync) and then propagates."""
    entry, _ = run(dict(world=2, overlap=True), Injection("ulp", step=1, phase="param_sync", param="*"), steps=3)
    fd = entry["first_divergence"]
    assert (fd["step"], fd["phase"]) == (1, "param_sync")
    assert fd["tensor"].endswith(".fp8.rowwise_data")


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_force_sync_payload_is_seen_only_by_the_post_condition():
    """The payload a force_sync leaves in grad_data is wiped by the next step's zeroing, so no
    comparison of two stacks' buffers or values can see it (zeros vs zeros): only the check of the
    buffer right after the sync does. Experts at EP 2 of world 2 have expert-DP 1: their buckets
    gather nothing and keep their reduced grads (a clean run must pass there too)."""
    pair = dict(world=2, pair="force_sync", moe=True, ep=2)
    clean, _ = run(pair)
    assert clean["status"] == "pass"
    entry, results = run(pair, Fault.FORCE_SYNC_PAYLOAD_NOT_ZEROED.value)
    assert entry["n_divergences"] == 0 and entry["first_divergence"] is None
    bad = [c for c in checks(results, "grad-buffer-clean") if not c["ok"]]
    assert {c["step"] for c in bad} == {0, 1}


@pytest.mark.slow
@pytest.mark.ranks(2)
@pytest.mark.parametrize("overlap", [False, True])
def test_microbatches_pass_and_record_each_microbatch(overlap):
    entry, results = run(dict(world=2, overlap=overlap, microbatches=3, recipe="mxfp8"), steps=2)
    assert entry["status"] == "pass", (entry["first_divergence"], entry["failed_checks"])
    # ranks x steps x ((loss, output) per microbatch + the mean loss)
    assert entry["compared_by_phase"]["forward"] == 2 * 2 * (2 * 3 + 1)
    assert all(s["loss_bits"] == s["loss_b_bits"] for s in results[0]["steps"])


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_regathering_during_accumulation_is_caught():
    entry, results = run(dict(world=2, overlap=True, microbatches=2),
                         Fault.PAYLOAD_IN_GRAD_DURING_ACCUMULATION.value, steps=2)
    fd = entry["first_divergence"]
    assert (fd["step"], fd["phase"]) == (1, "grad_reduce")
    bad = [c for c in checks(results, "param-gather-once") if not c["ok"]]
    assert bad and "pre_hook, pre_hook" in bad[0]["message"].replace("'", "")


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_stale_fp8_cache_is_caught_on_the_side_that_has_it():
    # The cache exists for bf16 weights only: the test side runs them (fp8 param gather OFF),
    # deferred gather against eager.
    pair = dict(world=2, pair="overlap_param_gather", fp8_param_gather=False, microbatches=2)
    clean, _ = run(pair)
    assert clean["status"] == "pass"
    entry, _ = run(pair, Fault.FP8_CACHE_NOT_REFRESHED.value)
    fd = entry["first_divergence"]
    assert (fd["step"], fd["phase"]) == (0, "param_sync") and ".fp8." in fd["tensor"]


@pytest.mark.parametrize("overlap", [False, True])
def test_param_sync_holds_the_fp8_bytes_the_next_forward_used(single_rank, overlap):
    # A bf16 stack whose first-microbatch FP8 cache goes stale: param_sync of step 0 must be the
    # bytes step 1's forward quantized (here: kept) and used, not what the weight quantizes to now.
    # Without overlap too; a capture that quantized the weight itself would see fresh bytes.
    import dataclasses

    import torch

    from parity.distributed.groups import build_groups
    from parity.optim.stack import Stack

    s = make_scenario({"name": "t", "world": 1, "overlap": overlap, "microbatches": 2, "steps": 2})
    off = s.stack_configs()[1]
    cfg = dataclasses.replace(off, faults=frozenset({Fault.FP8_CACHE_NOT_REFRESHED}))
    stack = Stack(cfg, build_groups(1), torch.device("cpu"))
    seen = {}

    def keep(step, phase, tensors, complete=True):
        if phase == "param_sync":
            seen.update({(step, k): v.clone() for k, v in tensors.items()})

    stack.step(0, keep)
    assert not seen  # nothing is captured before a forward consumes the params
    m = next(iter(stack.fp8_linears.values()))
    fresh = m.fp8_weight().rowwise_data.view(torch.uint8).clone()  # the weight after step 0, quantized
    stack.step(1, keep)
    used = seen[(0, f"{stack.names[m.weight]}.fp8.rowwise_data")].view(torch.uint8)
    assert used.equal(m._fp8_cache.rowwise_data.view(torch.uint8))  # the stale cache the forward used
    assert not used.equal(fresh)
    stack.flush(keep)  # the last step's params: one more forward consumes them, the stale cache still
    assert seen[(1, f"{stack.names[m.weight]}.fp8.rowwise_data")].view(torch.uint8).equal(used)


def _noop(*args, **kwargs):
    pass


def _async_gather_rank(ctx) -> dict:
    """One overlapped step on 2 ranks, then one group's gather by hand: launched, in flight,
    params untouched until the pre-hook's wait + copy-back."""
    import torch

    from parity.distributed.groups import build_groups
    from parity.optim.stack import Stack

    s = make_scenario({"name": "t", "world": 2, "overlap": True, "steps": 1})
    stack = Stack(s.stack_configs()[0], build_groups(1), torch.device("cpu"))
    stack.step(0, _noop)
    ddp = stack.ddp
    # The same group on every rank; an FP8 param of it is written by the gather only (owner too).
    g, p = next((g, p) for g in ddp.bucket_groups if g.is_layer_wise and g.gathers_params
                for p in g.params if hasattr(p, "qt"))
    before = p.qt.rowwise_data.clone()
    g.start_param_sync()
    out = {"handle": type(g.param_gather_handle).__name__, "pending": g.param_gather_pending,
           "untouched_in_flight": torch.equal(p.qt.rowwise_data, before)}
    ddp.finish_param_sync(g)  # what the pre-hook of the group's first module does
    out.update(changed=not torch.equal(p.qt.rowwise_data, before), record=list(g.param_gathers),
               handle_after=g.param_gather_handle, zeroed=all(int(b.grad_data.count_nonzero()) == 0
                                                               for b in g.buckets))
    return out


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_param_gather_is_asynchronous_and_finished_by_the_pre_hook():
    from parity.harness.launch import LaunchConfig, launch

    for r, seen in enumerate(launch(_async_gather_rank, LaunchConfig(world_size=2, start_method="forkserver",
                                                                      deadline_s=180))):
        assert seen["handle"] == "WorkList" and seen["pending"], r
        assert seen["untouched_in_flight"], f"rank {r}: the copy-back ran before the wait"
        assert seen["changed"] and seen["record"] == ["pre_hook"] and seen["handle_after"] is None, r
        assert seen["zeroed"], f"rank {r}: the payload stayed in the grad buffer"


def test_reductions_launch_on_the_last_microbatch_only(single_rank, monkeypatch):
    import torch

    from parity.ddp.buffers import BucketGroup
    from parity.distributed.groups import build_groups
    from parity.optim.stack import Stack

    from parity.ddp.buffers import AT_FINISH, BACKWARD

    s = make_scenario({"name": "t", "world": 1, "overlap": True, "microbatches": 3, "steps": 2})
    stack = Stack(s.stack_configs()[0], build_groups(1), torch.device("cpu"))
    launched = []
    real = BucketGroup.start_grad_sync

    def spy(self, async_op=False):
        launched.append((async_op, stack.ddp.is_last_microbatch))
        return real(self, async_op)

    monkeypatch.setattr(BucketGroup, "start_grad_sync", spy)
    groups = stack.ddp.bucket_groups
    stack.step(0, _noop)
    # the first step learns how often each param reports; finish_grad_sync reduces every group
    assert launched == [] and all(g.grad_reduces == [AT_FINISH] for g in groups)
    stack.step(1, _noop)
    # then every group launched once, asynchronously, during the last microbatch's backward
    assert launched == [(True, True)] * len(groups)
    assert all(g.grad_reduces == [AT_FINISH, BACKWARD] for g in groups)


def test_a_group_whose_param_never_reports_stops_the_next_step(single_rank):
    """Upstream's counting (docs/spec/megatron.md s1.3 step 3): a group in which some params
    reported in the first step and one did not stops at the next zero_grad_buffer, naming it."""
    import torch

    from parity.distributed.groups import build_groups
    from parity.optim.stack import Stack

    s = make_scenario({"name": "t", "world": 1, "overlap": True, "steps": 2})
    stack = Stack(s.stack_configs()[0], build_groups(1), torch.device("cpu"))
    group = next(g for g in stack.ddp.bucket_groups if len(g.params) > 1)
    silent = id(group.params[0])
    real = group.register_grad_ready
    group.register_grad_ready = lambda p: None if id(p) == silent else real(p)
    stack.step(0, _noop)  # the first step only counts, and reduces in finish_grad_sync
    with pytest.raises(RuntimeError, match=f"bucket group of {len(group.params)} params: only "
                                           f"{len(group.params) - 1} reported their grads in the first step"):
        stack.step(1, _noop)


def _forced_sync_rank(ctx) -> dict:
    """Two identical overlapped stacks; one forces its param sync after step 1 (as before a
    checkpoint save). Both must train on identically; the forced one's window says force_sync."""
    import torch

    from parity.distributed.groups import build_groups
    from parity.optim.stack import Stack

    s = make_scenario({"name": "t", "world": 2, "overlap": True, "steps": 3})
    cfg = s.stack_configs()[0]
    plain, forced = (Stack(cfg, build_groups(1), torch.device("cpu")) for _ in range(2))
    losses = {"plain": [], "forced": []}
    clean = None

    def keep(name):
        def on_phase(step, phase, tensors, complete=True):
            if phase == "forward":
                losses[name].append(tensors["loss"].view(torch.int32).item())
        return on_phase

    records = []  # the plain stack's DDP records after each step: landed gathers, pre-hook waits
    for step in range(3):
        plain.step(step, keep("plain"))
        forced.step(step, keep("forced"))
        records.append((sum(map(len, (g.param_gathers for g in plain.ddp.bucket_groups))),
                        len(plain.ddp.pre_hook_waits)))
        if step == 1:
            forced.force_param_sync()
            clean = forced.grad_buffer_clean  # the stack's own reading, right after the sync it made
    windows = {w.step: w for w in forced.closed_windows}
    rows = {k: forced.gather_report(w) for k, w in windows.items()}
    return {"losses": losses, "sources": {k: w.source for k, w in windows.items()},
            "before": {k: sorted({tuple(r["before_first_use"]) for r in v if r["expect"]}) for k, v in rows.items()},
            "clean": clean, "clean_after": forced.grad_buffer_clean, "records": records}


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_forced_param_sync_mid_run_is_recorded_and_changes_nothing():
    from parity.harness.launch import LaunchConfig, launch

    for r, seen in enumerate(launch(_forced_sync_rank, LaunchConfig(world_size=2, start_method="forkserver",
                                                                     deadline_s=180))):
        assert seen["losses"]["plain"] == seen["losses"]["forced"], r
        assert seen["sources"] == {0: "pre_hook", 1: "force_sync"}, r
        assert seen["before"] == {0: [("pre_hook",)], 1: [("force_sync",)]}, r
        assert seen["clean"] is True and seen["clean_after"] is None, r  # reset by the next step
        # The records the gather checks read keep one window (gathers landed in every window: above).
        assert seen["records"][1] == seen["records"][2], (r, seen["records"])
