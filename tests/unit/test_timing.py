"""The per-phase clock of a rank and its merge into report.json / summary.md."""

import time

import torch

from parity.harness.timing import PhaseClock, merge_timing, timing_md


def _spin(s):
    t = time.perf_counter()
    while time.perf_counter() - t < s:
        pass


def test_clock_charges_stack_phases_and_harness_parts_separately():
    c = PhaseClock(torch.device("cpu"))
    c.start()
    _spin(0.02)  # the ref stack's forward
    c.stack_reached(0, "ref", "forward")
    _spin(0.01)  # capture and compare, with a golden part inside
    with c.part(0, "golden"):
        _spin(0.02)
    c.harness_done(0)
    _spin(0.03)  # the test stack's forward
    c.stack_reached(0, "test", "forward")
    c.harness_done(0)
    d = c.to_dict()[0]
    assert 0.02 <= d["ref"]["forward"] < 0.03
    assert 0.03 <= d["test"]["forward"] < 0.045
    assert 0.02 <= d["harness"]["golden"] < 0.035
    # the golden part is taken out of the span it ran in
    assert 0.01 <= d["harness"]["capture_compare"] < 0.02


def test_merge_averages_ranks_per_step_and_reports_the_rest():
    r0 = {"build_s": 1.0, "timing": {-1: {"test": {"init": 0.0}}, 0: {"test": {"forward": 2.0}, "ref": {"forward": 1.0},
                                                                     "harness": {"capture_compare": 0.5}}}}
    r1 = {"build_s": 3.0, "timing": {0: {"test": {"forward": 4.0}, "ref": {"forward": 3.0},
                                         "harness": {"capture_compare": 1.5}}}}
    t = merge_timing([r0, r1, {"rank": "verdict"}], start_s=0.5, elapsed_s=10.0)
    assert t["build_s"] == 2.0 and t["start_s"] == 0.5 and t["ranks_averaged"] == 2
    assert t["totals"]["test"]["forward"] == 3.0 and t["totals"]["ref"]["forward"] == 2.0
    assert t["totals"]["harness"]["capture_compare"] == 1.0
    assert t["rest_s"] == round(10.0 - 0.5 - 2.0 - (3.0 + 2.0 + 1.0), 3)
    md = "\n".join(timing_md("s", t, 10.0))
    assert "| forward | 3.000 | 2.000 | 3.0000 | 2.0000 |" in md  # one step (step -1 is not a step)
    assert "| harness: capture compare | 1.000 |" in md
    assert merge_timing([{"rank": 0}], None) == {}
