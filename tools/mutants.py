"""How much of the stack the gate guards: small edits of the stack's source (mutants), each run
through a scenario set, counted as killed (the run fails, errors or hangs) or survived (it passes).

The fault catalogue shows that every catalogued fault is caught; it cannot show what nobody
catalogued. A mutant is an uncatalogued fault made blindly: one statement of the stack replaced by
``pass``, one ``if`` condition negated, or one comparison operator moved to its neighbour
(``<`` <-> ``<=``, ``>`` <-> ``>=``, ``==`` <-> ``!=``, ``is`` <-> ``is not``, ``in`` <-> ``not in``).
Fault branches (an ``if`` that tests a ``Fault``) and their bodies are left alone: they are the
catalogue's deviations, not the stack's behaviour. A mutant that passes is either on a line the
set never runs ("unreached": found by one traced run of the set, unmutated, in every process), or
on a line it runs ("survived"): an edit that changes no behaviour (an equivalent mutant: a perf
shortcut, a value nothing reads) or a behaviour the set runs and no check sees, a blind spot. The
survivors are listed for a person to tell which.

Each mutant runs in a copy of ``parity/`` and ``scenarios/`` (the shipped goldens are read in
place), as ``python -m parity run --set SET --fail-fast --snapshot none`` (or the scenarios named)
with that copy first on the path. Prints one line per mutant and the survivors; asserts nothing. Exit 0; 1 when the set does not pass
unmutated; 2 on bad usage.

``--selftest`` turns the tool on the harness's own checks: it mutates the harness (by default the
runner, where the in-run checks live, and the comparison) and judges each mutant by
``parity selftest`` instead: killed where some catalogued fault goes uncaught or a clean run
fails, survived where the whole catalogue is still caught. A survivor on a line the selftest runs
is a piece of a check that no fault needs: an edit that changes nothing, or a part of a check
that the catalogue never proves able to fail. With ``--selftest`` no mutant is counted unreached:
the selftest's ranks start from a fork server, which the line tracer does not follow, so a traced
run would miss the lines only ranks run (every survivor is listed for reading instead).

``--pytest TEST...`` judges each mutant by the tests named instead (pytest node ids or files, run
with ``-x`` in the copy, which then holds ``tests/`` and ``goldens/`` too): the judge for a module whose checks are
its own tests, such as the comparison's bit rules (``tests/unit/test_compare.py``) or the golden
records' files (``tests/integration/test_golden.py``), which the selftest never reads. As under
``--selftest``, no mutant is counted unreached.

    python tools/mutants.py [--set quick | --scenarios NAME...] [--sample 60] [--seed 0] [--files F...]
    python tools/mutants.py --selftest [FAULT...] [--sample 20] [--files F...]
    python tools/mutants.py --pytest TEST... --files F... [--sample 20]
    python tools/mutants.py --list            # the mutants, without running them

``--jobs N`` judges N mutants at a time, each in its own copy of the tree (for a host with cores
to spare: a judge's own parallelism, such as ``PYTEST_ADDOPTS="-n 8"``, multiplies with it).
"""

from __future__ import annotations

import argparse
import ast
import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from queue import Queue

HERE = Path(__file__).resolve().parents[1]
DEFAULT_FILES = [
    "parity/ddp/buffers.py", "parity/ddp/ddp.py", "parity/ddp/layout.py", "parity/ddp/param_sync.py",
    "parity/optim/layerwise.py", "parity/optim/distopt.py", "parity/optim/mixed_precision.py",
    "parity/optim/clip.py", "parity/optim/checkpoint.py", "parity/optim/stack.py", "parity/optim/muon.py",
    "parity/optim/adam.py", "parity/model/fp8_linear.py", "parity/model/moe.py",
]
"""The stack's modules that the feature (FP8 param gather on the compact layout) runs through."""
HARNESS_FILES = ["parity/harness/runner.py", "parity/harness/compare.py"]
"""The harness's in-run checks and its bitwise comparison: what ``--selftest`` mutates by default."""

SWAP = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
        ast.NotEq: ast.Eq, ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In}
OP_TEXT = {ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=", ast.Eq: "==", ast.NotEq: "!=",
           ast.Is: "is", ast.IsNot: "is not", ast.In: "in", ast.NotIn: "not in"}


@dataclass(frozen=True)
class Mutant:
    file: str
    line: int
    kind: str
    """``delete`` (the statement becomes ``pass``), ``negate`` (``if not (...)``) or ``compare``."""
    before: str
    after: str
    start: tuple[int, int]
    end: tuple[int, int]
    """Source span (line, column; lines from 1) that ``after`` replaces."""

    def label(self) -> str:
        return f"{self.file}:{self.line} {self.kind}: {self.before.strip()!r} -> {self.after.strip()!r}"


def _segment(lines: list[str], start, end) -> str:
    (l0, c0), (l1, c1) = start, end
    if l0 == l1:
        return lines[l0 - 1][c0:c1]
    return "\n".join([lines[l0 - 1][c0:]] + lines[l0:l1 - 1] + [lines[l1 - 1][:c1]])


def _mentions_fault(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Name) and n.id in ("Fault", "faults") or
               isinstance(n, ast.Attribute) and n.attr == "faults" for n in ast.walk(node))


def _fault_only(test: ast.AST) -> bool:
    """Whether a branch on ``test`` runs only when a fault is injected (``x or FAULT`` runs without)."""
    if isinstance(test, ast.BoolOp):
        parts = [_fault_only(v) for v in test.values]
        return all(parts) if isinstance(test.op, ast.Or) else any(parts)
    return _mentions_fault(test)


def _is_docstring(stmt: ast.stmt) -> bool:
    return isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant) and isinstance(stmt.value.value, str)


def mutants_of(rel: str) -> list[Mutant]:
    """Every mutant of one file, in source order."""
    src = (HERE / rel).read_text()
    lines = src.splitlines()
    tree = ast.parse(src)
    out: list[Mutant] = []
    skip: set[int] = set()  # ids of the nodes of fault branches
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and _mentions_fault(node.test):
            skip.add(id(node))  # its test: the catalogue's switch
            switches = [node.test] if _fault_only(node.test) else \
                [v for v in getattr(node.test, "values", ()) if _fault_only(v)]  # `x or FAULT`: x is the stack's
            skip.update(id(n) for t in switches for n in ast.walk(t))
            if _fault_only(node.test):  # a body only a fault runs; its else is the stack's way
                skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if id(node) in skip:
                continue
            span = ((getattr(node, "lineno", 0), getattr(node, "col_offset", 0)),
                    (getattr(node, "end_lineno", 0), getattr(node, "end_col_offset", 0)))
            if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr)) and not _is_docstring(node):
                if isinstance(node, ast.AnnAssign) and node.value is None:
                    continue
                out.append(Mutant(rel, node.lineno, "delete", _segment(lines, *span), "pass", *span))
            elif isinstance(node, ast.If):
                t = node.test
                tspan = ((t.lineno, t.col_offset), (t.end_lineno, t.end_col_offset))
                text = _segment(lines, *tspan)
                out.append(Mutant(rel, t.lineno, "negate", text, f"not ({text})", *tspan))
            if isinstance(node, ast.Compare) and type(node.ops[0]) in SWAP and not _mentions_fault(node):
                left, right = node.left, node.comparators[0]
                gap = ((left.end_lineno, left.end_col_offset), (right.lineno, right.col_offset))
                op = _segment(lines, *gap)
                new = op.replace(OP_TEXT[type(node.ops[0])], OP_TEXT[SWAP[type(node.ops[0])]], 1)
                if new != op:
                    out.append(Mutant(rel, node.lineno, "compare", op, new, *gap))
    return sorted(set(out), key=lambda m: (m.file, m.start, m.kind))


def apply(src: str, m: Mutant) -> str:
    """``src`` with ``m``'s span replaced. The line count stays (a deleted multi-line statement
    leaves blank lines behind), so a traceback's line numbers still point into the source."""
    lines = src.splitlines(keepends=True)
    (l0, c0), (l1, c1) = m.start, m.end
    head = "".join(lines[: l0 - 1]) + lines[l0 - 1][:c0]
    tail = lines[l1 - 1][c1:] + "".join(lines[l1:])
    filler = "\n" * (l1 - l0) if m.kind == "delete" else ""
    return head + m.after + filler + tail


# Runs `python -m parity ARGS` with a line tracer on the mutated files, inherited by the ranks the
# command forks: each process appends every (file, line) it runs the first time to the file named
# by PARITY_MUTANTS_LINES, written at once (a rank may end in os._exit, which skips atexit).
_TRACED_RUN = """
import os, runpy, sys, threading
files = set(os.environ["PARITY_MUTANTS_FILES"].split(os.pathsep))
fd = os.open(os.environ["PARITY_MUTANTS_LINES"], os.O_WRONLY | os.O_APPEND | os.O_CREAT)
seen = set()
def local(frame, event, arg):
    if event == "line":
        key = (frame.f_code.co_filename, frame.f_lineno)
        if key not in seen:
            seen.add(key)
            os.write(fd, ("%s:%d\\n" % key).encode())
    return local
def call(frame, event, arg):
    return local if frame.f_code.co_filename in files else None
sys.settrace(call)
threading.settrace(call)
sys.argv = ["parity"] + sys.argv[1:]
runpy.run_module("parity", run_name="__main__", alter_sys=True)
"""


def _command(target: list[str], out: str, traced: bool = False) -> list[str]:
    """``parity`` arguments of one judging run: ``target`` is ``parity run``'s scenarios, or
    ``selftest`` and its faults. A traced run (the line tracer slows every rank several times)
    keeps the collectives' default timeout and skips the golden comparison."""
    if target[0] == "selftest":
        return [*target, "--out", out]
    if traced:
        return ["run", *target, "--quiet", "--snapshot", "none", "--golden", "off", "--out", out]
    return ["run", *target, "--fail-fast", "--quiet", "--snapshot", "none", "--timeout", "30", "--out", out]


def _argv(target: list[str], out: str) -> list[str]:
    """The interpreter's arguments of one judging run: the named tests (``pytest`` and its test
    ids), stopping at the first failure, or ``python -m parity`` with :func:`_command`'s arguments."""
    if target[0] == "pytest":
        return ["-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *target[1:]]
    return ["-m", "parity", *_command(target, out)]


def reached_lines(tree: Path, files: list[str], target: list[str], timeout: float) -> set[tuple[str, int]]:
    """(repo-relative file, line) of every line of ``files`` that the judging run of ``target``
    (see :func:`_command`) executes in any process, unmutated."""
    lines_file = Path(tempfile.mkdtemp(prefix="mutants-lines-")) / "lines"
    out = tempfile.mkdtemp(prefix="mutants-cover-")
    env = {**os.environ, "PYTHONPATH": str(tree), "PARITY_GOLDENS": str(HERE / "goldens"),
           "PARITY_MUTANTS_FILES": os.pathsep.join(str(tree / f) for f in files),
           "PARITY_MUTANTS_LINES": str(lines_file)}
    try:
        subprocess.run([sys.executable, "-c", _TRACED_RUN, *_command(target, out, traced=True)], cwd=tree, env=env,
                       capture_output=True, timeout=timeout * 4)
        text = lines_file.read_text() if lines_file.is_file() else ""
    finally:
        shutil.rmtree(lines_file.parent, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    reached = set()
    for row in text.splitlines():
        path, _, line = row.rpartition(":")
        reached.add((str(Path(path).relative_to(tree)), int(line)))
    return reached


def run_one(tree: Path, m: Mutant | None, target: list[str], timeout: float) -> tuple[str, int | None, float, str]:
    """(outcome, exit code, seconds, last line of output) of the judging run of ``target`` with
    ``m`` applied (None: the tree as it is)."""
    path = tree / m.file if m else None
    original = path.read_text() if path else None
    if path:
        mutated = apply(original, m)
        try:
            ast.parse(mutated)
        except SyntaxError:
            return "invalid", None, 0.0, "the edit does not parse"
        path.write_text(mutated)
    out = tempfile.mkdtemp(prefix="mutant-")
    env = {**os.environ, "PYTHONPATH": str(tree), "PARITY_GOLDENS": str(HERE / "goldens")}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([sys.executable, *_argv(target, out)],
                           cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
        rc, text = p.returncode, (p.stdout + p.stderr).strip()
        outcome = "survived" if rc == 0 else "killed"
    except subprocess.TimeoutExpired:
        rc, text, outcome = None, "timed out", "killed"
    finally:
        if path:
            path.write_text(original)
        shutil.rmtree(out, ignore_errors=True)
    last = text.splitlines()[-1] if text else ""
    return outcome, rc, time.perf_counter() - t0, last


def _copy_tree(with_tests: bool) -> Path:
    """A copy of the sources a judging run reads, in a fresh temporary folder: ``parity/`` and
    ``scenarios/``, and for a pytest judge ``tests/``, ``goldens/`` and pytest's configuration
    (the tests read the goldens from the tree they run in: they unset $PARITY_GOLDENS)."""
    tree = Path(tempfile.mkdtemp(prefix="mutants-tree-"))
    for d in ("parity", "scenarios", *(("tests", "goldens") if with_tests else ())):
        shutil.copytree(HERE / d, tree / d, ignore=shutil.ignore_patterns("__pycache__"))
    if with_tests:
        shutil.copy(HERE / "pyproject.toml", tree)  # pytest's markers and options
    return tree


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", nargs="+", default=None,
                    help="modules to mutate (repo-relative; default: the stack's, with --selftest the harness's)")
    ap.add_argument("--selftest", nargs="*", default=None, metavar="FAULT",
                    help="judge each mutant by `parity selftest` (these faults; none named: all) instead of a run")
    ap.add_argument("--pytest", nargs="+", default=None, metavar="TEST",
                    help="judge each mutant by these tests (pytest node ids or files) instead of a run")
    ap.add_argument("--set", default="quick", help="scenario set each mutant runs (scenarios/SET.toml)")
    ap.add_argument("--scenarios", nargs="+", default=(), metavar="NAME",
                    help="run these shipped scenarios instead of a set")
    ap.add_argument("--sample", type=int, default=0, help="run this many mutants, drawn at random (0: all)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", default=(), metavar="FILE:LINE", help="run only the mutants at these lines")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds a mutant's run may take")
    ap.add_argument("--jobs", type=int, default=1, help="mutants judged at once, each in its own tree")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    a = ap.parse_args(argv)
    if a.files is None and a.pytest is not None:
        print("mutants: --pytest needs --files: the modules its tests judge", file=sys.stderr)
        return 2
    if a.files is None:
        a.files = DEFAULT_FILES if a.selftest is None else HARNESS_FILES
    for f in a.files:
        if not (HERE / f).is_file():
            print(f"mutants: no file {f}", file=sys.stderr)
            return 2
    if not a.scenarios and not (HERE / "scenarios" / f"{a.set}.toml").is_file():
        print(f"mutants: no scenario set {a.set} (scenarios/{a.set}.toml)", file=sys.stderr)
        return 2
    if a.selftest is not None and a.pytest is not None:
        print("mutants: --selftest and --pytest are two judges: name one", file=sys.stderr)
        return 2
    if a.pytest is not None:
        target, what = ["pytest", *a.pytest], " ".join(["pytest", *a.pytest])
    elif a.selftest is not None:
        target, what = ["selftest", *a.selftest], " ".join(["selftest", *a.selftest])
    else:
        target = list(a.scenarios) if a.scenarios else ["--set", a.set]
        what = " ".join(a.scenarios) if a.scenarios else f"--set {a.set}"
    every = [m for f in a.files for m in mutants_of(f)]
    if a.only:
        every = [m for m in every if f"{m.file}:{m.line}" in set(a.only)]
    chosen = sorted(random.Random(a.seed).sample(every, a.sample), key=lambda m: (m.file, m.start)) \
        if 0 < a.sample < len(every) else every
    if a.list:
        for m in chosen:
            print(m.label())
        print(f"{len(chosen)} of {len(every)} mutants")
        return 0
    if a.jobs < 1:
        print("mutants: --jobs needs at least 1", file=sys.stderr)
        return 2
    trees = [_copy_tree(a.pytest is not None) for _ in range(a.jobs)]
    try:
        tree = trees[0]
        # the copy unmutated first: a mutant counts as killed only where the set passes without it
        outcome, rc, secs, last = run_one(tree, None, target, a.timeout)
        print(f"unmutated: {'passes' if outcome == 'survived' else 'FAILS'} (rc={rc}, {secs:.1f} s)", flush=True)
        if outcome != "survived":
            print(f"mutants: {what} does not pass unmutated: {last}", file=sys.stderr)
            return 1
        reached = None  # the selftest's and the tests' ranks start from a fork server the tracer does not follow
        if target[0] not in ("selftest", "pytest"):
            reached = reached_lines(tree, sorted({m.file for m in chosen}), target, a.timeout)
            print(f"{what} runs {len(reached)} lines of the mutated files", flush=True)
        print(f"{len(chosen)} of {len(every)} mutants of {len(a.files)} files, each on {what}", flush=True)
        free: Queue = Queue()
        for t in trees:
            free.put(t)
        finished, lock = 0, threading.Lock()

        def judge(m: Mutant):
            nonlocal finished
            t = free.get()
            try:
                outcome, rc, secs, last = run_one(t, m, target, a.timeout)
            finally:
                free.put(t)
            if outcome == "survived" and reached is not None and (m.file, m.line) not in reached:
                outcome = "unreached"  # the set never runs the edited line: it cannot see the edit
            with lock:
                finished += 1
                print(f"[{finished}/{len(chosen)}] {outcome:8s} rc={rc} {secs:5.1f} s  {m.label()}", flush=True)
            return m, outcome, rc, secs, last

        with ThreadPoolExecutor(a.jobs) as pool:
            rows = list(pool.map(judge, chosen))
    finally:
        for t in trees:
            shutil.rmtree(t, ignore_errors=True)
    ran = [r for r in rows if r[1] != "invalid"]
    killed = sum(r[1] == "killed" for r in ran)
    unreached = [r for r in ran if r[1] == "unreached"]
    survivors = [r for r in ran if r[1] == "survived"]
    reachable = len(ran) - len(unreached)
    if reached is None:  # no reachability: every mutant counts as judged
        print(f"\nkilled {killed} of {len(ran)} mutants ({100.0 * killed / max(1, len(ran)):.0f}%; {what} "
              "reads no line coverage). Survivors (an equivalent edit, or a blind spot):")
    else:
        print(f"\nkilled {killed} of {len(ran)} mutants; of the {reachable} on lines the set runs, "
              f"{killed} ({100.0 * killed / max(1, reachable):.0f}%). Survivors on lines the set runs "
              "(an equivalent edit, or a blind spot):")
    for m, *_ in survivors:
        print(f"  {m.label()}")
    if reached is None:
        return 0
    print(f"on lines the set never runs: {len(unreached)}")
    for m, *_ in unreached:
        print(f"  {m.label()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
