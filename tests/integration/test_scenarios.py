"""Every shipped scenario passes ON == OFF bitwise on CPU ranks and matches its golden record:
bit for bit where the golden is for this platform, else (another CPU kernel set, another torch)
in the approximate tier against another platform's golden, with the drift printed. A scenario
without any golden fails: the suite cannot go green without checking one."""

import pytest

from parity.harness import goldens_cli
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_all

SCENARIOS = load_all()
CI_STEPS = 8
"""The suite checks the first CI_STEPS steps of each golden (a prefix check, to keep the 2-core CI
run short; the stress set reaches FP8's edges at step 0); `parity golden check` runs them whole.
Resume scenarios run whole (their checkpoint sits past this prefix); an LR schedule keeps its
length in a prefix (Scenario.prefix)."""


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


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario_passes(scenario):
    why = goldens_cli.why_not_runnable(scenario)
    if why:
        pytest.skip(why)
    if scenario.resume_at is None and scenario.steps > CI_STEPS:
        scenario = scenario.prefix(CI_STEPS)
    found = goldens_cli.prepare([scenario], allow_other_platform=True)[scenario.name]
    entry, results = run_scenario(scenario, RunOptions(progress=False, snapshot="none", golden_digests=True))
    assert entry["status"] == "pass", (entry.get("error"), entry.get("first_divergence"),
                                       entry.get("failed_checks"), entry.get("messages"))
    assert entry["steps"] == scenario.steps
    for phase, n in entry["compared_by_phase"].items():
        assert n > 0, phase
    goldens_cli.check(entry, scenario, results, found, require=True)
    print("\n".join(entry["golden_messages"]))  # the drift table, shown with -rP or on failure
    assert entry["golden"] == "pass", entry["golden_messages"]
