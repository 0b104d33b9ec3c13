"""The per-phase clock of a rank and its merge into report.json / summary.md."""

import pytest
import torch

from parity.harness import timing
from parity.harness.timing import PhaseClock, merge_timing, timing_md


def test_clock_charges_stack_phases_and_harness_parts_separately(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])

    def spin(s):
        now[0] += s

    c = PhaseClock(torch.device("cpu"))
    c.start()
    spin(0.02)  # the ref stack's forward
    c.stack_reached(0, "ref", "forward")
    spin(0.01)  # capture and compare, with a golden part inside
    with c.part(0, "golden"):
        spin(0.02)
    c.harness_done(0)
    spin(0.03)  # the test stack's forward
    c.stack_reached(0, "test", "forward")
    c.harness_done(0)
    d = c.to_dict()[0]
    assert d["ref"]["forward"] == 0.02 and d["test"]["forward"] == 0.03
    assert d["harness"]["golden"] == 0.02
    assert d["harness"]["capture_compare"] == 0.01  # the golden part is taken out of its span


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_mark_leaves_work_on_another_stream_in_flight():
    """A mark waits for the stream the stacks compute on, never for the device: a collective
    launched asynchronously runs on its own stream, and a device-wide barrier at every pre-hook
    mark would land it before the copy-back that is meant to wait for it (timing's docstring)."""
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    side = torch.cuda.Stream(dev)
    c = PhaseClock(dev)
    c.start()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):  # about 50 ms of GEMMs on the side stream, queued at once
        for _ in range(40):
            a = a @ a.mT / 4096
    c.stack_reached(0, "test", "forward")
    assert not side.query(), "the mark waited for another stream's work"
    side.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_mark_waits_for_the_stacks_own_stream():
    """A phase's time is its kernels' time: a mark waits for the stream the stacks compute on, or
    the queued work would be charged to whatever phase next waits for it."""
    dev = torch.device("cuda")
    a = torch.randn(4096, 4096, device=dev)
    c = PhaseClock(dev)
    c.start()
    for _ in range(40):  # about 50 ms of GEMMs, queued at once on the current stream
        a = a @ a.mT / 4096
    c.stack_reached(0, "test", "forward")
    assert torch.cuda.current_stream(dev).query(), "the mark did not wait for the stream's work"


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


def test_merge_reports_rank_cpu_time():
    cpu = {"user_s": 2.0, "system_s": 0.5, "voluntary_switches": 10, "involuntary_switches": 4, "page_faults": 7,
           "gc_s": 0.25}
    r0 = {"timing": {0: {"test": {"forward": 1.0}}}, "cpu": cpu}
    r1 = {"timing": {0: {"test": {"forward": 1.0}}}, "cpu": {k: 3 * v for k, v in cpu.items()}}
    t = merge_timing([r0, r1], start_s=None)
    assert t["cpu"]["user_s"] == 4.0 and t["cpu"]["system_s"] == 1.0 and t["ranks_averaged"] == 2
    md = "\n".join(timing_md("s", t, 3.0))
    assert "CPU time per rank (mean): user 4.0 s, system 1.0 s" in md and "; 2 ranks, " in md
    assert ", 14 page faults, 0.5 s in the garbage collector; " in md


def test_rank_cpu_counts_the_garbage_collectors_time():
    import gc

    timing.time_garbage_collection()
    try:
        junk = [[i] for i in range(200_000)]  # objects the collection has to walk
        before = timing.rank_cpu()["gc_s"]  # (a young collection may have run meanwhile)
        gc.collect()
        assert timing.rank_cpu()["gc_s"] > before
        del junk
    finally:  # the timer is global state: a rank keeps it for life, this test process does not
        gc.callbacks.remove(timing._gc_timer)


def test_rank_cpu_counts_this_process_work(tmp_path):
    before = timing.rank_cpu()
    with timing.profiled(str(tmp_path / "p" / "rank0.prof"), "cpu"):
        x = sum(i * i for i in range(300_000))
    after = timing.rank_cpu()
    assert x > 0 and after["user_s"] + after["system_s"] > before["user_s"] + before["system_s"]
    import pstats

    names = {fn for (_, _, fn) in pstats.Stats(str(tmp_path / "p" / "rank0.prof")).stats}
    assert "<genexpr>" in names  # the profiled block's own frames are in the file
    with timing.profiled(str(tmp_path / "p" / "rank0.prof"), "wall"):  # a second launch
        pass
    assert sorted(p.name for p in (tmp_path / "p").iterdir()) == ["rank0.2.prof", "rank0.prof"]


def test_ops_profile_counts_ops_by_issuing_parity_function(tmp_path):
    """One 1x128 rowwise quantization of a [4, 256] tensor: one call of the scale math (two IEEE
    divisions: fp8max / amax and 1 / scale), issued from parity's own frames; ops torch runs on
    its own (outside parity) are counted under '-'."""
    import json

    import torch

    from parity.fp8 import quantize

    x = torch.randn(4, 256, dtype=torch.bfloat16)
    path = tmp_path / "p" / "rank0.ops.json"
    with timing.profiled(str(path), "ops"):
        quantize(x, "blockwise", block="1x128", rowwise=True, columnwise=False)
        torch.ones(3).add_(1.0)
    c = json.loads(path.read_text())
    fn_op = {(fn, op): n for fn, op, n in c["by_function_op"]}
    assert fn_op[("fp8/quantize.py:blockwise_scale_from_amax", "aten.div.Tensor")] == 2
    assert fn_op[("-", "aten.add_.Tensor")] == 1
    assert c["total"] == sum(c["by_function"].values()) == sum(c["by_op"].values()) == sum(fn_op.values())
    assert timing.profile_file("d", 3, "ops") == "d/rank3.ops.json"
    assert timing.profile_file("d", 3, "cpu") == "d/rank3.prof"


def test_start_parts_split_the_launch_to_entry_time():
    marks = {"entry": 11.0, "device": 11.5, "group": 13.0}
    assert timing.start_parts(10.0, marks, 13.25) == {"process": 1.0, "device": 0.5, "process_group": 1.5,
                                                        "handoff": 0.25}
    assert timing.start_parts(10.0, {}, 13.25) is None  # torchrun: the launcher's marks are not there
    r = {"timing": {0: {"test": {"forward": 1.0}}}, "start_parts": timing.start_parts(10.0, marks, 13.25)}
    t = merge_timing([r], start_s=3.25, elapsed_s=5.0)
    assert t["start_parts"]["device"] == 0.5
    assert "rank start-up 3.25 s (process 1.0, device 0.5, process group 1.5, handoff 0.25)" in "\n".join(
        timing_md("s", t, 5.0))


def test_a_mark_before_the_account_opens_charges_nothing():
    c = PhaseClock(torch.device("cpu"))
    c.stack_reached(0, "test", "forward")  # no start() yet: nothing to measure from
    assert c.to_dict() == {}


def test_the_garbage_collectors_time_is_its_start_to_stop_spans(monkeypatch):
    """Only the time between a collection's start and its stop counts; a stop without its start
    (the timer installed mid-collection) adds nothing, and a forked rank starts from zero."""
    now = [0.0]
    monkeypatch.setattr(timing.time, "perf_counter", lambda: now[0])
    monkeypatch.setitem(timing._GC, "s", 5.0)
    monkeypatch.setitem(timing._GC, "started", 123.0)
    timing.time_garbage_collection()
    try:
        assert timing._GC == {"s": 0.0, "started": None}
        for phase, t in (("start", 1.0), ("stop", 3.0), ("stop", 4.0), ("start", 10.0), ("stop", 10.5)):
            now[0] = t
            timing._gc_timer(phase, {})
        assert timing._GC["s"] == 2.5
    finally:
        import gc

        gc.callbacks.remove(timing._gc_timer)


def test_cpu_profiles_count_cpu_time_and_wall_profiles_count_waits_too(tmp_path):
    import pstats
    import time

    def total(mode):
        path = tmp_path / mode / "rank0.prof"
        with timing.profiled(str(path), mode):
            time.sleep(0.3)
        return pstats.Stats(str(path)).total_tt

    assert total("cpu") < 0.1 and total("wall") >= 0.3
    ran = []
    with timing.profiled(None):  # no path: no profile, the block still runs
        ran.append(True)
    assert ran == [True]


def test_summary_says_how_the_ranks_started_and_ran():
    def run(**rank):
        return {"timing": {-1: {"test": {"init": 0.0}}, 0: {"test": {"forward": 1.0}},
                           1: {"test": {"forward": 1.0}}}, **rank}

    t = merge_timing([run(start_method="fork", cpus=[0], thread_policies=["batch"]),
                      run(start_method="fork", cpus=[1], thread_policies=["batch"])], start_s=None)
    assert t["bound_cpus"] == [0, 1] and t["thread_policies"] == ["batch"]
    md = "\n".join(timing_md("s", t, 3.0))
    assert ("rank start-up not measured, ranks started by fork, each on one CPU (0, 1), every thread "
            "under SCHED_BATCH; both stacks built in 0.0 s; 2 steps") in md
    assert "the rest" not in md  # not measured: no elapsed time to split
    assert "| forward | 2.000 | 0.000 | 1.0000 | 0.0000 |" in md  # a phase only one side reported
    assert "| backward |" not in md  # a phase neither side reported has no row
    # a rank free to move (two CPUs) means the ranks were not each on one CPU
    t = merge_timing([run(cpus=[0]), run(cpus=[0, 1], thread_policies=["other"])], start_s=1.0, elapsed_s=4.0)
    assert t["bound_cpus"] is None and t["start_method"] is None
    md = "\n".join(timing_md("s", t, 4.0))
    assert "each on one CPU" not in md and "SCHED_BATCH" not in md and "ranks started by" not in md
    assert "; the rest (construction checks, teardown, the parent's merge) 1.0 s;" in md
