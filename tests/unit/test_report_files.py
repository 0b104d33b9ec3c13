"""The run's report files: summary.md's row per scenario, the first divergence report.json
names, the snapshot index, and the atomic write every report file goes through."""

import os

import pytest

from parity.harness import report
from parity.harness.scenario import Scenario
from parity.harness.snapshot import snapshot_filename


def _entry(name, status, **kw):
    return {"name": name, "status": status, "steps": 3, "compared": 10, "first_divergence": None, **kw}


def _rows(md: str) -> dict:
    """summary.md's table: scenario -> its cells after the name."""
    rows = [line.strip("|").split(" | ") for line in md.splitlines() if line.startswith("| ") and " | " in line]
    return {r[0].strip(): [c.strip() for c in r[1:]] for r in rows[1:]}


def test_each_row_says_how_its_scenario_ended():
    detail = {"summary": "2 of 40 digests differ"}
    rows = _rows(report.summary_md([
        _entry("crashed", "error", golden="off", error="rank 1 exited with 17 at step 2"),
        _entry("golden-fail", "pass", golden="fail", golden_detail=detail),
        _entry("golden-pass", "pass", golden="pass", golden_detail=detail),
        _entry("diverged", "fail", golden="off", first_divergence={
            "step": 1, "phase": "optimizer", "tensor": "w.master", "rank": 0, "n_diff": None,
            "reason": "only in the reference run"}),
    ]))
    assert rows["crashed"] == ["error", "3", "10", "off", "rank 1 exited with 17 at step 2"]
    assert rows["golden-fail"][3] == "fail: 2 of 40 digests differ"  # what failed, beside the verdict
    assert rows["golden-pass"][3] == "pass"  # a passing golden needs no detail
    assert rows["diverged"][4] == "step 1 / optimizer / w.master / rank 0 (only in the reference run)"


def _rank(rank, divs):
    return {"rank": rank, "divergences": divs, "checks": [], "compared": 4,
            "compared_by_phase": {"forward": 4}, "steps": [], "messages": [], "buffers": [],
            "persistent_bytes": {}}


def _div(step, rank, reason=None, **kw):
    d = {"step": step, "phase": "forward", "rank": rank, "path": f"step{step}/forward/w/rank{rank}",
         "n_diff": None if reason else 1, "max_ulp": None if reason else 1, **kw}
    return d | ({"reason": reason} if reason else {})


def test_the_first_divergence_carries_a_reason_only_where_it_has_one():
    s = Scenario(name="s", world=2)
    e = report.merge_ranks(s, [_rank(0, [_div(1, 0)]), _rank(1, [_div(0, 1, reason="compared by digest")])], 1.0)
    assert e["first_divergence"] == {"step": 0, "phase": "forward", "tensor": "w", "rank": 1, "max_ulp": None,
                                     "n_diff": None, "reason": "compared by digest"}
    e = report.merge_ranks(s, [_rank(0, [_div(1, 0, nan_a=2)]), _rank(1, [])], 1.0)
    assert e["first_divergence"] == {"step": 1, "phase": "forward", "tensor": "w", "rank": 0, "max_ulp": 1,
                                     "n_diff": 1, "nonfinite": {"nan_a": 2}}


def test_the_snapshot_index_lists_each_scenarios_files_by_step_then_rank(tmp_path):
    snaps = [str(tmp_path / "s" / snapshot_filename(step, rank)) for step, rank in ((1, 0), (0, 1), (0, 0), (1, 1))]
    index = report.snapshot_index(str(tmp_path), [
        {"name": "s", "snapshots": snaps + [str(tmp_path / "s" / "notes.txt")], "hosts": {"1": "node-b"}},
        {"name": "none", "snapshots": []}])
    assert [(f["step"], f["rank"], f["host"]) for f in index["scenarios"]["s"]] == [
        (0, 0, None), (0, 1, "node-b"), (1, 0, None), (1, 1, "node-b")]
    assert index["scenarios"]["s"][0]["file"] == os.path.join("s", snapshot_filename(0, 0))
    assert list(index["scenarios"]) == ["s"]  # a scenario without snapshots has no entry


def test_a_failed_report_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, umask):
    path = tmp_path / "report.json"
    report.atomic_write_text(str(path), "old")
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain write makes it (not mkstemp's 0600)

    class Unprintable:
        def __str__(self):
            raise RuntimeError("cannot format")

    with pytest.raises(TypeError):
        report.atomic_write_text(str(path), Unprintable())  # the write fails part way
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
