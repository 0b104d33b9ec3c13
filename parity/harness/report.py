"""Merging per-rank results into a scenario verdict, and writing report.json / summary.md / JUnit."""

from __future__ import annotations

import json
import math
import os
import struct
import xml.etree.ElementTree as ET

from parity import atomic
from parity.vocab import STEP_PHASES, Check

PHASE_ORDER = {p: i for i, p in enumerate(("init",) + STEP_PHASES)}
OPTIM_STATS = ("step", "lr", "grad_norm", "grad_norm_b", "num_zeros", "num_zeros_b",
               "clip_coef", "clip_coef_b")
"""Per-step optimizer statistics in report.json (``_b``: the reference side)."""


def merge_ranks(scenario, results: list[dict], elapsed_s: float, start_s: float | None = None) -> dict:
    """One scenario's entry of report.json (``start_s``: launch to the last rank's entry)."""
    from parity.harness.timing import merge_timing

    divs = [d for r in results for d in r["divergences"]]
    checks = [c for r in results for c in r["checks"]]
    failed_checks = [c for c in checks if not c["ok"]]
    compared = sum(r["compared"] for r in results)
    by_phase: dict = {}
    for r in results:
        for ph, n in r["compared_by_phase"].items():
            by_phase[ph] = by_phase.get(ph, 0) + n
    first = None
    if divs:
        d = _in_order(divs)[0]
        tensor = d["path"].split("/", 2)[2].rsplit("/rank", 1)[0]
        first = {"step": d["step"], "phase": d["phase"], "tensor": tensor, "rank": d["rank"],
                 "max_ulp": d.get("max_ulp"), "n_diff": d.get("n_diff")}
        if d.get("reason"):  # compared by digest, or held by one run only: no element counts
            first["reason"] = d["reason"]
        nonfinite_counts = {k: d[k] for k in ("nan_a", "nan_b", "inf_a", "inf_b") if d.get(k)}
        if nonfinite_counts:  # NaN/Inf in the differing tensors (a NaN payload difference, ...)
            first["nonfinite"] = nonfinite_counts
    # Under overlap_grad_reduce grads are reduced while backward runs: no pre-reduce capture.
    overlapped = scenario.overlap or scenario.pair in ("overlap_param_gather", "force_sync")
    missing_phases = [ph for ph in STEP_PHASES if by_phase.get(ph, 0) == 0
                      and not (ph == "grad_local" and overlapped)]
    nonfinite = nonfinite_events(results)
    if nonfinite:
        failed_checks.insert(0, _nonfinite_check(nonfinite))
    status = "pass" if not divs and not failed_checks and not missing_phases else "fail"
    steps = results[0]["steps"] if results else []
    looked = checks_run(checks)
    ran = {Check.family(r["check"]) for r in looked}
    return {
        "name": scenario.name,
        "status": status,
        "steps": len(steps),
        "compared": compared,
        "compared_by_phase": by_phase,
        "missing_phases": missing_phases,
        "first_divergence": first,
        "n_divergences": len(divs),
        "failed_checks": failed_checks[:20],
        "n_failed_checks": len(failed_checks),
        "checks": looked,
        "checks_not_run": [str(c) for c in Check if c not in ran],
        "nonfinite": {"first": nonfinite[0], "count": len(nonfinite), "events": nonfinite[:50]}
        if nonfinite else None,
        "messages": [m for r in results for m in r["messages"]][:30],
        "loss": [{"step": s["step"], "bits": s.get("loss_bits"), "repr": s.get("loss")} for s in steps],
        "optimizer": [{k: s.get(k) for k in OPTIM_STATS} for s in steps],  # optim (#17)
        "buffers": results[0]["buffers"] if results else [],
        "persistent_bytes": results[0]["persistent_bytes"] if results else {},
        "snapshots": [p for r in results for p in r.get("snapshots", [])],
        "hosts": {str(r["rank"]): r["host"] for r in results if r.get("host")},
        # an injected fault missing here never ran its deviation: the run tested nothing of it
        "faults_fired": sorted({f for r in results for f in r.get("faults_fired", ())}),
        "golden": "off",
        "elapsed_s": round(elapsed_s, 2),
        "timing": merge_timing(results, start_s, elapsed_s),
        "memory": _peaks(results),
        "snapshot_io": _snapshot_io(results),
        "scenario": scenario.to_dict(),
        "divergence_table": _div_table(divs),
    }


def checks_run(checks: list[dict]) -> list[dict]:
    """What the checks looked at, per recorded check name over every rank and step: how often it
    was evaluated, on how many ranks, at which steps, how often it failed, and, for a check that
    counts them, how many things it looked at in all (0: every evaluation passed on nothing). A
    check a scenario never evaluates (no clipping, no checkpoint save) is in ``checks_not_run``
    instead: it guarded nothing there."""
    by: dict = {}
    for c in checks:
        row = by.setdefault(c["check"], {"check": c["check"], "evaluated": 0, "failed": 0, "ranks": set(),
                                         "steps": set()})
        row["evaluated"] += 1
        row["failed"] += not c["ok"]
        row["ranks"].add(c["rank"])
        row["steps"].add(c["step"])
        if "examined" in c:
            row["examined"] = row.get("examined", 0) + c["examined"]
    order = {c: i for i, c in enumerate(Check)}
    return [{**r, "ranks": len(r["ranks"]), "steps": [min(r["steps"]), max(r["steps"])]}
            for r in sorted(by.values(), key=lambda r: (order[Check.family(r["check"])], r["check"]))]


def checks_line(e: dict) -> str:
    """One scenario's checks in a line: each family's evaluations (failures in brackets), then the
    checks it never ran."""
    fams: dict = {}
    for r in e["checks"]:
        f = fams.setdefault(str(Check.family(r["check"])), [0, 0])
        f[0] += r["evaluated"]
        f[1] += r["failed"]
    ran = ", ".join(f"{name} {n}" + (f" [{bad} failed]" if bad else "") for name, (n, bad) in fams.items())
    idle = ", ".join(e.get("checks_not_run") or []) or "none"
    vacuous = [r["check"] for r in e["checks"] if r.get("examined") == 0]
    return f"{ran}; not run: {idle}" + (f"; examined nothing: {', '.join(vacuous)}" if vacuous else "")


def _peaks(results: list[dict]) -> dict:
    """The largest peak of each memory kind over the ranks (bytes)."""
    out: dict = {}
    for r in results:
        for k, v in (r.get("memory") or {}).items():
            out[k] = max(out.get(k, 0), v)
    return out


def _snapshot_io(results: list[dict]) -> dict:
    """Snapshot bytes written by all ranks, the slowest writer's seconds, and their ratio."""
    ios = [r["snapshot_io"] for r in results if r.get("snapshot_io")]
    if not ios:
        return {}
    total, slowest = sum(i["bytes"] for i in ios), max(i["write_s"] for i in ios)
    return {"bytes": total, "write_s": slowest,
            "mb_per_s": round(total / 1e6 / slowest, 1) if slowest > 0 else None}


def fmt_divergence(fd: dict) -> str:
    """How a first divergence differs: "max 1 ULP, 1 element differs" (raw FP8 bytes and integer
    tensors have no ULP distance: only the count; a tensor that only one run holds, or runs compared
    by digest, have neither: the divergence's reason)."""
    from parity.harness.compare import fmt_ulp

    if fd["n_diff"] is None:
        return fd.get("reason", "differs")
    n = "1 element differs" if fd["n_diff"] == 1 else f"{fd['n_diff']} elements differ"
    how = n if fd.get("max_ulp") is None else f"max {fmt_ulp(fd['max_ulp'])} ULP, {n}"
    return how + _fmt_nonfinite(fd.get("nonfinite") or {})


def _fmt_nonfinite(counts: dict) -> str:
    """NaN/Inf counts of a differing tensor by side (``_a`` the reference, ``_b`` the side under
    test, as compare_tensors takes them): which side went non-finite is the first thing to know."""
    parts = [f"{word} {counts.get(key + '_b', 0)} under test / {counts.get(key + '_a', 0)} reference"
             for key, word in (("nan", "NaN"), ("inf", "Inf")) if counts.get(key + "_a") or counts.get(key + "_b")]
    return "; " + ", ".join(parts) if parts else ""


def _float32_bits(bits) -> float | None:
    """The float32 value of a '0x........' bit string (as the runner records losses)."""
    if not isinstance(bits, str) or not bits.startswith("0x") or len(bits) != 10:
        return None
    try:
        return struct.unpack(">f", bytes.fromhex(bits[2:]))[0]
    except (ValueError, struct.error):
        return None


def _nonfinite_kind(value) -> str | None:
    if value is None or math.isfinite(value):
        return None
    return "NaN" if math.isnan(value) else ("+Inf" if value > 0 else "-Inf")


_SIDE_ORDER = {"ON": 0, "OFF": 1}


def nonfinite_events(results: list[dict]) -> list[dict]:
    """Every NaN or Inf the ranks saw, earliest first: where (step, phase, tensor, rank, side).

    The loss of both stacks (ON and OFF) comes with every step's record. Per-tensor events come
    from the ranks when they report them: ``result["nonfinite"]``, a list of dicts with step,
    phase, tensor and, optionally, side, kind, nan and inf counts."""
    events = []
    for r in results:
        for s in r.get("steps", []):
            for side, key in (("ON", "loss_bits"), ("OFF", "loss_b_bits")):
                kind = _nonfinite_kind(_float32_bits(s.get(key)))
                if kind:
                    events.append({"step": s["step"], "phase": "forward", "tensor": "loss", "rank": r["rank"],
                                   "side": side, "kind": kind, "bits": s.get(key)})
        for ev in r.get("nonfinite") or []:
            events.append({"rank": r["rank"], **ev})
    events.sort(key=lambda e: (e.get("step", 0), PHASE_ORDER.get(e.get("phase"), 99), e.get("rank", 0),
                               _SIDE_ORDER.get(e.get("side"), 2), str(e.get("tensor", ""))))
    return events


def _nonfinite_check(events: list[dict]) -> dict:
    """A failed check: NaN or Inf in training. ON and OFF agreeing bit for bit on NaN proves nothing."""
    first = events[0]
    kind = first.get("kind") or ", ".join(f"{n} {k}" for k, n in (("NaN", first.get("nan")), ("Inf", first.get("inf")))
                                          if n) or "NaN/Inf"
    sides = sorted({e["side"] for e in events if e.get("side") and
                    (e.get("step"), e.get("phase"), e.get("tensor"), e.get("rank")) ==
                    (first.get("step"), first.get("phase"), first.get("tensor"), first.get("rank"))},
                   key=lambda side: _SIDE_ORDER.get(side, 2))
    where = f"step {first.get('step')}/{first.get('phase')}/{first.get('tensor')}/rank {first.get('rank')}"
    return {"step": first.get("step"), "check": str(Check.FINITE), "ok": False, "rank": first.get("rank"),
            "message": f"non-finite value in training: first at {where}: {kind}"
                       f"{' in ' + ' and '.join(sides) if sides else ''}; {len(events)} occurrence(s) in all "
                       f"(parity between NaN/Inf values proves nothing)"}


def _in_order(divs) -> list[dict]:
    """Divergences by step, phase (dataflow order) and rank; within those, in the order the rank
    compared them, which is the order the stack produced the tensors (the first param a forward
    used stale comes first), as the golden comparison and triage order them too."""
    return sorted(divs, key=lambda d: (d["step"], PHASE_ORDER.get(d["phase"], 99), d["rank"]))


def _div_table(divs) -> list[dict]:
    keep = ("step", "phase", "rank", "path", "n_diff", "numel", "max_ulp", "ulp_hist")
    extra = ("against", "reason")  # divergences across launches: against what, and why without counts
    return [{k: d.get(k) for k in keep} | {k: d[k] for k in extra if k in d} for d in _in_order(divs)][:5000]


def error_entry(scenario, message: str, elapsed_s: float, failure: dict | None = None) -> dict:
    return {"name": scenario.name, "status": "error", "steps": 0, "compared": 0,
            "first_divergence": None, "golden": "off", "error": message, "failure": failure or {},
            "elapsed_s": round(elapsed_s, 2), "scenario": scenario.to_dict()}


def atomic_write_text(path: str, text: str) -> None:
    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    atomic.replace_file(path, write)


def write_reports(out_dir: str, entries: list[dict], meta: dict, junit: str | None = None) -> None:
    """report.json, summary.md, JUnit (when asked) and, when there are snapshots, their index.

    One process writes these for the whole run (under torchrun: global rank 0); every rank
    writes its own snapshot files."""
    report = {"parity_version": meta.get("version"), "platform": meta.get("platform"),
              "argv": meta.get("argv"), "scenarios": entries,
              "status": overall_status(entries)}
    atomic_write_text(os.path.join(out_dir, "report.json"), json.dumps(report, indent=1, default=str))
    atomic_write_text(os.path.join(out_dir, "summary.md"), summary_md(entries))
    if junit:
        atomic_write_text(junit, junit_xml(entries))
    index = snapshot_index(out_dir, entries)
    if index["scenarios"]:
        atomic_write_text(os.path.join(out_dir, "snapshots", "index.json"), json.dumps(index, indent=1))


def snapshot_index(out_dir: str, entries: list[dict]) -> dict:
    """Every snapshot file of the run: per scenario its step, rank, file (relative to ``out_dir``)
    and the host of the rank that wrote it (with an OUT local to each node, the file is there)."""
    from parity.harness.snapshot import parse_snapshot_filename

    scenarios = {}
    for e in entries:
        files = []
        for path in e.get("snapshots") or []:
            parsed = parse_snapshot_filename(os.path.basename(path))
            if parsed is None:
                continue
            step, rank = parsed
            files.append({"step": step, "rank": rank, "file": os.path.relpath(path, out_dir),
                          "host": (e.get("hosts") or {}).get(str(rank))})
        if files:
            scenarios[e["name"]] = sorted(files, key=lambda f: (f["step"], f["rank"]))
    return {"scenarios": scenarios}


def overall_status(entries) -> str:
    if any(e["status"] == "error" for e in entries):
        return "error"
    if any(_failed(e) for e in entries):
        return "fail"
    return "pass"


def summary_md(entries) -> str:
    lines = ["# parity", "", "| scenario | status | steps | compared | golden | first divergence |",
             "|---|---|---|---|---|---|"]
    for e in entries:
        fd = e.get("first_divergence")
        fds = (f"step {fd['step']} / {fd['phase']} / {fd['tensor']} / rank {fd['rank']} "
               f"({fmt_divergence(fd)})") if fd else "-"
        if e["status"] == "error":
            fds = e.get("error", "")
        elif not fd and e.get("n_failed_checks"):
            fds = e["failed_checks"][0]["message"]
        elif not fd and e.get("missing_phases"):
            fds = f"phases never compared: {', '.join(e['missing_phases'])}"
        golden = e.get("golden", "off")
        if golden not in ("off", "pass") and e.get("golden_detail"):
            golden += f": {e['golden_detail']['summary']}"
        lines.append(f"| {e['name']} | {e['status']} | {e['steps']} | {e['compared']} | "
                     f"{golden} | {fds} |")
    checked = [e for e in entries if e.get("checks")]
    if checked:
        lines += ["", "## What the checks looked at", "",
                  "Evaluations of each check over all ranks and steps (failed ones in brackets); a check "
                  "not run guarded nothing in that scenario.", ""]
        for e in checked:
            lines += [f"- {e['name']}: " + checks_line(e)]
    timed = [e for e in entries if e.get("timing")]
    if timed:
        from parity.harness.timing import timing_md

        lines += ["", "## Where the time went", "",
                  "Seconds, mean over ranks. A stack phase is the time from its previous report to this "
                  "one; harness parts are parity's own work (see parity/harness/timing.py).", ""]
        for e in timed:
            lines += timing_md(e["name"], e["timing"], e.get("elapsed_s"))
            mem, io = e.get("memory") or {}, e.get("snapshot_io") or {}
            if mem:
                lines.append("peak memory (largest rank): " + ", ".join(
                    f"{k.replace('_bytes', '').replace('_', ' ')} {v / 2**20:.0f} MiB" for k, v in mem.items()))
            if io.get("bytes"):
                lines.append(f"snapshots: {io['bytes'] / 1e6:.1f} MB written in {io['write_s']} s by the "
                             f"slowest writer ({io['mb_per_s']} MB/s)")
            if mem or io.get("bytes"):
                lines.append("")
    return "\n".join(lines) + "\n"


def _failed(e) -> bool:
    """A run that diverged or failed a check, or one that passed in itself but not its golden."""
    return e["status"] == "fail" or e.get("golden") == "fail"


def junit_xml(entries) -> str:
    suite = ET.Element("testsuite", name="parity", tests=str(len(entries)),
                       failures=str(sum(_failed(e) for e in entries)),
                       errors=str(sum(e["status"] == "error" for e in entries)))
    for e in entries:
        case = ET.SubElement(suite, "testcase", classname="parity", name=e["name"],
                             time=str(e.get("elapsed_s", 0)))
        if _failed(e):
            fd = e.get("first_divergence")
            ET.SubElement(case, "failure", message=json.dumps(fd) if fd else "check failed").text = \
                "\n".join(e.get("messages", []) + [c["message"] for c in e.get("failed_checks", [])])
        elif e["status"] == "error":
            ET.SubElement(case, "error", message=e.get("error", ""))
    return ET.tostring(suite, encoding="unicode")
