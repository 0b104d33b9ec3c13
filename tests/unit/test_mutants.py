"""tools/mutants.py makes the edits it says it makes: each one parses, fault branches are left
alone (their bodies where only a fault runs them, never their switch), and the stack's own path
next to a fault is edited."""

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mutants_tool", ROOT / "tools" / "mutants.py")
mutants = sys.modules["mutants_tool"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutants)

SOURCE = '''\
def step(x, faults, coef):
    y = x + 1
    if Fault.A in faults:
        y = y * 2
    else:
        y = y - 1
    if coef < 1.0 or Fault.B in faults:
        y = y * coef
    return y
'''


@pytest.fixture
def listed(tmp_path, monkeypatch):
    (tmp_path / "m.py").write_text(SOURCE)
    monkeypatch.setattr(mutants, "HERE", tmp_path)
    return mutants.mutants_of("m.py")


def test_fault_branches_are_left_alone_and_the_stack_path_is_edited(listed):
    got = {(m.line, m.kind, m.before.strip(), m.after.strip()) for m in listed}
    assert got == {
        (2, "delete", "y = x + 1", "pass"),
        (6, "delete", "y = y - 1", "pass"),     # the else of a fault-only branch: the stack's way
        (7, "compare", "<", "<="),               # `x or FAULT`: x is the stack's test (the whole
                                                 # test, the fault's switch, is not negated)
        (8, "delete", "y = y * coef", "pass"),   # ... and its body runs without the fault
    }


def test_each_edit_is_applied_where_it_says(listed):
    for m in listed:
        out = mutants.apply(SOURCE, m)
        ast.parse(out)
        assert len(out.splitlines()) == len(SOURCE.splitlines())  # line numbers stay true
        changed = [i + 1 for i, (a, b) in enumerate(zip(SOURCE.splitlines(), out.splitlines())) if a != b]
        assert changed == [m.line], m.label()


def test_the_judging_run_is_a_scenario_run_the_selftest_or_named_tests():
    assert mutants._command(["--set", "quick"], "o") == [
        "run", "--set", "quick", "--fail-fast", "--quiet", "--snapshot", "none", "--timeout", "30", "--out", "o"]
    assert mutants._command(["--set", "quick"], "o", traced=True) == [  # as before the selftest judge
        "run", "--set", "quick", "--quiet", "--snapshot", "none", "--golden", "off", "--out", "o"]
    assert mutants._command(["selftest"], "o") == ["selftest", "--out", "o"]
    assert mutants._command(["selftest", "stale-scale-inv"], "o") == ["selftest", "stale-scale-inv", "--out", "o"]
    assert mutants._argv(["pytest", "tests/unit/test_compare.py"], "o") == [
        "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "tests/unit/test_compare.py"]
    assert mutants._argv(["selftest"], "o") == ["-m", "parity", "selftest", "--out", "o"]


def test_the_stacks_and_the_harness_checks_mutants_parse():
    """Every eighth mutant of each stack module and of the harness's checks (all of them: 10 s;
    the tool marks one that does not parse as invalid anyway)."""
    for f in mutants.DEFAULT_FILES + mutants.HARNESS_FILES:
        src = (ROOT / f).read_text()
        found = mutants.mutants_of(f)
        assert found, f
        for m in found[::8]:
            ast.parse(mutants.apply(src, m))


def test_jobs_below_one_are_refused(capsys):
    assert mutants.main(["--jobs", "0", "--files", "parity/optim/schedule.py"]) == 2
    assert "--jobs needs at least 1" in capsys.readouterr().err
