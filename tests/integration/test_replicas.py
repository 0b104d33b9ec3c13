"""The replica check catches what the ON == OFF comparison cannot: a bug that moves both sides
alike on one rank. With the shared fault `rank1-skips-rank0-slot`, rank 1 drops rank 0's slot of
every LayerWise param gather, on both sides (a code path they share), so its replicas of rank 0's
params stay stale while ON still equals OFF on every rank. Only the check that the DP replicas
agree can see it, and it names them."""

import pytest

from parity.harness.driver import run_scenario
from parity.harness.faults import SHARED_FAULTS, Injection
from parity.harness.runner import RunOptions
from parity.harness.scenario import make_scenario
from parity.vocab import Fault

SCENARIO = {"name": "stale-replica", "world": 2, "steps": 2}


def _run(*faults) -> list[dict]:
    opts = RunOptions(injections=tuple(Injection("fault", name=f) for f in faults), progress=False,
                      snapshot="none", golden_digests=False)
    entry, results = run_scenario(make_scenario(SCENARIO), opts, timeout_s=120)
    assert entry["status"] != "error", entry.get("error")
    return results


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_a_stale_replica_on_one_rank_fails_the_replica_check():
    assert Fault.RANK1_SKIPS_RANK0_SLOT in SHARED_FAULTS  # injected into both sides
    for res in _run(Fault.RANK1_SKIPS_RANK0_SLOT):
        assert res["divergences"] == [], res["divergences"][:2]  # ON == OFF on every rank
        failed = [c for c in res["checks"] if not c["ok"]]
        assert {c["check"] for c in failed} == {"replicas/dp"}, failed
        assert {c["step"] for c in failed} == {0, 1}
        assert "tensors differ across dp replicas, first: ['" in failed[0]["message"], failed[0]["message"]


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_the_same_run_without_it_passes_the_replica_check():
    for res in _run():
        assert res["divergences"] == []
        assert [c for c in res["checks"] if not c["ok"]] == []
        assert any(c["check"] == "replicas/dp" for c in res["checks"])
