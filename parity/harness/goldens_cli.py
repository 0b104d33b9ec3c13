"""Golden records for scenarios: record from a run, check a run, `parity golden check|regen|show`."""

from __future__ import annotations

from pathlib import Path

from parity.harness.errors import GoldenError
from parity.harness.golden import (
    GoldenRecorder,
    KeyRecord,
    describe_golden,
    list_goldens,
    load_golden,
    regen_golden,
)
from parity.harness.platform import platform_fingerprint, platform_id


def default_root() -> Path:
    return Path(__file__).resolve().parents[2] / "goldens"


def _platform(scenario):
    return platform_fingerprint(scenario.device, "nccl" if scenario.device == "cuda" else "gloo")


def recorder_from_results(scenario, results) -> GoldenRecorder:
    rec = GoldenRecorder(scenario.name, scenario.fingerprint(), _platform(scenario),
                         info={"steps": str(scenario.steps), "world": str(scenario.world)})
    for r in results:
        for step, g in sorted(r["golden"].items()):
            records = {k: KeyRecord(d, tuple(s), h) for k, (d, s, h) in g["records"].items()}
            rec.add_digests(int(step), r["rank"], records, loss=g["loss"])
    return rec


def check_results(scenario, results, root=None, allow_other_platform=False) -> tuple[str, list[str]]:
    """('pass'|'fail'|'missing', messages). Digest-level: the first differing (step, phase, rank)."""
    root = Path(root) if root else default_root()
    fp = _platform(scenario)
    pid = platform_id(fp)
    if allow_other_platform:
        refs = [r for r in list_goldens(root) if r.scenario == scenario.name]
        if not refs:
            return "missing", [f"no golden for {scenario.name} under {root}"]
        pid = pid if any(r.platform_id == pid for r in refs) else refs[0].platform_id
    try:
        g = load_golden(root, scenario.name, pid, platform=fp, scenario_fingerprint=scenario.fingerprint(),
                        allow_other_platform=allow_other_platform)
    except GoldenError as e:
        if "no golden" in str(e).lower() or "missing" in str(e).lower() or "not found" in str(e).lower():
            return "missing", [str(e)]
        raise
    msgs = []
    got = {(int(s), r["rank"]): gg for r in results for s, gg in r["golden"].items()}
    for key in sorted(set(got) | set(g.entries())):
        step, rank = key
        if key not in got:
            msgs.append(f"step {step}/rank {rank}: in the golden, not in this run")
            continue
        if not g.has(step, rank):
            msgs.append(f"step {step}/rank {rank}: not in the golden (unused by it)")
            continue
        want, have = g.record(step, rank), got[key]["records"]
        gl, hl = g.loss(step, rank), got[key]["loss"]
        if gl is not None and hl is not None and gl.hex != hl.hex:
            msgs.append(f"step {step}/forward/loss/rank {rank}: loss {hl.repr} ({hl.hex}) != golden "
                        f"{gl.repr} ({gl.hex})")
        for k in sorted(set(want) | set(have)):
            if k not in have or k not in want:
                msgs.append(f"step {step}/{k}/rank {rank}: {'missing from this run' if k in want else 'not in golden'}")
            elif want[k].sha256 != have[k][2]:
                msgs.append(f"step {step}/{k}/rank {rank}: digest differs from golden")
    return ("fail" if msgs else "pass"), msgs


def check_entry(entry, scenario, results, root=None, allow_other_platform=False) -> None:
    status, msgs = check_results(scenario, results, root, allow_other_platform)
    entry["golden"] = status
    entry["golden_messages"] = msgs[:50]
    if status == "missing":
        entry["golden"] = "fail"


def golden_command(args, resolve) -> int:
    from parity.harness.driver import run_scenario
    from parity.harness.launch import is_report_writer
    from parity.harness.runner import RunOptions

    root = Path(args.goldens) if args.goldens else default_root()
    if args.action == "show":
        refs = list_goldens(root)
        if args.scenarios:
            refs = [r for r in refs if r.scenario in args.scenarios]
        if not refs:
            print(f"no goldens under {root}")
            return 0
        for ref in refs:
            g = load_golden(root, ref.scenario, ref.platform_id, allow_other_platform=True)
            print(f"{ref.scenario} [{ref.platform_id}]")
            for line in describe_golden(g):
                print(f"  {line}")
        return 0
    scenarios = resolve(args.scenarios) if args.scenarios else _all()
    if args.device:
        scenarios = [s for s in scenarios if s.device == args.device]
    worst = 0
    known = {s.name for s in _all()}
    for s in scenarios:
        entry, results = run_scenario(s, RunOptions(golden_digests=True, progress=False, snapshot="none"))
        if entry["status"] == "error":
            print(f"{s.name}: ERROR {entry.get('error')}")
            worst = max(worst, 3)
            continue
        if entry["status"] != "pass":
            print(f"{s.name}: the run itself fails parity ({entry['first_divergence'] or 'check failed'}); "
                  f"not recording it")
            worst = max(worst, 1)
            continue
        if not is_report_writer():
            continue  # under torchrun global rank 0 alone holds every rank's records and writes goldens
        try:
            status, msgs = check_results(s, results, root)
        except GoldenError as e:
            if args.action == "check":
                raise
            status, msgs = "fail", [str(e)]  # stale or damaged: regeneration replaces it
        if args.action == "check":
            print(f"{s.name}: golden {status}" + (f" ({len(msgs)} differences; first: {msgs[0]})" if msgs else ""))
            worst = max(worst, 0 if status == "pass" else 1)
            continue
        if args.only_failing and status == "pass":
            print(f"{s.name}: golden pass, skipped (--only-failing)")
            continue
        res = regen_golden(recorder_from_results(s, results), root, accept=args.accept)
        word = "created" if res.created else ("changed" if res.changed else "unchanged")
        print(f"{s.name}: golden {word} at {res.path} ({res.status})")
        for line in res.summary[:10]:
            print(f"  {line}")
        worst = max(worst, 0 if res.status == "pass" else 1)
    if args.action == "check" and not args.scenarios:
        unused = sorted({r.scenario for r in list_goldens(root)} - known)
        for u in unused:
            print(f"{u}: golden unused (no such scenario)")
        if unused:
            worst = max(worst, 1)
    if args.action == "regen" and worst == 1 and not args.accept:
        print("goldens were written but not accepted: review the changes, then rerun with --accept")
    return worst


def _all():
    from parity.harness.scenario import load_all
    return load_all()
