"""Detector power: every catalogued fault is caught by the check that exists for it, at the
expected place, and the same scenario passes clean.

The clean half is tests/integration/test_scenarios.py's: it runs every shipped scenario, the quick
set included, whole (3 steps, within its prefix) and checks its golden too, so the fault cases here
run only the injected side (`parity selftest` runs both). A quick scenario whose configuration
another scenario runs for longer is run there, and its goldens are checked equal to that one's."""

import pytest

from parity.harness.faults import CATALOGUE, GOLDEN_ONLY_FAULTS, SHARED_FAULTS
from parity.harness.selftest import CASES, QUICK_SET, run_selftest

from test_scenarios import COVERED, RUN, SCENARIOS, checked_steps, ranks  # (tests/integration is on sys.path)

_SHIPPED = {s.name: s for s in SCENARIOS}
CASE_SCENARIO = {fault: _SHIPPED.get(f"{QUICK_SET}-{key}") for fault, (key, _) in CASES.items()}
"""fault -> its case's shipped scenario (None where it is missing: the first test below says so)."""


def test_every_catalogued_fault_has_a_case():
    assert set(CASES) == set(CATALOGUE)
    assert len(CATALOGUE) >= 16


def test_the_golden_only_faults_are_the_shared_faults_whose_cases_expect_a_golden_difference_alone():
    # `parity run` notes, from GOLDEN_ONLY_FAULTS, where an injected one tests nothing
    assert GOLDEN_ONLY_FAULTS == {f for f, (_, exp) in CASES.items() if all(e.kind == "golden" for e in exp)}
    assert GOLDEN_ONLY_FAULTS <= SHARED_FAULTS and GOLDEN_ONLY_FAULTS


def test_every_case_scenario_runs_clean_and_whole_in_test_scenarios():
    for fault, (key, _) in CASES.items():
        s = CASE_SCENARIO[fault]
        assert s is not None, f"{fault}: its scenario {QUICK_SET}-{key} is not a shipped scenario"
        ran = COVERED.get(s.name, s)
        assert ran in RUN and checked_steps(ran) >= s.steps, f"{s.name}: test_scenarios runs only a prefix"


@pytest.mark.slow
@pytest.mark.parametrize("fault", [pytest.param(f, marks=pytest.mark.ranks(ranks(s) if s else 0))
                                   for f, s in sorted(CASE_SCENARIO.items())])
def test_fault_is_caught(fault):
    (row,) = run_selftest([fault], out=lambda *_: None, clean_runs=False)
    assert row["clean_passes"] is None
    assert row["caught"], f"{fault}: expected {row['expected']}, observed {row['observed']}"


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_the_fault_matrix_tells_caught_from_never_reached(tmp_path, monkeypatch, capsys):
    """`parity selftest --matrix`: rank 1's copy-back fault cannot run at world 1 (.) and is caught
    at world 2 (X); Newton-Schulz without eps runs everywhere, and only a never-routed expert's zero
    update turns it into a NaN the checks see (o without one, X with one). Through the command, on
    two scenarios of the quick set (its whole set would run 15)."""
    import json

    import parity.harness.scenario as scenario_mod
    from parity.cli import main
    from parity.harness.selftest import scenario as quick

    two = [quick("w1-moe"), quick("w2-ep2-stress")]
    monkeypatch.setattr(scenario_mod, "load_set", lambda name: two if name == "quick" else pytest.fail(name))
    code = main(["selftest", "--matrix", "--set", "quick", "--out", str(tmp_path),
                 "rank1-skips-rank0-slot", "muon-normalize-without-eps"])
    assert code == 0
    m = json.loads((tmp_path / "matrix.json").read_text())
    assert m["clean"] == {"quick-w1-moe": "pass", "quick-w2-ep2-stress": "pass"}
    assert [(c["fault"], c["scenario"], c["outcome"]) for c in m["cells"]] == [
        ("rank1-skips-rank0-slot", "quick-w1-moe", "never ran"),
        ("rank1-skips-rank0-slot", "quick-w2-ep2-stress", "caught"),
        ("muon-normalize-without-eps", "quick-w1-moe", "ran"),
        ("muon-normalize-without-eps", "quick-w2-ep2-stress", "caught")]
    rows = (tmp_path / "matrix.md").read_text().splitlines()
    assert rows[2] == "| rank1-skips-rank0-slot | . | X |" and rows[3] == "| muon-normalize-without-eps | o | X |"
    assert "[selftest] matrix of 2 faults x 2 scenarios in " in capsys.readouterr().out


@pytest.mark.parametrize("fired", [True, False])
def test_a_case_counts_as_caught_only_where_its_fault_ran(monkeypatch, fired):
    """The expected check failing is not enough: a run whose stacks never took the fault's
    deviation failed for another reason (here a fabricated entry stands in for the run)."""
    import parity.harness.selftest as selftest

    entry = {"status": "fail", "first_divergence": None, "failed_checks": [{"check": "reported/optimizer", "step": 1}],
             "faults_fired": ["optimizer-reported-once"] if fired else []}
    monkeypatch.setattr(selftest, "run_scenario", lambda *a, **k: (entry, []))
    (row,) = run_selftest(["optimizer-reported-once"], out=lambda *_: None, clean_runs=False)
    assert (row["caught"], row["fired"]) == (fired, fired)
