"""Checkpoint-resume parity (parity/harness/resume.py): a resumed run equals the uninterrupted one,
a resume that loses state is caught where it first shows, and bad checkpoints exit 2 with one
line. The shipped resume and reshard scenarios run in test_scenarios.py."""

import json
import os

import cli_fork
import pytest
import torch

from parity import cli
from parity.harness.faults import Injection
from parity.harness.resume import RESHARD_NOTE, _verdict, compare_digests
from parity.harness.runner import RunOptions, rank_main
from parity.harness.scenario import make_scenario
from parity.harness.selftest import scenario as quick_scenario
from parity.optim import checkpoint as ckpt
from parity.vocab import Fault

# The `default` scenario at world 1 (what `parity run --world 1 --ep 1 --steps 4` runs).
DEFAULT_W1 = dict(name="resume-w1", world=1, ep=1, moe=True, recipe="blockwise", steps=4)


class Ctx:
    device = "cpu"


def run(scenario, **opts):
    return rank_main(Ctx(), scenario, RunOptions(progress=False, snapshot="none", golden_digests=False, **opts))


def clean(res):
    return not res["divergences"] and all(c["ok"] for c in res["checks"])


def uninterrupted_and_resumed(tmp_path, k=2, injections=(), **kw):
    s = make_scenario({**DEFAULT_W1, **kw})
    path = str(tmp_path / "ckpt")
    full = run(s, save_at=k, save_to=path, digests_from=k, injections=injections)
    resumed = run(s, load_from=path, digests_from=k, injections=injections)
    return full, resumed


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_resumed_run_equals_the_uninterrupted_run(single_rank, tmp_path, recipe):
    full, resumed = uninterrupted_and_resumed(tmp_path, recipe=recipe)
    assert clean(full) and clean(resumed)
    assert [s["step"] for s in resumed["steps"]] == [2, 3]
    assert resumed["resume"]["step"] == 2 and resumed["resume"]["rng_restored"]
    n, divs = compare_digests([full], [resumed], 2)
    phases = {ph for step in resumed["digests"].values() for ph in step}
    assert n > 100 and divs == [] and phases >= {"forward", "grad_reduce", "optimizer", "param_sync", "rng"}
    # from the first resumed step on, every phase of every step: a resume wrong only at its first
    # step must not go uncompared
    for r in (full, resumed):
        assert sorted(r["digests"]) == [2, 3] and set(r["digests"][2]) == set(r["digests"][3]) | {"rng"}, \
            {k: sorted(v) for k, v in r["digests"].items()}


@pytest.mark.parametrize("lost", ["momentum_buffer", "adam_step"])
def test_a_resume_that_loses_state_is_caught(single_rank, tmp_path, monkeypatch, lost):
    """Both sides lose the same state, so ON == OFF still holds after the resume: only the
    comparison with the uninterrupted run can see it, at the first update. Muon's momentum is lost
    by the catalogued shared fault checkpoint-drops-momentum; Adam's step count by a patch."""
    injections = ()
    if lost == "momentum_buffer":
        injections = (Injection("fault", name=Fault.CHECKPOINT_DROPS_MOMENTUM),)
    else:
        keep = ckpt.stack_state
        monkeypatch.setattr(ckpt, "stack_state", lambda stack, prefix="": {
            k: v for k, v in keep(stack, prefix).items() if not k.endswith(lost)})
    full, resumed = uninterrupted_and_resumed(tmp_path, injections=injections)
    assert clean(full) and clean(resumed)
    n, divs = compare_digests([full], [resumed], 2)
    assert divs, f"the resumed run lost {lost} and still equals the uninterrupted run"
    first = divs[0]
    assert (first["step"], first["phase"], first["against"]) == (2, "optimizer", "uninterrupted")
    assert ".master" in first["path"] and {d["side"] for d in divs} == {"test", "ref"}
    assert not [d for d in divs if d["step"] == 2 and d["phase"] in ("forward", "grad_reduce")]  # not before it


@pytest.fixture(scope="module")
def saved(single_rank, tmp_path_factory):
    """A checkpoint of `default` at world 1 after 2 steps, written in this process."""
    path = tmp_path_factory.mktemp("ckpt") / "step2"
    res = run(make_scenario(DEFAULT_W1), save_at=2, save_to=str(path))
    assert clean(res) and res["checkpoint"]["bytes"] > 0
    return path


def damaged(src, dst, how):
    import shutil

    shutil.copytree(src, dst)
    data = sorted(f for f in os.listdir(dst) if f.endswith(".distcp"))[-1]
    if how == "partial":
        os.unlink(dst / ckpt.MARKER)
    elif how == "truncated":
        os.truncate(dst / data, os.path.getsize(dst / data) // 3)
    elif how == "corrupt":
        with open(dst / data, "r+b") as f:
            f.seek(200)
            b = f.read(1)
            f.seek(200)
            f.write(bytes([b[0] ^ 0x10]))
    return dst


BAD = {
    "missing": ([], "no checkpoint at"),
    "partial": ([], "not a finished checkpoint"),
    "truncated": ([], "truncated"),
    "corrupt": ([], "corrupt"),
    "another scenario": (["--recipe", "mxfp8"], "another config"),
    "another world": (["--world", "2"], "pass --reshard"),
    "past the end": (["--steps", "2"], "nothing to resume"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_checkpoint_exits_2_with_one_line(single_rank, saved, tmp_path, capsys, case):
    extra, msg = BAD[case]
    path = tmp_path / "missing" if case == "missing" else saved
    if case in ("partial", "truncated", "corrupt"):
        path = damaged(saved, tmp_path / "c", case)
    argv = ["run", "--world", "1", "--ep", "1", "--steps", "4", *extra, "--resume-from", str(path),
            "--out", str(tmp_path / "o"), "--quiet"]
    code = cli.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("parity: ") and msg in err[0], err
    if case not in ("missing",):
        ckpt.read_manifest(str(saved))  # the original is untouched


@pytest.mark.parametrize("argv,msg", [
    (["--reshard"], "--reshard applies to --resume-from"),
    (["--resume-from", "x", "--golden", "check"], "cannot check a run resumed"),
    (["--resume-from", "x", "--resume-at", "3"], "without --resume-at"),
    (["--resume-at", "30"], "resume_at': must be in 1..29"),
    (["--resume-at", "3", "--resume-world", "3"], "positive multiple of ep=2"),
])
def test_inconsistent_resume_flags_exit_2(tmp_path, capsys, argv, msg):
    assert cli.main(["run", *argv, "--out", str(tmp_path)]) == 2
    assert msg in capsys.readouterr().err


def test_corrupt_checkpoint_in_a_real_process_prints_no_traceback(single_rank, saved, tmp_path):
    path = damaged(saved, tmp_path / "c", "corrupt")
    r = cli_fork.run(["run", "--world", "1", "--ep", "1", "--steps", "4", "--resume-from", path,
                      "--out", tmp_path / "o"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("parity: checkpoint") and "corrupt" in r.stderr


def test_a_comparison_across_launches_that_compared_nothing_fails():
    """The verdict of a resume's comparison is a check of its own: comparing nothing (no state
    in common, an empty checkpoint) fails it, one compared tensor passes it."""
    s = make_scenario({"name": "r", "world": 1, "steps": 3, "resume_at": 1})
    (empty,) = _verdict(s, [], 0, "resume")["checks"]
    assert (empty["check"], empty["ok"], empty["step"]) == ("nonempty/resume", False, 1)
    assert empty["message"] == "resume: nothing compared across launches"
    assert _verdict(s, [], 1, "resume")["checks"][0]["ok"]


@pytest.mark.slow
def test_resume_from_with_reshard_checks_the_loaded_state(single_rank, saved, tmp_path):
    """A world-1 checkpoint loaded at world 2: every tensor re-saved at world 2 equals the saved
    one (gathered view), LayerWise ownership moved, and ON == OFF holds after the load."""
    out = tmp_path / "o"
    r = cli_fork.run(["run", "--world", "2", "--ep", "1", "--steps", "4", "--resume-from", saved, "--reshard",
                      "--out", out, "--quiet"], timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    res = e["resume"]
    assert res["resharded"] and res["compared"] > 20 and res["mismatches"] == 0
    assert sum(res["owners_moved"].values()) > 0 and e["steps"] == 2
    assert res["against"] == "saved checkpoint (gathered view)" and res["note"] == RESHARD_NOTE
    assert "resharded world 1 -> 2" in r.stdout


@pytest.mark.slow
def test_a_reshard_that_drops_moved_state_is_caught_and_named(single_rank, saved, tmp_path):
    """The shared fault reshard-drops-moved-momentum (both sides; ON == OFF holds): the matrices
    whose owner moved come back without momentum. The comparison of the loaded state with the
    saved one names the first such tensor, and the summary says why it differs."""
    out = tmp_path / "o"
    r = cli_fork.run(["run", "--world", "2", "--ep", "1", "--steps", "4", "--resume-from", saved, "--reshard",
                      "--inject", "reshard-drops-moved-momentum", "--out", out, "--quiet"], timeout=600)
    assert r.returncode == 1, r.stdout + r.stderr
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    fd, res = e["first_divergence"], e["resume"]
    assert (fd["step"], fd["phase"], fd["against"], fd["reason"]) == (2, "load", "saved", "only in the saved checkpoint")
    assert fd["tensor"].endswith(".momentum_buffer") and e["failed_checks"] == []
    # one momentum per moved Muon matrix and side (owners_moved counts per side)
    assert res["mismatches"] == sum(res["owners_moved"].values()) > 0
    assert "(only in the saved checkpoint)" in (out / "summary.md").read_text()


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_a_failed_save_overwrites_nothing(tmp_path):
    """The padding-only-shard fault makes DCP refuse the save: what was at the checkpoint path
    before stays as it was, and no partial directory is left."""
    from parity.harness.driver import run_scenario

    s = make_scenario({**quick_scenario("w4-padded-gap-shard-resume").to_dict(), "name": "gap-shard",
                       "steps": 2, "resume_at": 1})
    root = tmp_path / "checkpoints" / s.name
    (root / "step1").mkdir(parents=True)
    (root / "step1" / "keep.txt").write_text("an earlier checkpoint")
    entry, _ = run_scenario(s, RunOptions(injections=(Injection("fault", name=Fault.PADDING_ONLY_SHARD),),
                                          progress=False, snapshot="none", golden_digests=False,
                                          out_dir=str(tmp_path)))
    assert entry["status"] == "error" and "checkpoint save failed" in entry["error"]
    assert sorted(os.listdir(root)) == ["step1"]
    assert os.listdir(root / "step1") == ["keep.txt"]
    assert (root / "step1" / "keep.txt").read_text() == "an earlier checkpoint"


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_a_payload_the_saves_forced_sync_leaves_is_caught():
    """Training forces the param sync before a save. A copy-back that leaves the gather payload in
    grad_data is zeroed by the next step before anything compares it, so only the post-condition
    read right after the save sees it (the run passed with this fault before it was read there)."""
    from parity.harness.driver import run_scenario

    s = make_scenario({"name": "t", "world": 2, "overlap": True, "steps": 2, "resume_at": 1})
    opts = dict(progress=False, snapshot="none", golden_digests=False)
    clean_entry, _ = run_scenario(s, RunOptions(**opts), timeout_s=120)
    assert clean_entry["status"] == "pass", clean_entry["failed_checks"]
    entry, _ = run_scenario(s, RunOptions(injections=(Injection("fault", name=Fault.FORCE_SYNC_PAYLOAD_NOT_ZEROED),),
                                          **opts), timeout_s=120)
    bad = [(c["check"], c["step"]) for c in entry["failed_checks"]]
    assert bad and set(bad) == {("grad-buffer-clean", 0)}, entry["failed_checks"]


@pytest.mark.parametrize("param", ["final_norm.weight", "layers.0.attn.qkv.weight.fp8.rowwise_data"])
def test_a_save_that_writes_into_a_live_param_is_caught(single_rank, tmp_path, monkeypatch, param):
    """The params half of save-leaves-state, which no catalogued fault reaches (the one fault of
    the check writes optimizer state): a save whose state dict holds a live param (as it does: DCP
    reads the tensors themselves) and that writes into it, once the file is out, changes the stack.
    One bit of a bf16 norm weight, or of an FP8 weight's bytes, on the side under test only."""
    real_save = ckpt.save

    def save_then_touch(path, state, manifest):
        out = real_save(path, state, manifest)
        t = state[f"test/model/{param}"]
        flat = t.view(-1).view(torch.int16 if t.element_size() == 2 else torch.uint8)
        flat[0] ^= 1
        return out

    monkeypatch.setattr(ckpt, "save", save_then_touch)
    s = make_scenario(DEFAULT_W1)
    res = run(s, save_at=2, save_to=str(tmp_path / "ckpt"))
    bad = [c for c in res["checks"] if not c["ok"]]
    assert bad and bad[0]["check"] == "save-leaves-state" and bad[0]["step"] == 1, bad[:2]
    assert param.split(".fp8.")[0] in bad[0]["message"] and "test" in bad[0]["message"]
