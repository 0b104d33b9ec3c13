"""What the checks looked at: report.json's per-check counts and summary.md's line."""

from parity.harness.report import checks_line, checks_run
from parity.vocab import Check


def _rec(step, name, ok, rank):
    return {"step": step, "check": name, "ok": ok, "rank": rank, "message": "" if ok else "bad"}


def test_counts_per_check_and_family_and_the_checks_never_run():
    recs = [_rec(s, f"{Check.KEYS}/{ph}", True, r) for s in (0, 1) for ph in ("forward", "optimizer") for r in (0, 1)]
    recs += [_rec(0, Check.PARAMS_HOLD_MASTERS, True, 0), _rec(1, Check.PARAMS_HOLD_MASTERS, False, 1)]
    rows = checks_run(recs)
    assert [r["check"] for r in rows] == ["keys/forward", "keys/optimizer", "params-hold-masters"]
    assert rows[0] == {"check": "keys/forward", "evaluated": 4, "failed": 0, "ranks": 2, "steps": [0, 1]}
    assert rows[2]["failed"] == 1 and rows[2]["ranks"] == 2
    not_run = [str(c) for c in Check if c not in (Check.KEYS, Check.PARAMS_HOLD_MASTERS)]
    line = checks_line({"checks": rows, "checks_not_run": not_run})
    assert line.startswith("keys 8, params-hold-masters 2 [1 failed]; not run: nonempty, reported,")
    assert Check.family("replicas/expert-dp") is Check.REPLICAS
