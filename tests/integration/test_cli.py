"""The command line: usage, listing, the README job, injection localization, golden check."""

import json
import shutil
import subprocess
import sys

import pytest

from parity.harness.goldens_cli import default_root

PARITY = [sys.executable, "-m", "parity.cli"]


def parity(*args, timeout=600):
    return subprocess.run(PARITY + list(args), capture_output=True, text=True, timeout=timeout)


def test_help_and_list():
    r = parity("--help")
    assert r.returncode == 0 and "run" in r.stdout and "golden" in r.stdout
    r = parity("list")
    assert r.returncode == 0 and "default" in r.stdout


def test_no_command_and_bad_flag_exit_2():
    assert parity().returncode == 2
    r = parity("run", "--no-such-flag")
    assert r.returncode == 2 and "usage" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow
def test_inject_one_ulp_is_localized(tmp_path):
    out = tmp_path / "o"
    r = parity("run", "--recipe", "blockwise", "--ep", "2", "--world", "2", "--steps", "7",
               "--inject", "ulp:5:grad_reduce:*", "--out", str(out), "--quiet")
    assert r.returncode == 1, r.stdout + r.stderr
    rep = json.loads((out / "report.json").read_text())
    (e,) = rep["scenarios"]
    fd = e["first_divergence"]
    assert (fd["step"], fd["phase"], fd["tensor"]) == (5, "grad_reduce", "layers.0.attn.qkv.weight")
    assert fd["max_ulp"] == 1 and fd["n_diff"] == 1
    assert e["compared"] > 0 and (out / "summary.md").exists()
    snaps = list((out / "snapshots").rglob("*.safetensors"))
    assert snaps, "divergent steps must leave snapshots"


@pytest.mark.slow
def test_clean_run_passes_with_junit(tmp_path):
    out = tmp_path / "o"
    r = parity("run", "--world", "2", "--steps", "3", "--out", str(out), "--junit", str(tmp_path / "j.xml"),
               "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    rep = json.loads((out / "report.json").read_text())
    (e,) = rep["scenarios"]
    assert e["status"] == "pass" and e["first_divergence"] is None and e["compared"] > 0
    assert set(e["compared_by_phase"]) >= {"init", "forward", "grad_local", "grad_reduce", "optimizer", "param_sync"}
    assert "<testsuite" in (tmp_path / "j.xml").read_text()


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
def test_pytest_plugin_collects_scenarios_and_regenerates(tmp_path):
    (tmp_path / "tiny.toml").write_text('name = "plugin-tiny"\nworld = 2\nsteps = 2\n')
    base = [sys.executable, "-m", "pytest", "--parity", str(tmp_path / "tiny.toml"), "-q",
            "-p", "no:cacheprovider", "--parity-goldens", str(tmp_path / "g")]
    run = lambda *extra: subprocess.run(base + list(extra), capture_output=True, text=True,
                                        timeout=600, cwd=tmp_path)
    missing = run()
    assert missing.returncode == 1 and "no golden for" in missing.stdout
    assert run("--parity-regen").returncode == 0
    assert run().returncode == 0
