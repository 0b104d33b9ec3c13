"""Ad hoc: apply each mutant listed in a tools/mutants.py --selftest output (its lines "  parity/...")
in a copy of the tree and run `pytest -q -x` with the arguments that follow the file (the first use,
cpu-compare-survivors-vs-unit-tests.txt, passed -m 'not slow' and four unit test files): which of the
selftest's survivors the tests kill.

    python adhoc_survivors_vs_unit.py MUTANTS_OUTPUT PYTEST_ARGS..."""
import importlib.util, shutil, subprocess, sys, tempfile
from pathlib import Path
ROOT = Path(__file__).resolve().parents[3]
spec = importlib.util.spec_from_file_location("m", ROOT / "tools/mutants.py")
m = importlib.util.module_from_spec(spec); sys.modules["m"] = m; spec.loader.exec_module(m)
labels = [l.strip() for l in open(sys.argv[1]) if l.startswith("  parity/")]
tree = Path(tempfile.mkdtemp(prefix="surv-"))
for d in ("parity", "tests", "scenarios", "goldens"):
    shutil.copytree(ROOT / d, tree / d, ignore=shutil.ignore_patterns("__pycache__"))
shutil.copy(ROOT / "pyproject.toml", tree)
every = {x.label(): x for f in m.HARNESS_FILES + ["parity/harness/golden.py"] for x in m.mutants_of(f)}
for lab in labels:
    mu = every.get(lab)
    if mu is None:
        print("not found:", lab); continue
    p = tree / mu.file; orig = p.read_text(); p.write_text(m.apply(orig, mu))
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *sys.argv[2:]],
                       cwd=tree, env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin", "HOME": "/tmp"}, capture_output=True, text=True)
    p.write_text(orig)
    last = (r.stdout.strip().splitlines() or [""])[-1]
    print(f"{'killed  ' if r.returncode else 'survived'} {lab}   [{last}]", flush=True)
shutil.rmtree(tree)
