"""Every shipped scenario passes ON == OFF bitwise on CPU ranks, and matches its golden record
where one exists for this platform."""

import pytest
import torch

from parity.harness.golden import list_goldens
from parity.harness.goldens_cli import check_results, default_root
from parity.harness.platform import platform_fingerprint, platform_id
from parity.harness.driver import run_scenario
from parity.harness.runner import RunOptions
from parity.harness.scenario import load_all

SCENARIOS = load_all()


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
    if scenario.device == "cuda" and torch.cuda.device_count() < scenario.world:
        pytest.skip(f"needs {scenario.world} CUDA device(s); have {torch.cuda.device_count()}")
    entry, results = run_scenario(scenario, RunOptions(progress=False, snapshot="none", golden_digests=True))
    assert entry["status"] == "pass", (entry.get("error"), entry.get("first_divergence"),
                                       entry.get("failed_checks"), entry.get("messages"))
    assert entry["steps"] == scenario.steps
    for phase, n in entry["compared_by_phase"].items():
        assert n > 0, phase
    pid = platform_id(platform_fingerprint(scenario.device, "nccl" if scenario.device == "cuda" else "gloo"))
    if not any(r.scenario == scenario.name and r.platform_id == pid for r in list_goldens(default_root())):
        pytest.skip(f"no golden for {scenario.name} on platform {pid}: ON == OFF checked, golden not")
    status, msgs = check_results(scenario, results)
    assert status == "pass", msgs[:5]
