"""Every shipped scenario passes ON == OFF bitwise on CPU ranks and matches its golden record:
bit for bit where the golden is for this platform, else (another CPU kernel set, another torch)
in the approximate tier against another platform's golden, with the drift printed. A scenario
without any golden fails: the suite cannot go green without checking one. A scenario whose golden
configuration another scenario runs for at least as many steps (the quick set's cases, mostly) is
not run twice: its goldens must equal that scenario's, bit for bit."""

import dataclasses
import os

import pytest

from parity.harness import golden, goldens_cli
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.harness.faults import parse_injection
from parity.harness.scenario import load_all, load_set
from parity.vocab import Check

SCENARIOS = load_all()
CI_STEPS = 8
"""The suite checks the first CI_STEPS steps of each golden (a prefix check, to keep the 2-core CI
run short; the stress set reaches FP8's edges at step 0); `parity golden check` runs them whole.
Resume scenarios run whole (their checkpoint sits past this prefix); an LR schedule keeps its
length in a prefix (Scenario.prefix)."""


def checked_steps(s) -> int:
    """Steps the suite runs of scenario ``s``."""
    return s.steps if s.resume_at is not None else min(s.steps, CI_STEPS)


def _covering(scenarios) -> dict:
    """name -> the scenario whose run in this suite also runs it: the same golden configuration
    (the golden identity leaves out name and step count, so both runs compute the same steps from
    the same seed) with at least as many steps checked. ``quick-w4-moe`` is the first 3 steps of
    ``default``, say: running both would compute those 3 steps twice."""
    by_config = {}
    for s in scenarios:
        by_config.setdefault(golden.fingerprint(golden.scenario_config(s)), []).append(s)
    out = {}
    for same in by_config.values():
        keep = max(same, key=lambda s: (checked_steps(s), s.steps, s.name))
        out.update({s.name: keep for s in same if s is not keep})
    return out


COVERED = _covering(SCENARIOS)
RUN = [s for s in SCENARIOS if s.name not in COVERED]


def test_scenarios_exist_and_cover_the_matrix():
    names = {s.name for s in SCENARIOS}
    assert "default" in names
    cells = {(s.recipe, s.overlap, s.moe, s.ep) for s in SCENARIOS if s.pair == "fp8_param_gather"}
    for recipe in ("blockwise", "mxfp8"):
        for overlap in (False, True):
            assert (recipe, overlap, False, 1) in cells
            assert (recipe, overlap, True, 1) in cells
            assert (recipe, overlap, True, 8) in cells
    assert any(s.layout == "padded" for s in SCENARIOS)


CONDITIONAL_CHECKS = {Check.CLIP_REACHES_STEPPED_GRADS, Check.SAVE_LEAVES_STATE, Check.CHECKPOINT_HOLDS_STATE,
                      Check.PARAM_GATHER_ONCE, Check.PARAM_GATHER_PREFETCHED, Check.REPLICAS, Check.GRAD_BUFFER_CLEAN}


def ranks(s) -> int:
    """CPU ranks a run of ``s`` has at once (a resume at another world restarts at that one); none
    for a scenario on GPUs."""
    return max(s.world, s.resume_world or 0) if s.device == "cpu" else 0


@pytest.mark.slow
@pytest.mark.parametrize("scenario", [pytest.param(s, marks=pytest.mark.ranks(ranks(s))) for s in RUN],
                         ids=[s.name for s in RUN])
def test_scenario_passes(scenario, tmp_path):
    why = goldens_cli.why_not_runnable(scenario)
    if why:
        pytest.skip(why)
    if scenario.resume_at is None and scenario.steps > CI_STEPS:
        scenario = scenario.prefix(CI_STEPS)
    found = goldens_cli.prepare([scenario], allow_other_platform=True)[scenario.name]
    entry, results = run_scenario(scenario, RunOptions(progress=False, snapshot="none", golden_digests=True,
                                                       out_dir=str(tmp_path)))
    assert entry["status"] == "pass", (entry.get("error"), entry.get("first_divergence"),
                                       entry.get("failed_checks"), entry.get("messages"))
    assert entry["steps"] == scenario.steps
    for phase, n in entry["compared_by_phase"].items():
        assert n > 0, phase
    # what the checks looked at: every recorded check is a catalogued one, and those the
    # configuration calls for ran
    ran = {Check.family(c["check"]) for c in entry["checks"]}
    assert ran.isdisjoint(entry["checks_not_run"]) and ran | set(entry["checks_not_run"]) == set(Check)
    # every check runs in every configuration but these, each held below to the configurations
    # that call for it
    assert set(entry["checks_not_run"]) <= CONDITIONAL_CHECKS, entry["checks_not_run"]
    assert all(c["evaluated"] > 0 and c["failed"] == 0 for c in entry["checks"])
    assert (Check.CLIP_REACHES_STEPPED_GRADS in ran) == (scenario.clip_grad > 0)
    assert (Check.SAVE_LEAVES_STATE in ran) == (scenario.resume_at is not None)
    assert (Check.CHECKPOINT_HOLDS_STATE in ran) == (scenario.resume_at is not None)
    if scenario.resume_at is not None:  # some rank compared some state with the saved checkpoint
        assert next(c for c in entry["checks"] if c["check"] == Check.CHECKPOINT_HOLDS_STATE)["examined"] > 0
        # the resumed run is held to the uninterrupted one (state both sides lose alike shows only
        # there); one that restarts at another world, to the saved checkpoint's gathered view
        r, resharded = entry["resume"], (scenario.resume_world or scenario.world) != scenario.world
        against = "saved checkpoint (gathered view)" if resharded else "uninterrupted run"
        assert (r["resharded"], r["against"], "note" in r) == (resharded, against, resharded)
        assert r["compared"] > 0 and r["mismatches"] == 0
        # the run's output keeps the checkpoint it resumed from, and only that (a reshard's re-saved
        # copy of the loaded state is removed once compared)
        assert os.listdir(tmp_path / "checkpoints" / scenario.name) == [f"step{scenario.resume_at}"]
    test_side = scenario.stack_configs()[0]
    gathers_overlapped = test_side.ddp.overlap_param_gather
    assert (Check.PARAM_GATHER_ONCE in ran) == gathers_overlapped
    hooks_gather = gathers_overlapped and not test_side.force_sync_each_step  # else forced syncs land them
    assert (Check.PARAM_GATHER_PREFETCHED in ran) == hooks_gather
    if hooks_gather:  # some pre-hook wait was held to the rule
        assert next(c for c in entry["checks"] if c["check"] == Check.PARAM_GATHER_PREFETCHED)["examined"] > 0
    assert (Check.REPLICAS in ran) == (scenario.world > 1)
    # a forced param sync (each step of the force_sync pair, before a save) under overlap leaves the
    # compact LayerWise buffers at DP > 1 empty: read after each one there, nowhere else
    forced = gathers_overlapped and (test_side.force_sync_each_step or scenario.resume_at is not None)
    assert (Check.GRAD_BUFFER_CLEAN in ran) == (forced and test_side.ddp.layout == "compact" and scenario.world > 1)
    assert Check.FINITE in ran  # the optimizer's state is scanned every step, so a clean pass is recorded
    masters = next(c for c in entry["checks"] if c["check"] == Check.PARAMS_HOLD_MASTERS)
    assert masters["examined"] > 0  # some rank compared some master with its param
    goldens_cli.check(entry, scenario, results, found, require=True)
    print("\n".join(entry["golden_messages"]))  # the drift table, shown with -rP or on failure
    assert entry["golden"] == "pass", entry["golden_messages"]


@pytest.mark.parametrize("name", sorted(COVERED))
def test_a_covered_scenarios_goldens_equal_its_coverers(name):
    """A scenario not run above (another one's run computes its steps) is checked through its
    goldens: each must be bit-identical, over all its steps and ranks, to the covering scenario's
    golden of the same platform, which the covering run is checked against. A golden of it that
    no covering golden vouches for fails."""
    short = next(s for s in SCENARIOS if s.name == name)
    cover = COVERED[name]
    assert checked_steps(cover) >= checked_steps(short)
    root = goldens_cli.default_root()
    mine = [r for r in golden.list_goldens(root) if r.scenario == name]
    theirs = {r.platform_id: r for r in golden.list_goldens(root) if r.scenario == cover.name}
    assert mine, f"{name} has no golden"
    for ref in mine:
        assert ref.platform_id in theirs, f"{name}/{ref.platform_id}: {cover.name} has no golden there"
        rec, cover_rec = golden.load(ref.path), golden.load(theirs[ref.platform_id].path)
        assert rec.fingerprint == cover_rec.fingerprint == golden.fingerprint(golden.scenario_config(short))
        c = golden.compare(cover_rec, rec)
        assert c.status == "pass" and c.steps == rec.steps == short.steps, c.messages()
        assert sum(c.n_compared.values()) > 0
        assert all(r.loss[: rec.steps] == cover_rec.ranks[k].loss[: rec.steps] for k, r in rec.ranks.items())


def _step0_loss_and_norm(base, ep: int, injections=()) -> tuple:
    s = dataclasses.replace(base, ep=ep, steps=1, name=f"{base.name}-ep{ep}")
    entry, _ = run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=False,
                                          injections=injections))
    assert entry["status"] == "pass", (entry.get("error"), entry.get("failed_checks"))
    return entry["loss"][0]["bits"], float(entry["optimizer"][0]["grad_norm"]).hex()


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_the_first_steps_loss_and_grad_norm_do_not_depend_on_ep():
    """One model on 4 ranks at EP 1, 2 and 4: the forward gives every token the same math, and the
    expert grads, summed over the expert-DP group but scaled by 1/DP (docs/spec/megatron.md s1.3
    step 4), are the same grads, so step 0's loss and grad norm are the same bits (measured: the
    expert block dots here are exact, so the token order does not round). A shared bug that moves
    ON and OFF alike but depends on EP shows here without a golden: scaling the expert grads by
    the expert-DP group's size (s5 item 42, injected into both sides) makes them EP times too
    large."""
    base = next(s for s in load_set("quick") if s.name == "quick-w4-moe")
    clean = {ep: _step0_loss_and_norm(base, ep) for ep in (1, 2, 4)}
    assert clean[1] == clean[2] == clean[4], clean
    fault = (parse_injection("expert-grads-scaled-by-expert-dp"),)
    faulty = {ep: _step0_loss_and_norm(base, ep, fault) for ep in (1, 2)}
    assert faulty[1] == clean[1]  # at EP 1 expert-DP is DP: the fault changes nothing
    assert faulty[2][0] == clean[2][0] and faulty[2][1] != clean[2][1], (clean, faulty)  # same loss, larger norm
