"""The replica check catches what the ON == OFF comparison cannot: a bug that moves both sides
alike on one rank. Here rank 1 drops rank 0's slot of every LayerWise param gather, on both
sides (a shared code path), so its replicas of rank 0's params stay stale while ON still equals
OFF on every rank. Only the check that the DP replicas agree can see it, and it names them."""

import pytest

from parity.harness.launch import LaunchConfig, launch
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario

SCENARIO = {"name": "stale-replica", "world": 2, "steps": 2}


def _rank(ctx, stale: bool) -> dict:
    from parity.ddp import param_sync

    if stale:
        copy_back_all = param_sync.copy_back_all

        def rank_0_slot_dropped_on_rank_1(lists, flat, sizes, fp8_staged, my_rank):
            if my_rank == 1:
                lists = [[] if r == 0 else lst for r, lst in enumerate(lists)]
            return copy_back_all(lists, flat, sizes, fp8_staged, my_rank)

        param_sync.copy_back_all = rank_0_slot_dropped_on_rank_1
    return rank_main(ctx, make_scenario(SCENARIO), RunOptions(progress=False, snapshot="none",
                                                              golden_digests=False))


def _run(stale: bool) -> list[dict]:
    return launch(_rank, LaunchConfig(world_size=2, start_method="forkserver", deadline_s=180), stale)


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_a_stale_replica_on_one_rank_fails_the_replica_check():
    for res in _run(stale=True):
        assert res["divergences"] == [], res["divergences"][:2]  # ON == OFF on every rank
        failed = [c for c in res["checks"] if not c["ok"]]
        assert {c["check"] for c in failed} == {"replicas/dp"}, failed
        assert {c["step"] for c in failed} == {0, 1}
        assert "tensors differ across dp replicas, first: ['" in failed[0]["message"], failed[0]["message"]


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_the_same_run_unpatched_passes_the_replica_check():
    for res in _run(stale=False):
        assert res["divergences"] == []
        assert [c for c in res["checks"] if not c["ok"]] == []
        assert any(c["check"] == "replicas/dp" for c in res["checks"])
