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
