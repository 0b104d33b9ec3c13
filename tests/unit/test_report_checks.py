"""What the checks looked at: report.json's per-check counts and summary.md's line."""

from parity.harness.report import checks_line, checks_run
from parity.vocab import Check


def _rec(step, name, ok, rank):
    return {"step": step, "check": name, "ok": ok, "rank": rank, "message": "" if ok else "bad"}


def test_counts_per_check_and_family_and_the_checks_never_run():
    recs = [_rec(s, f"{Check.KEYS}/{ph}", True, r) for s in (0, 1) for ph in ("forward", "optimizer") for r in (0, 1)]
    recs += [_rec(0, Check.PARAMS_HOLD_MASTERS, True, 0), _rec(1, Check.PARAMS_HOLD_MASTERS, False, 1)]
    recs += [{**_rec(s, Check.DROPPED_SET, True, r), "examined": 0} for s in (0, 1) for r in (0, 1)]
    rows = checks_run(recs)
    assert [r["check"] for r in rows] == ["keys/forward", "keys/optimizer", "dropped-set", "params-hold-masters"]
    assert rows[2]["examined"] == 0 and "examined" not in rows[3]
    assert rows[0] == {"check": "keys/forward", "evaluated": 4, "failed": 0, "ranks": 2, "steps": [0, 1]}
    assert rows[3]["failed"] == 1 and rows[3]["ranks"] == 2
    not_run = [str(c) for c in Check if c not in (Check.KEYS, Check.DROPPED_SET, Check.PARAMS_HOLD_MASTERS)]
    line = checks_line({"checks": rows, "checks_not_run": not_run})
    assert line.startswith("keys 8, dropped-set 4, params-hold-masters 2 [1 failed]; not run: nonempty, reported,")
    assert line.endswith("; examined nothing: dropped-set")
    assert Check.family("replicas/expert-dp") is Check.REPLICAS


def test_junit_names_every_scenario_and_how_each_ended():
    """CI reads the JUnit file: one testcase per scenario, a failure for a run that diverged or
    failed its golden, an error with the run's message for one that could not run."""
    import xml.etree.ElementTree as ET

    from parity.harness.report import junit_xml

    entries = [
        {"name": "ok", "status": "pass", "elapsed_s": 1.5},
        {"name": "diverged", "status": "fail", "first_divergence": {"step": 2}, "messages": ["step 2/x differs"],
         "failed_checks": []},
        {"name": "golden", "status": "pass", "golden": "fail", "messages": [], "failed_checks": [{"message": "m"}]},
        {"name": "broken", "status": "error", "error": "rank 1 exited"},
    ]
    suite = ET.fromstring(junit_xml(entries))
    # the counts agree with the elements: a golden failure is a failure too
    assert (suite.get("tests"), suite.get("failures"), suite.get("errors")) == ("4", "2", "1")
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert list(cases) == ["ok", "diverged", "golden", "broken"] and cases["ok"].get("time") == "1.5"
    assert [len(cases[n]) for n in cases] == [0, 1, 1, 1]
    assert cases["diverged"].find("failure").get("message") == '{"step": 2}'
    assert cases["diverged"].find("failure").text == "step 2/x differs"
    assert cases["golden"].find("failure").get("message") == "check failed"
    assert cases["broken"].find("error").get("message") == "rank 1 exited"
