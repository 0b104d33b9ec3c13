"""Reliability of the `parity` command: bad input, crashed or hung ranks, atomic goldens,
fail-closed determinism, NaN/Inf.

Every case runs the real command in a process of its own (forked by tests/cli_fork.py's server
after the imports, or a fresh interpreter where the test looks for its processes) and checks three
things: the exit code, that no Python traceback reaches the user, and that the one-line message
names what is wrong.
Runs use a tiny scenario (world 2, 2 steps, a one-layer model) written into tmp_path.
"""

from __future__ import annotations

import json
import re
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import cli_fork
import pytest
from marked_processes import MARKER_VAR, assert_no_orphans, command_env, kill_marked, marked_pids, new_marker

PARITY = [sys.executable, "-m", "parity.cli"]

TINY = """\
name = "tiny"
world = 2
steps = 2
golden_tensor_steps = [0, -1]
model = { num_layers = 1, seq_len = 16, micro_batch = 1 }
"""


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def parity(*args, env=None, timeout=300) -> subprocess.CompletedProcess:
    """The command in a child of tests/cli_fork.py's server; in a fresh interpreter where the test
    looks for its processes by the marker in their environment (a forked child's /proc environ is
    the server's)."""
    env = env if env is not None else command_env()
    return cli_fork.run(args, env=env, timeout=timeout, fresh=MARKER_VAR in env)


def _messages(r) -> list[str]:
    """The error lines parity printed (its own `parity: ...` and argparse's `parity X: error: ...`)."""
    return [line for line in r.stderr.splitlines()
            if line.startswith("parity: ") or (line.startswith("parity") and ": error: " in line)]


def check(r, code: int, *needles: str, usage: bool = False) -> str:
    """Exit code, no traceback, exactly one message line that contains every needle."""
    out = f"--- exit {r.returncode}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n{r.stderr[-3000:]}"
    assert r.returncode == code, out
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, out
    msgs = _messages(r)
    assert len(msgs) == 1, out
    for n in needles:
        assert n in msgs[0], f"{n!r} not in {msgs[0]!r}\n{out}"
    if usage:
        assert "usage: parity" in r.stderr, out
    return msgs[0]


def _rank_pids(marker: str) -> list[int]:
    """The marked processes that are forks of their parent: the ranks (forked by the parity
    process itself, or by its fork server; the server and the resource tracker are started as
    new programs, so their command lines differ from their parent's)."""
    def stat(p):
        try:
            with open(f"/proc/{p}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{p}/cmdline", "rb") as f:
                return ppid, f.read()
        except OSError:
            return None, None

    pids = marked_pids(marker)
    info = {p: stat(p) for p in pids}
    return [p for p, (ppid, cmd) in info.items() if ppid in info and cmd is not None and cmd == info[ppid][1]]


@pytest.fixture
def tiny(tmp_path) -> Path:
    p = tmp_path / "tiny.toml"
    p.write_text(TINY)
    return p


@pytest.fixture
def marker():
    m = new_marker()
    yield m
    kill_marked(m)


def _write(tmp_path: Path, name: str, text: str | bytes) -> Path:
    p = tmp_path / name
    if isinstance(text, bytes):
        p.write_bytes(text)
    else:
        p.write_text(textwrap.dedent(text))
    return p


# ---------------------------------------------------------------------------------------------
# bad scenario files: exit 2, one line naming the file, the key and what is allowed
# ---------------------------------------------------------------------------------------------

BAD_FILES = {
    "syntax": ('name = "x"\nworld = \n', ["TOML syntax error", "line 2"]),
    "unknown-key": ('name = "x"\nworld = 2\nwrold = 2\n', ["key 'wrold'", "unknown key", "allowed keys:", "world"]),
    "wrong-type": ('name = "x"\nworld = "two"\n', ["key 'world'", "expected int", "str 'two'"]),
    "float-steps": ('name = "x"\nsteps = 2.5\n', ["key 'steps'", "expected int"]),
    "fp8-gather-padded": ('name = "x"\nworld = 2\nlayout = "padded"\n',
                          ["key 'layout'", "compact layout", "overlap_param_gather"]),
    "ep-not-dividing-world": ('name = "x"\nworld = 3\nep = 2\nmoe = true\n', ["key 'ep'", "ep=2 must divide world=3"]),
    "mxfp8-dim-not-32": ('name = "x"\nworld = 2\nrecipe = "mxfp8"\nmodel = { hidden = 144, num_heads = 3 }\n',
                         ["key 'recipe'", "divisible by 32", "144"]),
    "unknown-recipe": ('name = "x"\nworld = 2\nrecipe = "fp4"\n', ["key 'recipe'", "'fp4'", "allowed: blockwise, mxfp8"]),
    "world-zero": ('[[scenario]]\nname = "x"\nworld = 0\n', ["key 'world'", "must be >= 1"]),
    "matrix-not-a-table": ("matrix = 3\n", ["invalid scenario file"]),
    "not-utf8": (b'name = "x\xff"\n', ["not a UTF-8 text file"]),
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_bad_scenario_file(tmp_path, case):
    text, needles = BAD_FILES[case]
    path = _write(tmp_path, f"{case}.toml", text)
    out = tmp_path / "out"
    r = parity("run", path, "--out", out)
    check(r, 2, str(path), *needles)
    assert not (out / "report.json").exists()


def test_missing_scenario_file(tmp_path):
    path = tmp_path / "nope.toml"
    check(parity("run", path, "--out", tmp_path / "o"), 2, str(path), "cannot read scenario file")


@pytest.mark.parametrize("args, env", [
    (["BAD_FILE"], {}),
    (["default", "--inject", "no-such-fault"], {}),
    (["default", "--inject", "crash:9:1"], {}),
    (["default"], {"NCCL_ALGO": "Tree"}),
    (["default", "--out", "A_FILE/sub"], {}),
    (["default", "--junit", "NO_DIR/j.xml"], {}),
], ids=["file", "fault", "rank", "determinism-env", "out-dir", "junit-dir"])
def test_bad_input_is_answered_before_torch_loads(tmp_path, args, env):
    """Scenario files, overrides, --inject, the determinism environment and the output paths are
    checked without torch (and without starting the fork server), so a mistake costs a fraction of
    a second, not a torch import."""
    subs = {"BAD_FILE": _write(tmp_path, "bad.toml", b"x = [\n"), "A_FILE": _write(tmp_path, "file", "x"),
            "NO_DIR": tmp_path / "no"}
    argv = [str(a) for a in args]
    for name, path in subs.items():
        argv = [a.replace(name, str(path)) for a in argv]
    if "--out" not in argv:
        argv += ["--out", str(tmp_path / "o")]
    r = cli_fork.run_fresh_noting_torch(["run", *argv], env=command_env(**env))
    assert r.returncode == 2 and "no torch" in r.stdout, r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------
# bad command lines: exit 2 with usage
# ---------------------------------------------------------------------------------------------

BAD_CLI = {
    "unknown-flag": (["run", "--bogus"], ["unrecognized arguments: --bogus"]),
    "bad-int": (["run", "--steps", "two"], ["--steps", "'two'"]),
    "zero-world": (["run", "--world", "0"], ["--world", "positive integer"]),
    "zero-timeout": (["run", "--timeout", "0"], ["--timeout", "positive"]),
    "nan-lr": (["run", "--lr", "nan"], ["--lr", "positive finite"]),
    "bad-recipe": (["run", "--recipe", "fp4"], ["--recipe", "invalid choice", "'fp4'"]),
    "unknown-command": (["frobnicate"], ["invalid choice", "'frobnicate'"]),
    "unknown-scenario": (["run", "no-such-scenario"], ["unknown scenario 'no-such-scenario'", "parity list"]),
    "unknown-inject": (["run", "TINY", "--inject", "bogus"], ["--inject 'bogus'", "unknown fault", "crash:"]),
    "malformed-inject": (["run", "TINY", "--inject", "crash:x:1"], ["crash:RANK:STEP"]),
    "inject-rank-outside-world": (["run", "TINY", "--inject", "crash:5:0"], ["no rank 5", "world 2"]),
    "inject-step-never-reached": (["run", "TINY", "--inject", "hang:0:9"], ["no step 9", "2 steps"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CLI))
def test_bad_command_line(tmp_path, tiny, case):
    args, needles = BAD_CLI[case]
    args = [str(tiny) if a == "TINY" else a for a in args]
    r = parity(*args, "--out", tmp_path / "out") if args[0] == "run" else parity(*args)
    check(r, 2, *needles, usage=True)
    assert "[rank" not in r.stdout + r.stderr  # refused before any rank started
    assert not (tmp_path / "out" / "report.json").exists()


# ---------------------------------------------------------------------------------------------
# unwritable output
# ---------------------------------------------------------------------------------------------


def test_out_dir_under_a_regular_file(tmp_path, tiny):
    f = tmp_path / "file"
    f.write_text("x")
    check(parity("run", tiny, "--out", f / "sub"), 2, "output directory", str(f / "sub"), "Not a directory")


def test_out_dir_in_proc(tiny):
    check(parity("run", tiny, "--out", "/proc/parity-reliability/out"), 2, "output directory", "not writable")


def test_junit_in_missing_directory(tmp_path, tiny):
    check(parity("run", tiny, "--out", tmp_path / "o", "--junit", tmp_path / "no" / "j.xml"), 2,
          "--junit", "does not exist")


def test_goldens_dir_unwritable(tmp_path, tiny):
    f = tmp_path / "file"
    f.write_text("x")
    check(parity("golden", "regen", tiny, "--accept", "--goldens", f / "g"), 2, "goldens directory",
          "Not a directory")


# ---------------------------------------------------------------------------------------------
# determinism environment: refused in the parent, before any rank starts
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("var,value", [("NCCL_ALGO", "Tree"), ("NCCL_NVLS_ENABLE", "1"),
                                       ("CUBLAS_WORKSPACE_CONFIG", ":0:0"), ("CUDA_DEVICE_MAX_CONNECTIONS", "8")])
def test_nondeterministic_env_refused_before_launch(tmp_path, tiny, var, value):
    out = tmp_path / "out"
    t0 = time.monotonic()
    r = parity("run", tiny, "--out", out, env=command_env(**{var: value}))
    msg = check(r, 2, "nondeterministic environment", f"{var}={value!r}", "accepted", "--allow-nondeterministic")
    assert "[rank" not in r.stdout + r.stderr and "[parity] tiny" not in r.stdout, msg  # nothing launched
    assert not out.exists() or not (out / "report.json").exists()
    assert time.monotonic() - t0 < 60


def test_nondeterministic_env_refused_by_golden_regen(tmp_path, tiny):
    r = parity("golden", "regen", tiny, "--accept", "--goldens", tmp_path / "g", env=command_env(NCCL_ALGO="Tree"))
    check(r, 2, "NCCL_ALGO='Tree'")
    assert not (tmp_path / "g" / "tiny").exists()


def test_golden_show_needs_no_deterministic_environment():
    """Only the golden actions that run scenarios are held to the determinism environment: `show`
    reads files, and a CI job that shows goldens in a nondeterministic shell must not be refused."""
    r = parity("golden", "show", "default", env=command_env(NCCL_ALGO="Tree"))
    assert r.returncode == 0 and "nondeterministic" not in r.stderr and "default" in r.stdout, r.stdout + r.stderr


def test_junit_in_an_unwritable_directory(tmp_path, tiny):
    """--junit is written at the end of a run: a directory that takes no files (here /proc, which
    refuses root too) is refused before any rank starts."""
    r = parity("run", tiny, "--out", tmp_path / "o", "--junit", "/proc/self/j.xml")
    check(r, 2, "--junit directory", "/proc/self", "not writable")
    assert "[rank" not in r.stdout + r.stderr


@pytest.mark.slow
def test_allow_nondeterministic_runs_with_a_warning(tmp_path, tiny):
    r = parity("run", tiny, "--out", tmp_path / "o", "--quiet", "--allow-nondeterministic",
               env=command_env(NCCL_ALGO="Tree"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "parity: warning: --allow-nondeterministic: running with NCCL_ALGO='Tree'" in r.stderr


# ---------------------------------------------------------------------------------------------
# crashed and hung ranks: exit 3 in bounded time, no orphans, the failing rank and step reported
# ---------------------------------------------------------------------------------------------


def _fault_run(tmp_path, tiny, marker, inject, timeout_s):
    out = tmp_path / f"run-{marker}" / "out"  # the marker is in the out path too
    t0 = time.time()
    r = parity("run", tiny, "--inject", inject, "--timeout", timeout_s, "--out", out, env=command_env(marker),
               timeout=300)
    t_end = time.time()
    out_all = r.stdout + r.stderr
    assert r.returncode == 3, out_all
    assert "Traceback" not in r.stderr, out_all
    assert_no_orphans(marker, within_s=15.0)
    rep = json.loads((out / "report.json").read_text())
    assert rep["status"] == "error"
    (e,) = rep["scenarios"]
    assert e["status"] == "error", e
    f = e["failure"]
    assert {"rank", "step", "reason"} <= set(f), f
    fault_t = f["heartbeats"][str(f["rank"])]["t"]  # the faulty rank's last heartbeat: the fault
    assert t_end - fault_t < 60, f"run ended {t_end - fault_t:.1f} s after the fault"
    assert fault_t >= t0
    return r, e


@pytest.mark.slow
def test_crashed_rank(tmp_path, tiny, marker):
    # Rank 1 dies mid-step, once its stack under test has stepped the optimizer: the report names
    # the rank, the step and the last phase its heartbeat had (the start-of-step crash is in
    # test_torchrun.py). Step 0: its phases beat too.
    r, e = _fault_run(tmp_path, tiny, marker, "crash:1:0:optimizer", 20)
    f = e["failure"]
    assert (f["rank"], f["step"], f["phase"], f["kind"]) == (1, 0, "optimizer", "crash"), f
    assert "exited with code 17" in f["reason"]
    said = "rank 1 failed at step 0, after optimizer"
    assert said in e["error"] and said in r.stdout


@pytest.mark.slow
def test_hung_rank_is_named_not_its_peer(tmp_path, tiny, marker):
    # Rank 0 hangs mid-step, after its local grads; rank 1 goes on into the grad reduction and times
    # out waiting for it there. The report must name rank 0, and the phase its heartbeat reached.
    r, e = _fault_run(tmp_path, tiny, marker, "hang:0:1:grad_local", 6)
    f = e["failure"]
    assert (f["rank"], f["step"], f["phase"], f["kind"]) == (0, 1, "grad_local", "hang"), f
    assert "hang" in f["reason"] and "rank(s) 1 timed out" in f["reason"], f
    # the hung rank's watcher placed it at the fault's sleep, in the runner
    assert re.search(r"\(hang\) in runner\.py:\d+ _lifecycle: ", f["reason"]), f["reason"]
    assert f["heartbeats"]["1"]["in_collective"] and not f["heartbeats"]["0"]["in_collective"]
    assert "rank 0 failed at step 1, after grad_local" in r.stdout


# ---------------------------------------------------------------------------------------------
# goldens
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def golden(tmp_path_factory):
    """A golden of the tiny scenario, recorded once: (scenario file, goldens root, platform id)."""
    d = tmp_path_factory.mktemp("golden")
    scen = d / "tiny.toml"
    scen.write_text(TINY)
    root = d / "goldens"
    r = parity("golden", "regen", scen, "--accept", "--goldens", root)
    assert r.returncode == 0, r.stdout + r.stderr
    (pid_dir,) = (root / "tiny").iterdir()
    return scen, root, pid_dir.name


def _copy_root(golden, tmp_path) -> tuple[Path, Path]:
    _, root, pid = golden
    dst = tmp_path / "goldens"
    shutil.copytree(root, dst)
    return dst, dst / "tiny" / pid / "manifest.json"


def _tensor_file(manifest: Path) -> Path:
    return sorted(manifest.parent.glob("tensors_step_*.safetensors"))[0]


def _damage(case: str, golden, tmp_path) -> tuple[Path, list[str]]:
    scen, _, pid = golden
    root, manifest = _copy_root(golden, tmp_path)
    if case == "missing":
        shutil.rmtree(root / "tiny")
        return root, ["no golden for", "scenario 'tiny' has none", "parity golden regen tiny"]
    if case == "not-json":
        manifest.write_text(manifest.read_text()[:100])
        return root, ["manifest", "not valid JSON", "regenerate"]
    if case == "malformed":
        m = json.loads(manifest.read_text())
        m["ranks"] = []
        manifest.write_text(json.dumps(m))
        return root, ["malformed", "'ranks'"]
    if case == "other-platform":
        m = json.loads(manifest.read_text())
        m["platform"]["torch"] = "9.9.9"
        manifest.write_text(json.dumps(m))
        return root, ["recorded on another platform", "torch: golden '9.9.9'"]
    if case == "only-other-platform":
        os.rename(manifest.parent, manifest.parent.with_name("cuda-h200-torch2.13.0-cu12.8"))
        return root, ["no golden for", "goldens exist for: cuda-h200-torch2.13.0-cu12.8", "--allow-other-platform"]
    if case == "stale":
        from parity.harness.golden import fingerprint

        m = json.loads(manifest.read_text())
        m["config"] = {**m["config"], "seed": 1}
        m["fingerprint"] = fingerprint(m["config"])
        manifest.write_text(json.dumps(m))
        return root, ["is stale", "changed since it was recorded", "seed: 1 in the golden, 1234 here"]
    if case == "old-format":
        m = json.loads(manifest.read_text())
        m["format_version"] = 1
        manifest.write_text(json.dumps(m))
        return root, ["golden format 1", "regenerate it on its platform"]
    f = _tensor_file(manifest)
    data = f.read_bytes()
    if case == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif case == "corrupt":
        f.write_bytes(data[:-8] + bytes(8))
    else:
        f.unlink()
    return root, {"truncated": [f.name, "truncated"],
                  "corrupt": [f.name, "modified or corrupt"],
                  "file-missing": ["incomplete", f"{f.name} is missing"]}[case]


GOLDEN_DAMAGE = ["missing", "not-json", "malformed", "other-platform", "only-other-platform", "stale",
                 "old-format", "truncated", "corrupt", "file-missing"]


@pytest.mark.slow
@pytest.mark.parametrize("case", GOLDEN_DAMAGE)
def test_golden_check_unusable_golden(golden, tmp_path, case):
    scen = golden[0]
    root, needles = _damage(case, golden, tmp_path)
    r = parity("golden", "check", scen, "--goldens", root, "--out", tmp_path / "o")
    if case in ("missing", "only-other-platform"):  # `golden check` needs this platform's golden: a failure
        assert r.returncode == 1 and "tiny: golden fail" in r.stdout, r.stdout
        assert all(n in r.stdout for n in needles), r.stdout
        return
    check(r, 2, *needles)
    assert "[rank" not in r.stdout + r.stderr  # refused before running anything


@pytest.mark.slow
@pytest.mark.parametrize("case", ["missing", "not-json", "truncated", "other-platform", "old-format"])
def test_run_golden_check_unusable_golden(golden, tmp_path, case):
    scen = golden[0]
    root, needles = _damage(case, golden, tmp_path)
    r = parity("run", scen, "--goldens", root, "--out", tmp_path / "o")
    if case == "missing":  # checked by default: a missing golden is reported, not failed
        assert r.returncode == 0 and "golden missing" in r.stdout and "no golden for" in r.stdout, r.stdout
        return
    check(r, 2, *needles)
    assert "[rank" not in r.stdout + r.stderr


@pytest.mark.slow
def test_golden_check_passes(golden, tmp_path):
    scen, root, _ = golden
    r = parity("golden", "check", scen, "--goldens", root, "--out", tmp_path / "o")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "tiny: golden pass" in r.stdout and "Traceback" not in r.stderr


@pytest.mark.slow
def test_run_golden_check_digest_mismatch(golden, tmp_path):
    scen = golden[0]
    root, manifest = _copy_root(golden, tmp_path)
    m = json.loads(manifest.read_text())
    entry = m["ranks"]["1"]["tensors"]["grad_reduce/layers.0.mlp.fc2.weight"]
    digests = entry["digests"].split()
    digests[1] = digests[1][:-1] + ("0" if digests[1][-1] != "0" else "1")
    entry["digests"] = " ".join(digests)
    manifest.write_text(json.dumps(m))
    out = tmp_path / "o"
    r = parity("run", scen, "--goldens", root, "--out", out, "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "first difference at step 1 / grad_reduce / layers.0.mlp.fc2.weight / rank 1 (digest)" in r.stdout
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    assert e["status"] == "pass" and e["golden"] == "fail"  # parity itself held; the golden did not


def _load_manifest(root: Path, pid: str) -> dict:
    from parity.harness.golden import load

    return json.loads((load(root / "tiny" / pid).path / "manifest.json").read_text())


@pytest.mark.slow
def test_interrupted_regen_keeps_the_old_golden(golden, tmp_path, marker):
    """SIGKILL at start-up; SIGINT, SIGKILL or SIGTERM while the ranks run; SIGKILL in the write
    window (staging written, not yet swapped in): the previous golden stays intact and loadable,
    and no process is left behind."""
    scen, _, pid = golden
    root, manifest = _copy_root(golden, tmp_path)
    # the same scenario, long enough that a signal sent while its ranks run lands before the end
    slow = tmp_path / "slow" / "tiny.toml"
    slow.parent.mkdir()
    slow.write_text(TINY.replace("steps = 2", "steps = 40"))
    # Make the previous golden differ from what a regen records (in a field checks ignore), so a
    # regen that got to the end would replace it.
    m = json.loads(manifest.read_text())
    m["info"]["note"] = "the previous golden"
    manifest.write_text(json.dumps(m, indent=1))
    before = _load_manifest(root, pid)
    args = ["golden", "regen", scen, "--accept", "--goldens", root]

    def regen(sig, when):
        logs = tmp_path / f"log-{sig}-{when}"
        argv = args if when == "early" else ["golden", "regen", slow, *args[3:]]
        with open(str(logs) + ".out", "w") as so, open(str(logs) + ".err", "w") as se:
            # SIGINT at its default in the child, so that Python turns it into KeyboardInterrupt: a
            # child started with SIGINT ignored keeps ignoring it (Python, like any Unix program,
            # respects that), and a test run in the background of a shell has it ignored (the
            # regen then ran to its end and replaced the golden)
            p = subprocess.Popen(PARITY + [str(a) for a in argv], stdout=so, stderr=se, env=command_env(marker),
                                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
            if when == "early":
                time.sleep(0.3)
            else:  # while the ranks run: both ranks forked
                end = time.monotonic() + 120
                while len(_rank_pids(marker)) < 2 and p.poll() is None and time.monotonic() < end:
                    time.sleep(0.1)
                assert len(_rank_pids(marker)) >= 2, "the ranks never started: nothing to interrupt"
                time.sleep(0.5)
            assert p.poll() is None, "regen finished before it could be interrupted"
            p.send_signal(sig)
            rc = p.wait(timeout=60)
        assert_no_orphans(marker, within_s=15.0)
        return rc, Path(str(logs) + ".err").read_text()

    rc, err = regen(signal.SIGKILL, "early")
    assert rc == -signal.SIGKILL
    assert _load_manifest(root, pid) == before

    rc, err = regen(signal.SIGINT, "running")
    assert rc == 3 and "parity: interrupted" in err and "Traceback" not in err, err
    assert _load_manifest(root, pid) == before

    rc, err = regen(signal.SIGKILL, "running")
    assert rc == -signal.SIGKILL
    assert _load_manifest(root, pid) == before

    rc, err = regen(signal.SIGTERM, "running")  # how CI runners cancel a job
    assert rc == 3 and "parity: interrupted" in err and "Traceback" not in err, err
    assert _load_manifest(root, pid) == before

    # The write window, deterministically: kill the process right before the swap.
    script = ("import os, signal, sys\n"
              "import parity.atomic as a\n"
              "a._swap_into_place = lambda staging, target: os.kill(os.getpid(), signal.SIGKILL)\n"
              "from parity.cli import main\n"
              "sys.exit(main())\n")
    p = subprocess.run([sys.executable, "-c", script] + [str(a) for a in args], capture_output=True, text=True,
                       timeout=300, env=command_env(marker))
    assert p.returncode == -signal.SIGKILL, p.stdout + p.stderr
    assert_no_orphans(marker, within_s=15.0)
    staged = [x.name for x in (root / "tiny").iterdir() if x.name.startswith(f".{pid}.tmp-")]
    assert staged, "the killed writer should have left its staging directory"
    assert _load_manifest(root, pid) == before
    from parity.harness.golden import list_goldens

    assert [(r.scenario, r.platform_id) for r in list_goldens(root)] == [("tiny", pid)]


# ---------------------------------------------------------------------------------------------
# NaN and Inf
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_nan_in_training_is_reported(tmp_path, tiny):
    # lr 1e30: the steps blow the weights up; the loss is NaN at step 2 on both stacks. ON and
    # OFF still agree bit for bit, which must not read as a pass. The optimizer state is scanned
    # from step 0, so the first NaN is named where it appears, a step before the loss shows it.
    out = tmp_path / "o"
    r = parity("run", tiny, "--lr", "1e30", "--steps", "3", "--out", out)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    assert "check finite failed: non-finite value in training: first at step 1/optimizer/" in r.stdout
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    assert e["status"] == "fail"
    first = e["nonfinite"]["first"]
    assert (first["step"], first["phase"], first["side"]) == (1, "optimizer", "ON") and first["tensor"].endswith(".master")
    assert not [ev for ev in e["nonfinite"]["events"] if ev["phase"] == "forward" and ev["step"] < 2]
    assert {(ev["rank"], ev["side"]) for ev in e["nonfinite"]["events"] if (ev["step"], ev["tensor"]) == (2, "loss")} == \
        {(0, "ON"), (0, "OFF"), (1, "ON"), (1, "OFF")}
    assert e["failed_checks"][0]["check"] == "finite"
    assert "non-finite" in (out / "summary.md").read_text()


def test_nan_payload_difference_is_a_bit_difference():
    import torch

    from parity.harness.compare import ULP_NAN, compare_tensors, fmt_ulp

    a = torch.tensor([0x7FC00000, 0x3F800000], dtype=torch.int32).view(torch.float32)
    b = torch.tensor([0x7FC00001, 0x3F800000], dtype=torch.int32).view(torch.float32)
    assert torch.isnan(a[0]) and torch.isnan(b[0])
    d = compare_tensors(a, b, "step 0/optimizer/w/rank 0")
    assert not d.equal and d.n_diff == 1 and d.max_ulp == ULP_NAN
    assert d.nan_a == 1 and d.nan_b == 1
    assert "NaN" in d.message() and fmt_ulp(d.max_ulp) == "NaN"
    assert compare_tensors(a, a.clone(), "same").equal  # identical NaN bits are equal
    neg = torch.tensor([-0x00400000, 0x3F800000], dtype=torch.int32).view(torch.float32)
    assert not compare_tensors(a, neg, "sign").equal  # 0xFFC00000: the same NaN with its sign bit set


def test_a_divergence_without_element_counts_reads_its_reason():
    from parity.harness.compare import ULP_NAN, ULP_SATURATED
    from parity.harness.report import fmt_divergence

    assert fmt_divergence({"n_diff": None, "reason": "only in the saved checkpoint"}) == "only in the saved checkpoint"
    assert fmt_divergence({"n_diff": None}) == "differs"
    assert fmt_divergence({"n_diff": 1, "max_ulp": 1}) == "max 1 ULP, 1 element differs"
    # a NaN only one side holds: the line says which side
    assert (fmt_divergence({"n_diff": 4, "max_ulp": ULP_NAN, "nonfinite": {"nan_a": 4}})
            == "max NaN ULP, 4 elements differ; NaN 0 under test / 4 reference")
    # a float64 distance past int64 reads as the comparison's message and triage's tables read it
    assert fmt_divergence({"n_diff": 2, "max_ulp": ULP_SATURATED}) == "max >=2^63-2 ULP, 2 elements differ"


def test_nonfinite_events_from_rank_results():
    from parity.harness.report import nonfinite_events

    results = [
        {"rank": 0, "steps": [{"step": 0, "loss_bits": "0x409d72c4", "loss_b_bits": "0x409d72c4"},
                              {"step": 1, "loss_bits": "0x7f800000", "loss_b_bits": "0xffc00000"}]},
        {"rank": 1, "steps": [{"step": 0, "loss_bits": "0x409d72c4", "loss_b_bits": "0x409d72c4"}],
         "nonfinite": [{"step": 0, "phase": "optimizer", "tensor": "w.master", "side": "ON", "nan": 3, "inf": 0}]},
    ]
    ev = nonfinite_events(results)
    assert [(e["step"], e["phase"], e["tensor"], e["rank"]) for e in ev] == \
        [(0, "optimizer", "w.master", 1), (1, "forward", "loss", 0), (1, "forward", "loss", 0)]
    assert [e.get("kind") for e in ev[1:]] == ["+Inf", "NaN"]
    assert nonfinite_events([{"rank": 0, "steps": [{"step": 0, "loss_bits": "0x3f800000"}]}]) == []
