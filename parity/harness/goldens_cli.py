"""Goldens for scenarios, as the CLI, the pytest plugin and triage use them.

* :func:`prepare`: before anything runs, find each scenario's golden (a damaged, stale or
  old-format golden is an error now, not after a long run; a missing one is noted);
* :func:`check`: after a run, compare its record with the golden, fill the report entry and keep
  the run's record in ``OUT/golden/<scenario>/`` for ``parity triage RUN --against golden``;
* :func:`golden_command`: ``parity golden check|regen|show``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from parity import atomic
from parity.harness import golden
from parity.harness.errors import GoldenError, GoldenMissing
from parity.harness.platform import platform_fingerprint


def default_root() -> Path:
    """``$PARITY_GOLDENS``, else the repository's ``goldens/``."""
    env = os.environ.get("PARITY_GOLDENS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "goldens"


def platform_of(scenario) -> dict[str, str]:
    return platform_fingerprint(scenario.device, "nccl" if scenario.device == "cuda" else "gloo")


def why_not_runnable(scenario) -> str | None:
    """Why this machine cannot run the scenario (None if it can)."""
    if scenario.device != "cuda":
        return None
    import torch

    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if have == 0:
        return "needs CUDA"
    if have < scenario.world:
        return f"needs {scenario.world} GPUs ({have} visible)"
    return None


def prepare(scenarios, root=None, *, allow_other_platform: bool = False) -> dict:
    """``{scenario name: (golden, tier) or GoldenMissing}``; raises the first unusable golden's
    error (damaged, stale, old format: exit 2) before anything runs."""
    root = Path(root) if root else default_root()
    found = {}
    for s in scenarios:
        if why_not_runnable(s):
            continue  # its run reports why
        try:
            found[s.name] = golden.find(root, s, platform_of(s), allow_other_platform=allow_other_platform)
        except GoldenMissing as e:
            found[s.name] = e
    return found


def check(entry: dict, scenario, results: list[dict], found, *, require: bool = False,
          out_dir: str | os.PathLike[str] | None = None) -> golden.Comparison | None:
    """Check a finished run against its golden (``found``: its :func:`prepare` value) and put
    the verdict in the report entry: ``golden`` is pass, fail or missing (fail under
    ``require``), ``golden_detail`` the comparison, ``golden_messages`` what to print."""
    run = golden.record_from_results(scenario, results, platform_of(scenario))
    if isinstance(found, GoldenMissing):
        entry["golden"] = "fail" if require else "missing"
        entry["golden_detail"] = {"status": entry["golden"], "summary": str(found), "platform_id": found.platform_id}
        entry["golden_messages"] = [str(found) + (" (a golden is required)" if require else "")]
        comparison = None
    else:
        comparison = golden.compare(found[0], run, found[1])
        entry["golden"] = comparison.status
        entry["golden_detail"] = comparison.to_dict()
        entry["golden_messages"] = comparison.messages()
    if out_dir is not None:
        if comparison is not None and comparison.status == "pass" and comparison.tier == "exact":
            run.memory, run.tensor_steps = {}, []  # bit-identical: nothing to triage, keep the digests
        golden.write(run, Path(out_dir) / "golden" / scenario.name, overwrite=True)
    return comparison


def golden_command(args, resolve) -> int:
    """``parity golden check|regen|show [SCENARIO...]``: 0 all pass, 1 a golden differs (or a
    regeneration changed one and was not accepted), 2 unusable golden or bad input, 3 a run failed."""
    root = Path(args.goldens) if args.goldens else default_root()
    if args.action == "show":
        return _show(root, args.scenarios)
    from parity.harness.scenario import load_all

    scenarios = resolve(args.scenarios) if args.scenarios else load_all()
    if args.device:
        scenarios = [s for s in scenarios if s.device == args.device]
    runnable = []
    for s in scenarios:
        why = why_not_runnable(s)
        if why:
            print(f"{s.name}: skipped ({why})")
        else:
            runnable.append(_prefix(s, args.steps) if args.action == "check" else s)
    if runnable:
        from parity.harness.forkserver import start_early_for

        start_early_for(runnable)  # its imports run beside the golden checks below
    found = prepare(runnable, root, allow_other_platform=args.action == "check" and args.allow_other_platform) \
        if args.action == "check" else {}
    worst = 0
    for s in runnable:
        worst = max(worst, _check_one(s, found[s.name], args) if args.action == "check" else _regen_one(s, root, args))
    if args.action == "check" and not args.scenarios:
        for u in sorted({r.scenario for r in golden.list_goldens(root)} - {s.name for s in load_all()}):
            print(f"{u}: unused golden (no such scenario); remove {root / u}")
            worst = max(worst, 1)
    if args.action == "regen" and worst == 1 and not args.accept:
        print("goldens were written but not accepted: review the changes above, then rerun with --accept")
    print(f"[parity] golden {args.action}: {len(runnable)} run, {len(scenarios) - len(runnable)} skipped, "
          f"{'all pass' if worst == 0 else 'see above'}")
    return worst


def _prefix(s, steps):
    return s if not steps or steps >= s.steps else s.prefix(steps)  # never past the golden


def _run(s, args):
    """Run ``s`` for its records; (None, None, exit code) when there is nothing to record here
    (a failed run, or a torchrun worker other than global rank 0, which alone holds every rank's
    records and writes goldens)."""
    from parity.harness.driver import run_scenario
    from parity.harness.torchrun_env import is_report_writer
    from parity.harness.runner import RunOptions

    entry, results = run_scenario(s, RunOptions(golden_digests=True, progress=False, snapshot="none"))
    if entry["status"] == "error":
        print(f"{s.name}: ERROR {entry.get('error')}")
        return None, None, 3
    if entry["status"] != "pass":
        print(f"{s.name}: the run itself fails parity ({entry.get('first_divergence') or 'a check failed'})")
        return None, None, 1
    if not is_report_writer():
        return None, None, 0
    return entry, results, 0


def _check_one(s, found, args) -> int:
    entry, results, code = _run(s, args)
    if entry is None:
        return code
    c = check(entry, s, results, found, require=True, out_dir=args.out)
    print(f"{s.name}: golden {entry['golden']}")
    for line in entry["golden_messages"]:
        print(f"  {line}")
    if c is not None and (c.status != "pass" or c.tier == "approx"):  # the drift as markdown, CSV, plots
        from parity.harness import triage

        df = triage.golden_frame(s.name, c, entry, {"platform": c.run.platform, "run": str(args.out)}, str(c.golden.path))
        print(f"  drift report: {triage.write_triage(df, Path(args.out) / 'triage' / s.name)['markdown']}")
    return 0 if entry["golden"] == "pass" else 1


def _regen_one(s, root: Path, args) -> int:
    entry, results, code = _run(s, args)
    if entry is None:
        return code
    new = golden.record_from_results(s, results, platform_of(s), info={"recorded_by": "parity golden regen"})
    dest = golden.golden_dir(root, new)
    old = None
    where = atomic.resolve(dest, golden.MANIFEST_NAME)
    if where is not None:
        try:
            old = golden.load(where)
        except GoldenError as e:
            print(f"{s.name}: replacing an unusable golden ({e})")
    if old is not None:
        c = golden.compare(old, new)
        changed = golden.manifest_changes(golden.manifest(old, old.files), golden.manifest(new, old.files))
        same = c.status == "pass" and not changed
        if same:
            print(f"{s.name}: golden unchanged at {dest}")
            return 0
        if args.only_failing and c.status == "pass":
            print(f"{s.name}: golden pass, skipped (--only-failing)")
            return 0
    golden.write(new, dest, overwrite=True)
    word = "created" if old is None else "changed"
    print(f"{s.name}: golden {word} at {dest}" + ("" if args.accept else " (not accepted)"))
    if old is not None:
        for line in c.messages(8):
            print(f"  {line}")
        if c.status == "pass":  # the records are the same: say what else changed
            print(f"  the manifest differs in: {', '.join(changed)}")
    return 0 if args.accept else 1


def _show(root: Path, names) -> int:
    """The goldens of ``names`` (all when none): 0, or 2 when a name has none under ``root``."""
    refs = [r for r in golden.list_goldens(root) if not names or r.scenario in names]
    if not refs and not names:
        print(f"no goldens under {root}")
    for ref in refs:
        try:
            for line in golden.describe(golden.load(ref.path, verify_files=False)):
                print(line)
        except GoldenError as e:
            print(f"{ref.scenario}/{ref.platform_id}: unusable: {e}")
    missing = [n for n in dict.fromkeys(names) if n not in {r.scenario for r in refs}]
    if missing:
        print(f"parity: no golden under {root} for: {', '.join(missing)}", file=sys.stderr)
        return 2
    return 0
