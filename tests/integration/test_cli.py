"""The command line: usage, listing, the README job, injection localization, golden check."""

import json
import os
import shutil
import subprocess
import sys

import cli_fork
import pytest

from parity.harness.goldens_cli import default_root

pytest_plugins = ["pytester"]

PARITY = [sys.executable, "-m", "parity.cli"]


def parity(*args, timeout=600):
    return cli_fork.run(args, timeout=timeout)


def test_help_and_list():
    r = parity("--help")
    assert r.returncode == 0 and "run" in r.stdout and "golden" in r.stdout
    r = parity("list")
    assert r.returncode == 0 and "default" in r.stdout
    # `python -m parity`, for a host where the package is on the path but its script is not installed
    r = subprocess.run([sys.executable, "-m", "parity", "list"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "default" in r.stdout


def test_no_command_and_bad_flag_exit_2():
    assert parity().returncode == 2
    r = parity("run", "--no-such-flag")
    assert r.returncode == 2 and "usage" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_a_run_never_imports_torch_dynamo(tmp_path):
    """Importing torch._dynamo costs about as much CPU as importing torch, in every process, and
    the stack never compiles: neither the command nor its ranks import it (the two torch calls
    that would are avoided by parity.optim.eager and parity.distributed.determinism)."""
    env = dict(os.environ, PYTHONPROFILEIMPORTTIME="1")
    r = subprocess.run(PARITY + ["run", "--world", "1", "--steps", "1", "--golden", "off", "--quiet",
                                 "--out", str(tmp_path / "o")], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in r.stderr.splitlines()
                if line.startswith("import time:")}
    assert {"torch", "parity.optim.eager"} <= imported  # the log covers torch and the stack
    assert "torch._dynamo" not in imported and "torch._inductor.config" not in imported


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs Linux CPU affinity and 2 CPUs")
def test_cpu_ranks_as_many_as_the_cpus_are_bound_one_to_a_cpu(tmp_path):
    """4 CPU ranks on 2 CPUs: each rank may run on one CPU, ranks 0 and 1 on the first, 2 and 3 on
    the second (what every rank's own affinity says, in the report), and every thread of every
    rank, gloo's too, runs under SCHED_BATCH (what the OS says of each thread at the rank's end); 2
    ranks too, one per CPU; 8 ranks (4 a CPU) run under SCHED_BATCH but free to move; 1 rank is
    left alone on 2 CPUs and bound to its CPU on 1."""
    two = sorted(os.sched_getaffinity(0))[:2]
    found, policies = {}, {}
    for world in (8, 4, 2, 1):
        out = tmp_path / f"w{world}"
        r = cli_fork.run(["run", "--world", str(world), "--steps", "1", "--golden", "off", "--quiet", "--out", out],
                         timeout=600, cpus=two)
        assert r.returncode == 0, r.stdout + r.stderr
        timing = json.loads((out / "report.json").read_text())["scenarios"][0]["timing"]
        found[world], policies[world] = timing["bound_cpus"], timing["thread_policies"]
    assert found == {8: None, 4: [two[0], two[0], two[1], two[1]], 2: [two[0], two[1]], 1: None}
    # one rank given one CPU is bound to it (and the command's affinity did reach the command)
    out = tmp_path / "one-cpu"
    r = cli_fork.run(["run", "--world", "1", "--steps", "1", "--golden", "off", "--quiet", "--out", out],
                     timeout=600, cpus=two[1:])
    assert r.returncode == 0, r.stdout + r.stderr
    assert json.loads((out / "report.json").read_text())["scenarios"][0]["timing"]["bound_cpus"] == [two[1]]
    # where the OS refuses the policy (a sandbox) the ranks run on under the default one
    batch = ["batch"] if _sched_batch_allowed() else ["other"]
    assert policies == {8: batch, 4: batch, 2: batch, 1: ["other"]}
    summary = (tmp_path / "w4" / "summary.md").read_text()
    assert f"each on one CPU ({two[0]}, {two[0]}, {two[1]}, {two[1]})" in summary
    assert ("every thread under SCHED_BATCH" in summary) == (batch == ["batch"])


def _sched_batch_allowed() -> bool:
    probe = "import os; os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


@pytest.mark.slow
def test_inject_one_ulp_is_localized(tmp_path):
    out = tmp_path / "o"
    # a bump at a later step than the first, in a run that goes on past it
    r = parity("run", "--recipe", "blockwise", "--ep", "2", "--world", "2", "--steps", "4",
               "--inject", "ulp:2:grad_reduce:*", "--out", str(out), "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((out / "report.json").read_text())
    (e,) = rep["scenarios"]
    fd = e["first_divergence"]
    assert (fd["step"], fd["phase"], fd["tensor"]) == (2, "grad_reduce", "layers.0.attn.qkv.weight")
    assert fd["max_ulp"] == 1 and fd["n_diff"] == 1
    assert e["compared"] > 0 and (out / "summary.md").exists()
    # each differing comparison's own line, the bumped tensor's first
    assert e["messages"] and e["messages"][0].startswith("step 2/grad_reduce/layers.0.attn.qkv.weight/rank 0: 1 of "), \
        e["messages"][:2]
    snaps = list((out / "snapshots").rglob("*.safetensors"))
    assert snaps, "divergent steps must leave snapshots"


@pytest.mark.slow
def test_an_injected_fault_whose_code_never_runs_is_refused_after_the_run(tmp_path):
    """A catalogued fault whose deviation no stack took tested nothing: exit 2 with one line,
    not a pass (which reads as "the checks missed it"). Here a shared fault in rank 1's copy-back
    at world 1, and the checkpoint fault in a run that saves none. (Where a fault's deviation runs,
    the selftest cases require it to be recorded: tests/integration/test_selftest.py.)"""
    for fault in ("rank1-skips-rank0-slot", "checkpoint-drops-momentum"):
        out = tmp_path / fault
        r = parity("run", "quick-w1-moe", "--steps", "2", "--golden", "off", "--inject", fault, "--out", str(out),
                   "--quiet")
        assert r.returncode == 2, r.stdout + r.stderr
        assert r.stderr.strip() == (f"parity: --inject {fault}: its deviation never ran in quick-w1-moe[steps=2], "
                                    "so nothing of it was tested; pick a scenario that reaches it (parity selftest "
                                    "lists one per fault)")
        (e,) = json.loads((out / "report.json").read_text())["scenarios"]
        assert e["status"] == "pass" and e["faults_fired"] == []
    # In a set, one scenario where it ran is enough: that one is judged, the other gets a note.
    r = parity("run", "quick-w1-moe", "quick-w2-ep2-stress", "--steps", "1", "--golden", "off", "--inject",
               "rank1-skips-rank0-slot", "--out", str(tmp_path / "set"), "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.count("note: --inject rank1-skips-rank0-slot: its deviation never ran in this scenario") == 1
    w1, w2 = json.loads((tmp_path / "set" / "report.json").read_text())["scenarios"]
    assert (w1["faults_fired"], w2["faults_fired"]) == ([], ["rank1-skips-rank0-slot"]) and w2["status"] == "fail"


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_clean_run_passes_with_junit(tmp_path):
    out = tmp_path / "o"
    r = parity("run", "--world", "2", "--steps", "3", "--out", str(out), "--junit", str(tmp_path / "j.xml"),
               "--quiet", "--profile", "cpu")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "report.json").read_text())
    (e,) = rep["scenarios"]
    assert e["status"] == "pass" and e["first_divergence"] is None and e["compared"] > 0
    assert set(e["compared_by_phase"]) >= {"init", "forward", "grad_local", "grad_reduce", "optimizer", "param_sync"}
    assert "<testsuite" in (tmp_path / "j.xml").read_text()
    # where the time went: every stack phase of both sides, the harness's share, start-up
    t = e["timing"]
    for side in ("test", "ref"):
        assert set(t["totals"][side]) >= {"forward", "grad_local", "grad_reduce", "optimizer", "param_sync"}
        assert all(v >= 0 for v in t["totals"][side].values())
    assert t["totals"]["harness"]["capture_compare"] > 0 and t["start_s"] > 0 and t["build_s"] > 0
    assert [s["step"] for s in t["per_step"]] == [-1, 0, 1, 2] and t["ranks_averaged"] == 2
    assert e["memory"]["peak_rss_bytes"] > 0 and set(e["memory"]) == {"peak_rss_bytes"}  # no CUDA peak on CPU
    assert "## Where the time went" in (out / "summary.md").read_text()
    assert t["cpu"]["user_s"] > 0 and t["cpu"]["system_s"] >= 0  # the ranks' own CPU time
    assert set(t["start_parts"]) == {"process", "device", "process_group", "handoff"}
    assert all(v >= 0 for v in t["start_parts"].values())
    # the CLI, pinned before torch and single-threaded, forked its CPU ranks itself (few CPUs) or
    # had them forked by the server it started as soon as its input was valid
    from parity.harness.forkserver import FORK_MAX_CPUS, usable_cpus

    method = "fork" if usable_cpus() <= FORK_MAX_CPUS else "forkserver"
    assert t["start_method"] == method and f"ranks started by {method}" in (out / "summary.md").read_text()
    import pstats  # --profile cpu: one cProfile per rank, with the stack's frames in it

    for rank in (0, 1):
        stats = pstats.Stats(str(out / "profile" / e["name"] / f"rank{rank}.prof")).stats
        assert any(fn == "fp8_gemm" for (_, _, fn) in stats)


@pytest.mark.slow
def test_golden_check_passes_and_fails_on_one_changed_digest(tmp_path):
    from parity.harness.platform import platform_fingerprint, platform_id

    src = default_root() / "default" / platform_id(platform_fingerprint("cpu"))
    if not src.is_dir():  # test_scenarios checks this machine against another platform's golden
        pytest.skip(f"no shipped golden of 'default' for {src.name}")
    root = tmp_path / "goldens"
    shutil.copytree(src, root / "default" / src.name)
    r = parity("golden", "check", "default", "--steps", "2", "--goldens", str(root), "--out", str(tmp_path / "o"))
    assert r.returncode == 0 and "default[steps=2]: golden pass" in r.stdout, r.stdout + r.stderr
    assert "drift report" not in r.stdout  # bit-identical: nothing to triage
    manifest = root / "default" / src.name / "manifest.json"
    m = json.loads(manifest.read_text())
    entry = m["ranks"]["2"]["tensors"]["optimizer/layers.1.attn.qkv.weight.master"]
    digests = entry["digests"].split()
    digests[1] = "0" * 16
    entry["digests"] = " ".join(digests)
    manifest.write_text(json.dumps(m))
    r = parity("golden", "check", "default", "--steps", "2", "--goldens", str(root), "--out", str(tmp_path / "o"))
    assert r.returncode == 1, r.stdout + r.stderr
    assert "first difference at step 1 / optimizer / layers.1.attn.qkv.weight.master / rank 2" in r.stdout
    assert "Traceback" not in r.stderr
    report = tmp_path / "o" / "triage" / "default[steps=2]" / "triage.md"
    assert f"  drift report: {report}" in r.stdout and report.is_file()  # a failed check is triaged


def test_world_larger_than_gpu_count_is_refused_before_launch(monkeypatch):
    import torch

    from parity.harness.errors import ConfigError
    from parity.harness.driver import run_scenario
    from parity.harness.runner import RunOptions
    from parity.harness.scenario import make_scenario

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    s = make_scenario({"name": "gpu8", "device": "cuda", "world": 8, "ep": 8, "moe": True})
    with pytest.raises(ConfigError, match="needs 8 GPUs") as e:
        run_scenario(s, RunOptions(progress=False))
    assert e.value.exit_code == 2


@pytest.mark.slow
def test_pytest_plugin_collects_scenarios_and_regenerates(pytester):
    """The plugin as `pytest --parity FILE` finds it: a pytest session of its own, with the plugins
    of the installed entry points, run in this process (a fresh interpreter and the fork server it
    would start cost more than the three sessions' runs; docs/measurements.md, twenty-fourth session)."""
    pytester.makefile(".toml", tiny='name = "plugin-tiny"\nworld = 2\nsteps = 2\n')
    base = ["--parity", "tiny.toml", "-q", "-p", "no:cacheprovider", "--parity-goldens", str(pytester.path / "g")]
    missing = pytester.runpytest_inprocess(*base)
    assert missing.ret == 1 and "no golden for" in missing.stdout.str()
    missing.assert_outcomes(failed=1)
    regen = pytester.runpytest_inprocess(*base, "--parity-regen")
    regen.assert_outcomes(passed=1)
    assert len(list((pytester.path / "g").glob("plugin-tiny/*/manifest.json"))) == 1
    pytester.runpytest_inprocess(*base).assert_outcomes(passed=1)


# ---------------------------------------------------------------------------------------------
# --world alone derives a fitting EP; --dense
# ---------------------------------------------------------------------------------------------


def _overridden(*flags, scenario="default"):
    from parity.cli import _apply_overrides, _resolve, build_parser

    args = build_parser().parse_args(["run", scenario, *flags])
    notes = []
    (s,) = [_apply_overrides(s, args, notes) for s in _resolve(args.scenarios)]
    return s, notes


@pytest.mark.parametrize("world, ep", [(1, 1), (3, 1), (2, 2), (6, 2), (8, 2)])
def test_world_alone_derives_the_ep_that_fits(world, ep):
    s, notes = _overridden("--world", str(world))  # the default scenario: MoE, world 4, EP 2
    assert (s.world, s.ep, s.moe) == (world, ep, True)
    assert s.world % s.ep == 0
    if ep != 2:
        assert notes == [f"default: --world {world}: ep 2 does not divide it; using ep {ep}"]
    else:
        assert notes == []


def test_each_override_flag_sets_its_scenario_field():
    """Every `parity run` flag that overrides a scenario key reaches that key, and the run's name
    says so (a flag the parser lost, or one mapped to another key, fails here without a run)."""
    flags = {"--recipe": ("mxfp8", "recipe", "mxfp8"), "--pair": ("force_sync", "pair", "force_sync"), "--steps": ("5", "steps", 5),
             "--microbatches": ("2", "microbatches", 2), "--lr": ("0.003", "lr", 0.003),
             "--seed": ("7", "seed", 7), "--bucket-size": ("1024", "bucket_size", 1024),
             "--device": ("cuda", "device", "cuda"), "--resume-at": ("2", "resume_at", 2)}
    for flag, (text, key, want) in flags.items():
        s, _ = _overridden(flag, text)
        assert getattr(s, key) == want, flag
        assert s.name == f"default[{key}={want}]", (flag, s.name)
    s, _ = _overridden("--overlap")
    assert s.overlap is True and s.name == "default[overlap=True]"
    s, _ = _overridden("--no-overlap", scenario="mxfp8-moe-w4-ep4-overlap-on-tied")
    assert s.overlap is False and s.name == "mxfp8-moe-w4-ep4-overlap-on-tied[overlap=False]"
    s, _ = _overridden("--layout", "compact", scenario="padded-blockwise-overlap-pair")  # (FP8 gather: compact only)
    assert s.layout == "compact" and s.name == "padded-blockwise-overlap-pair[layout=compact]"


def test_fewer_steps_keep_the_lr_schedule_of_the_whole_run():
    # `--steps 3` of a 12-step cosine run: the first 3 steps of that run, not a 3-step schedule
    s, notes = _overridden("--steps", "3", scenario="optim-blockwise-dense-w4-clip-cosine")
    assert (s.steps, s.decay_steps, s.lr_decay_style) == (3, 12, "cosine")
    assert notes == ["optim-blockwise-dense-w4-clip-cosine: --steps 3: the cosine LR schedule keeps its 12-step length"]


def test_one_line_errors_keep_the_limit():
    from parity.cli import _one_line

    assert _one_line("a\n  b") == "a b"
    assert _one_line("x" * 2000) == "x" * 2000
    assert _one_line("x" * 2001) == "x" * 1997 + "..."


def test_main_called_off_the_main_thread_leaves_sigterm_alone(tmp_path):
    # an embedding program or a test calls main() from a thread: no handler can be installed there
    import signal
    import threading

    from parity.cli import main

    before, codes = signal.getsignal(signal.SIGTERM), []
    t = threading.Thread(target=lambda: codes.append(main(["golden", "show", "none", "--goldens", str(tmp_path)])))
    t.start()
    t.join()
    assert codes == [2] and signal.getsignal(signal.SIGTERM) is before


def test_a_run_entry_prints_what_it_lacks_and_the_first_lines_of_long_lists(capsys):
    from parity.cli import _print_entry

    entry = {"name": "x", "status": "fail", "compared": 3, "elapsed_s": 1.0, "golden": "pass",
             "missing_phases": ["optimizer", "param_sync"], "golden_messages": [f"m{i}" for i in range(30)],
             "failed_checks": [{"check": f"c{i}", "message": "no"} for i in range(9)]}
    _print_entry(entry, quiet=False)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "[parity] x: FAIL (3 comparisons, 1.0 s, golden pass)"
    assert out[1] == "  phases never compared: optimizer, param_sync"
    assert [line for line in out if line.startswith("  golden: ")] == ["  golden: m0", "  golden: m1", "  golden: m2"]
    assert sum(line.startswith("  check ") for line in out) == 5
    _print_entry(dict(entry, golden="fail"), quiet=False)  # a failed golden lists more of its lines
    assert sum(line.startswith("  golden: ") for line in capsys.readouterr().out.splitlines()) == 20


def test_dense_is_the_opposite_of_moe():
    s, notes = _overridden("--dense")
    assert (s.moe, s.ep, s.world) == (False, 1, 4)
    assert notes == ["default: --dense: ep 2 -> 1 (a dense model has no experts)"]
    s, _ = _overridden("--dense", "--world", "1")
    assert (s.moe, s.ep, s.world) == (False, 1, 1)


def test_dense_with_ep_or_moe_is_a_usage_error():
    r = parity("run", "--dense", "--ep", "2")
    assert r.returncode == 2 and "--dense contradicts --ep 2" in r.stderr and "Traceback" not in r.stderr
    r = parity("run", "--dense", "--moe")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_world_1_runs_and_says_which_ep(tmp_path):
    out = tmp_path / "o"
    r = parity("run", "--world", "1", "--steps", "2", "--out", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[parity] note: default: --world 1: ep 2 does not divide it; using ep 1" in r.stdout
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    assert (e["scenario"]["world"], e["scenario"]["ep"], e["scenario"]["moe"]) == (1, 1, True)
    assert e["status"] == "pass" and e["compared"] > 0


def test_a_reader_that_leaves_ends_the_command_quietly():
    """`parity list | head`: once nobody reads stdout, the command stops with 141 (what a shell
    reports for a process SIGPIPE ended), no "internal error" line and no Python noise at exit."""
    p = subprocess.Popen(PARITY + ["list"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before the command writes: its first flush meets a pipe without a reader
    err = p.stderr.read()
    assert p.wait(timeout=120) == 141 and err == b"", err


def test_the_fork_helper_reads_a_pid_and_an_exit_code_that_arrive_together():
    """tests/cli_fork.py: a command that exits at once has its pid and exit code sent back to back;
    one recv may hold both lines (a reader that took the whole recv as one line failed on it)."""
    import socket

    a, b = socket.socketpair()
    with a, b:
        a.sendall(b"27711\n2\n")
        lines = cli_fork._Lines(b)
        assert (lines.next(), lines.next()) == (b"27711", b"2")
        a.sendall(b"0")
        a.sendall(b"\n")
        assert lines.next() == b"0"


def test_the_in_process_group_keeps_commands_forked(single_rank):
    """conftest's in-process gloo group changes no variable that sends a command of tests/cli_fork.py
    to a fresh interpreter. With MASTER_ADDR/MASTER_PORT set for it (env:// rendezvous), every command
    after it ran in one whenever the fork server had started first: 39 commands of the suite."""
    assert not cli_fork._needs_fresh_interpreter(dict(os.environ), cli_fork.ENV_AT_IMPORT)
