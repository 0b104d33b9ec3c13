"""Checkpoint round trips of one stack at world 1 (parity/optim/checkpoint.py): every piece of
training state comes back bit for bit, saves are atomic, and a damaged checkpoint is refused."""

import os
import random
import re

import pytest
import torch

from parity.ddp.layout import distopt_layout
from parity.distributed.groups import build_groups
from parity import atomic
from parity.harness import resume
from parity.harness.scenario import make_scenario
from parity.optim import checkpoint as ckpt
from parity.optim.stack import Stack
from parity.vocab import Side

CPU = torch.device("cpu")
SCENARIO = dict(name="ckpt-unit", world=1, moe=True, steps=4, recipe="blockwise")


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of the raw bytes (bit-exact comparison)."""
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def everything(stack) -> dict:
    """Every tensor the stack trains with, plus the Adam step counts."""
    out = {f"param/{k}": v for k, v in stack.param_tensors().items()}
    # grad_norm / num_zeros / clip_coef describe the last step's grads: not state a resume needs
    out.update({f"optim/{k}": v for k, v in stack.optimizer_state().items()
                if k not in ("grad_norm", "num_zeros", "clip_coef")})
    opt = stack.distopt.optimizer
    out.update({f"adam_step/{pc.name}": torch.tensor(opt.state[pc.master].get("step", 0))
                for pc in stack.distopt.pieces})
    return out


def same(a: dict, b: dict) -> list:
    assert set(a) == set(b)
    return sorted(k for k in a if not torch.equal(bits(a[k]), bits(b[k])))


def build(**kw):
    s = make_scenario({**SCENARIO, **kw})
    cfg_a, cfg_b = s.stack_configs()
    groups = build_groups(1)
    return s, Stack(cfg_a, groups, CPU), Stack(cfg_b, groups, CPU)


def train(stack, steps):
    for step in range(steps):
        stack.step(step, lambda step, phase, tensors, complete=True: None)


def save(path, stack):
    return ckpt.save(str(path), ckpt.stack_state(stack, prefix="test/"), {"step": 2})


def load(path, stack):
    targets, finish = ckpt.load_targets(stack, ckpt.saved_entries(str(path)), prefix="test/")
    ckpt.load(str(path), targets)
    return finish()


@pytest.mark.parametrize("side", [0, 1], ids=["test-fp8-params", "ref-bf16-params"])
def test_every_piece_of_state_comes_back(single_rank, tmp_path, side):
    _, *pair = build()
    trained = pair[side]
    train(trained, 2)
    stats = save(tmp_path / "c", trained)
    assert stats["bytes"] > 0 and stats["files"] >= 2
    _, *fresh_pair = build()
    fresh = fresh_pair[side]
    want = everything(trained)
    # Not vacuous: a fresh stack differs from the trained one in masters, momentum and params.
    fresh_state = {k: v for k, v in everything(fresh).items() if k in want}
    assert len(same(want, {**want, **fresh_state})) > 10
    done = load(tmp_path / "c", fresh)
    assert same(want, everything(fresh)) == []
    assert done["owners_moved"] == [] and done["owned"] > 0
    # ... and it trains on exactly as the original does.
    trained.step(2, lambda step, phase, tensors, complete=True: None)
    fresh.step(2, lambda step, phase, tensors, complete=True: None)
    assert same(everything(trained), everything(fresh)) == []


def test_fp8_weights_are_saved_as_their_raw_bytes(single_rank, tmp_path):
    _, on, _ = build()
    train(on, 1)
    state = ckpt.stack_state(on)
    fp8 = [k for k in state if ".fp8." in k]
    assert fp8 and all(k.startswith("model/") for k in fp8)
    q = next(p for p in on.params if hasattr(p, "qt"))
    name = on.names[q]
    assert f"model/{name}" not in state  # ON holds no bf16 copy of an FP8 weight
    assert state[f"model/{name}.fp8.rowwise_data"] is q.qt.rowwise_data  # the live bytes, not a copy


def test_saving_changes_nothing_in_the_stack(single_rank, tmp_path):
    _, on, _ = build()
    train(on, 2)
    before = {k: v.clone() for k, v in everything(on).items()}
    save(tmp_path / "c", on)
    assert same(before, everything(on)) == []


def test_a_failed_save_leaves_the_previous_checkpoint(single_rank, tmp_path, monkeypatch):
    _, on, _ = build()
    train(on, 1)
    path = tmp_path / "c"
    save(path, on)
    old = ckpt.read_manifest(str(path))

    class Broken(ckpt.FileSystemWriter):
        def write_data(self, plan, planner):
            super().write_data(plan, planner).wait()  # the data files are on disk ...
            raise OSError(28, "No space left on device")  # ... and then the disk fills up

    monkeypatch.setattr(ckpt, "FileSystemWriter", Broken)
    train(on, 1)
    with pytest.raises(ckpt.CheckpointError, match="checkpoint save failed: .*No space left"):
        save(path, on)
    assert ckpt.read_manifest(str(path)) == old  # same files, same hashes
    assert sorted(os.listdir(tmp_path)) == ["c"]  # no partial directory left behind


def test_a_save_that_cannot_be_published_is_one_error_and_leaves_the_previous_checkpoint(
        single_rank, tmp_path, monkeypatch):
    """The data is written, then the publish fails (the disk fills up while the marker is
    written, say): one CheckpointError naming the path, the previous checkpoint as it was, no
    staging directory left."""
    _, on, _ = build()
    train(on, 1)
    path = tmp_path / "c"
    save(path, on)
    old = ckpt.read_manifest(str(path))

    def full(staging, target):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(atomic, "publish_dir", full)
    train(on, 1)
    with pytest.raises(ckpt.CheckpointError, match=f"cannot finish the checkpoint at {path}: No space left"):
        save(path, on)
    assert ckpt.read_manifest(str(path)) == old
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_save_interrupted_while_publishing_leaves_a_checkpoint(single_rank, tmp_path, monkeypatch, umask):
    """SIGINT the instant the previous checkpoint is renamed away (where publishing takes two
    renames): the path still loads, old or new, and the next save clears the leftovers."""
    _, on, _ = build()
    train(on, 1)
    path = tmp_path / "c"
    save(path, on)
    old = ckpt.read_manifest(str(path))
    rename = os.rename

    def interrupted(src, dst):
        rename(src, dst)
        if os.path.abspath(src) == str(path):
            raise KeyboardInterrupt

    monkeypatch.setattr(os, "rename", interrupted)
    monkeypatch.setattr(atomic, "_rename_exchange", lambda a, b: False)  # the two-rename fallback
    train(on, 1)
    with pytest.raises(KeyboardInterrupt):
        save(path, on)
    assert ckpt.read_manifest(str(path)) == old
    load(path, build()[1])  # and DCP reads it
    monkeypatch.setattr(os, "rename", rename)
    save(path, on)  # the next writer tidies up
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert ckpt.read_manifest(str(path)) != old
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask  # as a plain mkdir makes it (not mkdtemp's 0700)


@pytest.mark.parametrize("damage", ["no-marker", "truncated", "flipped-bit", "missing-file", "bad-marker"])
def test_a_damaged_checkpoint_is_refused(single_rank, tmp_path, damage):
    _, on, _ = build()
    train(on, 1)
    path = tmp_path / "c"
    save(path, on)
    ckpt.read_manifest(str(path))  # intact: accepted
    data = sorted(f for f in os.listdir(path) if f.endswith(".distcp"))[0]
    if damage == "no-marker":
        os.unlink(path / ckpt.MARKER)
    elif damage == "truncated":
        os.truncate(path / data, 100)
    elif damage == "flipped-bit":
        with open(path / data, "r+b") as f:
            f.seek(os.path.getsize(path / data) // 2)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 1]))
    elif damage == "missing-file":
        os.unlink(path / ".metadata")
    else:
        (path / ckpt.MARKER).write_text('{"format": "parity-checkpoint/1", "files": ')
    expect = {"no-marker": "not a finished checkpoint", "truncated": "truncated", "flipped-bit": "corrupt",
              "missing-file": "incomplete", "bad-marker": "unreadable marker"}[damage]
    with pytest.raises(ckpt.CheckpointError, match=expect):
        ckpt.read_manifest(str(path))


def test_a_checkpoint_of_another_stack_is_refused_at_its_first_param(single_rank, tmp_path):
    """The stack's own load names the first model tensor that does not fit, before DCP reads a
    byte: saved FP8 parts where this stack keeps bf16 (ON's checkpoint loaded into OFF), and a
    tensor of another shape (a wider vocabulary)."""
    _, on, off = build()
    save(tmp_path / "c", on)
    saved = ckpt.saved_entries(str(tmp_path / "c"))
    with pytest.raises(ckpt.CheckpointError, match=r"no tensor 'test/model/\S+': it was written by another model"):
        ckpt.load_targets(off, saved, prefix="test/")
    # a checkpoint without a LayerWise matrix's owner (the load would not know where its state lives)
    owner = next(k for k in saved if k.startswith("test/layerwise/") and k.endswith(".owner"))
    with pytest.raises(ckpt.CheckpointError, match=f"no tensor '{re.escape(owner)}'"):
        ckpt.load_targets(on, {k: v for k, v in saved.items() if k != owner}, prefix="test/")
    _, wide, _ = build(model={"vocab_size": 256})
    with pytest.raises(ckpt.CheckpointError,
                       match=r"'test/model/\S*embed\S*' is torch.bfloat16 \(128, 128\); this stack holds torch.bfloat16 \(256, 128\)"):
        ckpt.load_targets(wide, saved, prefix="test/")


def test_pair_checkpoint_is_checked_against_the_scenario(single_rank, tmp_path):
    s, on, off = build()
    train(on, 1)
    train(off, 1)
    path = str(tmp_path / "pair")
    resume.save_pair(path, s, {Side.TEST: on, Side.REF: off}, 1, CPU)
    assert resume.check_checkpoint(path, s, reshard=False)["step"] == 1
    other = {"another scenario": (dict(recipe="mxfp8"), "another config .*recipe"),
             "another world": (dict(world=2), "saved at world 1 .*pass --reshard"),
             "nothing left": (dict(steps=1), "nothing to resume")}
    for what, (kw, msg) in other.items():
        t = make_scenario({**SCENARIO, **kw})
        with pytest.raises(resume.CheckpointInputError, match=msg) as e:
            resume.check_checkpoint(path, t, reshard=False)
        assert e.value.exit_code == 2, what
    assert resume.check_checkpoint(path, make_scenario({**SCENARIO, "world": 2}), reshard=True)["world"] == 1
    with pytest.raises(resume.CheckpointInputError, match="no checkpoint"):
        resume.check_checkpoint(str(tmp_path / "nowhere"), s, reshard=False)


def test_rng_state_round_trip(device=CPU):
    torch.manual_seed(7)
    random.seed(7)
    random.gauss(0, 1)  # python's cached second normal is part of the state
    saved = ckpt.rng_state(device)
    want = (torch.rand(4), random.random(), random.gauss(0, 1))
    torch.rand(100)
    random.random()
    ckpt.set_rng_state(saved, device)
    got = (torch.rand(4), random.random(), random.gauss(0, 1))
    assert torch.equal(want[0], got[0]) and want[1:] == got[1:]


def test_distopt_bucket_offsets_do_not_depend_on_dp():
    """Why the bucket-flat DistOpt format reshards: membership and in-bucket offsets of every
    param are the same at every DP size (only the tail padding changes)."""
    sizes = [32, 4096, 96, 32, 32, 1000, 64, 7, 16384, 32]
    params = [torch.empty(n) for n in sizes]

    def rel(dp, bucket_size):
        lay = distopt_layout(params, bucket_size, dp)
        return [(lay.index[p][2], lay.index[p][0] - lay.buckets[lay.index[p][2]][0],
                 lay.index[p][1] - lay.buckets[lay.index[p][2]][0]) for p in params]

    for bucket_size in (None, 64, 100, 4096):
        layouts = {dp: rel(dp, bucket_size) for dp in (1, 2, 3, 4, 8)}
        assert all(v == layouts[1] for v in layouts.values()), bucket_size
    assert distopt_layout(params, 64, 4).numel != distopt_layout(params, 64, 3).numel  # padding does differ


def test_compare_digests_reports_each_difference():
    def res(rank, shas):
        return {"rank": rank, "digests": {3: {"optimizer": {"test": shas, "ref": {"w.master": "aa"}}},
                                          2: {"optimizer": {"test": {"w.master": "zz"}}}}}

    n, divs = resume.compare_digests([res(0, {"w.master": "aa", "v": "bb"})],
                                     [res(0, {"w.master": "aa", "v": "bb"})], from_step=3)
    assert (n, divs) == (3, [])
    n, divs = resume.compare_digests([res(0, {"w.master": "aa", "v": "bb"})],
                                     [res(0, {"w.master": "ab"})], from_step=3)
    assert n == 2 and len(divs) == 2
    first = divs[0]
    assert (first["step"], first["phase"], first["rank"], first["side"]) == (3, "optimizer", 0, "test")
    assert first["path"] == "step 3/optimizer/v/rank 0" and "only in the uninterrupted run" in first["message"]
    assert divs[1]["path"] == "step 3/optimizer/w.master/rank 0" and "sha256 ab" in divs[1]["message"]


def test_compare_checkpoints_sees_one_flipped_bit(single_rank, tmp_path):
    _, on, _ = build()
    train(on, 1)
    save(tmp_path / "a", on)
    n, divs = resume.compare_checkpoints(str(tmp_path / "a"), str(tmp_path / "a"), 1)
    assert n > 20 and divs == []
    master = next(iter(on.layerwise.masters.values()))
    master.view(torch.int32).view(-1)[5] ^= 1
    save(tmp_path / "b", on)
    n, divs = resume.compare_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"), 1)
    assert len(divs) == 1 and divs[0]["n_diff"] == 1 and divs[0]["max_ulp"] == 1
    assert divs[0]["path"].startswith("step 1/load/test/layerwise/") and divs[0]["path"].endswith(".master/rank -1")
