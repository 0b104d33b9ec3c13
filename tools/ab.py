"""A/B timing of `parity run`: two trees (or one tree under two environments), run alternately.

A 2-core machine's speed drifts by 20-30% within minutes, so two timings taken apart compare
nothing. This runs A and B in alternated pairs (A B, B A, A B, ...) and prints, per run, the
command's wall, the scenario's wall (report.json), the status and golden verdict and the mean rank
CPU; then per side the mean, and B/A with the number of pairs B won. A run that does not pass is
marked: its time is not comparable. Prints numbers; asserts nothing. Exit 0; 1 when a run left no
report to read; 2 on bad usage (an unknown tree or revision, a malformed NAME=VALUE).

    python tools/ab.py --a OLD --b NEW [--pairs 4] -- --recipe blockwise --ep 8
    python tools/ab.py --b-env PARITY_X=1 -- default --steps 8

A and B are each a directory holding a parity tree or a git revision of this repository (checked
out into a temporary worktree, removed at the end); the default is this tree. Each run is
`python -m parity.cli run ARGS --snapshot none --quiet --out TMP` with the tree as its working
directory, so that tree's `parity` package and goldens are the ones used.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _fail(message: str, code: int):
    print(f"ab: {message}", file=sys.stderr)
    raise SystemExit(code)


def _tree(spec: str | None, tmp: Path, label: str, made: list[Path]) -> Path:
    """A parity tree for ``spec``: an existing directory, or a git revision checked out under ``tmp``."""
    if spec is None:
        return HERE
    if Path(spec).is_dir():
        return Path(spec).resolve()
    dst = tmp / f"tree-{label}"
    r = subprocess.run(["git", "-C", str(HERE), "worktree", "add", "--detach", "--quiet", str(dst), spec],
                       capture_output=True, text=True)
    if r.returncode != 0:
        _fail(f"{spec!r} is neither a directory nor a revision of {HERE}: {r.stderr.strip()}", 2)
    made.append(dst)
    return dst


def _env_pairs(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            _fail(f"expected NAME=VALUE, got {item!r}", 2)
        out[key] = value
    return out


def run_once(tree: Path, env: dict[str, str], args: list[str], out: Path,
              entry: tuple[str, ...] = ("-m", "parity.cli")) -> dict:
    """One `parity run ARGS` in ``tree``, started as ``python ENTRY run ...``; its timings."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [sys.executable, *entry, "run", *args, "--snapshot", "none", "--quiet", "--out", str(out)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=tree, env={**os.environ, **env}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    try:
        entries = json.loads((out / "report.json").read_text())["scenarios"]
    except (OSError, ValueError, KeyError) as e:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        _fail(f"no report from {tree} (exit {proc.returncode}): {e}; " + " | ".join(tail), 1)
    cpu = [e.get("timing", {}).get("cpu", {}) for e in entries]
    return {
        "cmd_s": wall,
        "scenario_s": sum(e["elapsed_s"] for e in entries),
        "status": ",".join(e["status"] for e in entries),
        "golden": ",".join(str(e.get("golden")) for e in entries),
        "user_s": sum(c.get("user_s", 0.0) for c in cpu),
        "system_s": sum(c.get("system_s", 0.0) for c in cpu),
        "start_methods": {e.get("timing", {}).get("start_method") for e in entries},
    }


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" in argv:
        i = argv.index("--")
        own, run_args = argv[:i], argv[i + 1:]
    else:
        own, run_args = argv, []
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--a", help="tree A: a directory or a git revision (default: this tree)")
    p.add_argument("--b", help="tree B: a directory or a git revision (default: this tree)")
    p.add_argument("--a-env", nargs="*", default=[], metavar="NAME=VALUE", help="environment added for A's runs")
    p.add_argument("--b-env", nargs="*", default=[], metavar="NAME=VALUE", help="environment added for B's runs")
    p.add_argument("--pairs", type=int, default=4, help="alternated pairs (default 4)")
    ns = p.parse_args(own)
    if ns.pairs < 1:
        p.error("--pairs must be at least 1")
    envs = {"A": _env_pairs(ns.a_env), "B": _env_pairs(ns.b_env)}
    made: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="parity-ab-") as tmp_name:
        tmp = Path(tmp_name)
        try:
            trees = {"A": _tree(ns.a, tmp, "a", made), "B": _tree(ns.b, tmp, "b", made)}
            for side in "AB":
                extra = " ".join(f"{k}={v}" for k, v in envs[side].items())
                print(f"{side}: {trees[side]}{'  ' + extra if extra else ''}")
            print(f"args: parity run {' '.join(run_args)}")
            runs: dict[str, list[dict]] = {"A": [], "B": []}
            for i in range(ns.pairs):
                for side in ("AB" if i % 2 == 0 else "BA"):
                    r = run_once(trees[side], envs[side], run_args, tmp / f"out-{side}")
                    runs[side].append(r)
                    mark = "" if set(r["status"].split(",")) == {"pass"} else "  (not a pass: not comparable)"
                    print(f"pair {i + 1} {side}: command {r['cmd_s']:.2f} s, scenario {r['scenario_s']:.2f} s, "
                          f"{r['status']}, golden {r['golden']}, CPU a rank (mean) user {r['user_s']:.3f} "
                          f"sys {r['system_s']:.3f} s{mark}", flush=True)
        finally:
            for wt in made:
                subprocess.run(["git", "-C", str(HERE), "worktree", "remove", "--force", str(wt)],
                               capture_output=True)
    for key, what in (("cmd_s", "command"), ("scenario_s", "scenario")):
        a = [r[key] for r in runs["A"]]
        b = [r[key] for r in runs["B"]]
        won = sum(y < x for x, y in zip(a, b))
        print(f"{what}: A mean {statistics.mean(a):.2f} s ({min(a):.2f}-{max(a):.2f}), "
              f"B mean {statistics.mean(b):.2f} s ({min(b):.2f}-{max(b):.2f}); "
              f"B/A {statistics.mean(b) / statistics.mean(a):.3f}, B faster in {won} of {ns.pairs} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
