"""Golden records: record, write, load, find, compare (exact and approximate tier), damage,
platform ids without the CPU model, atomic replacement; and the CLI paths that use them
(checked by default, prefix checks, a shared bug, a one-ULP master change in triage, regen's cases,
CUDA scenarios skipped with a reason).

The fast tests build records from synthetic captures (no ranks); the slow ones run `parity`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import cli_fork
import pytest
import torch

import parity.atomic as atomic
import parity.harness.golden as golden
from parity.harness.errors import (
    GoldenError,
    GoldenExistsError,
    GoldenFormatError,
    GoldenMissing,
    GoldenStale,
)
from parity.harness.platform import fingerprint_diff, platform_fingerprint, platform_id
from parity.harness.scenario import make_scenario
from parity.vocab import STEP_PHASES

REPO = Path(__file__).resolve().parents[2]
FP = {"device_kind": "cpu", "device_name": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz", "torch": "2.13.0+cpu",
      "cuda": "none", "te": "none", "backend": "gloo", "cpu_isa": "avx2", "mkl_cbwr": "COMPATIBLE,STRICT",
      "numpy_blas": "openblas-haswell", "machine": "x86_64", "python": "3.11.7", "os": "linux", "nccl": "none", "cudnn": "none"}
PID = "cpu-avx2-torch2.13.0"
SCEN = make_scenario({"name": "tiny", "world": 2, "steps": 4, "golden_tensor_steps": [0, -1]})


def live(step: int, rank: int, phase: str, version: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * version + 100 * step + 10 * rank + STEP_PHASES.index(phase))
    buf = torch.randn(64, generator=g)
    if phase == "forward":
        return {"loss": buf[:1] + 3.0, "output": buf[1:17].view(4, 4).bfloat16()}
    if phase == "param_sync":
        return {"w.fp8.rowwise_data": buf[:32].to(torch.float8_e4m3fn).view(torch.uint8), "b": buf[:8].bfloat16()}
    return {"w": buf[:32].view(4, 8), "b" if phase != "optimizer" else "w.master": buf[32:40]}


def results(s=SCEN, version: int = 0, edit=None) -> list[dict]:
    """What the ranks of a run return for golden records (``edit(step, rank, phase, tensors)`` may change them)."""
    out = []
    for rank in range(s.world):
        rec: dict = {}
        for step in range(s.steps):
            for phase in STEP_PHASES:
                t = live(step, rank, phase, version)
                if edit:
                    edit(step, rank, phase, t)
                golden.capture_phase(rec, s, rank, step, phase, t)
        out.append({"rank": rank, "golden": rec})
    return out


def record(s=SCEN, **kw) -> golden.Record:
    return golden.record_from_results(s, results(s, **kw), FP)


def write(root: Path, s=SCEN, **kw) -> Path:
    rec = record(s, **kw)
    return golden.write(rec, golden.golden_dir(root, rec))


def bump_master(step, rank, phase, t, at=(2, 0)):
    if (step, rank) == at and phase == "optimizer":
        t["w.master"].view(torch.int32)[3] += 1  # one ULP


# ----------------------------------------------------------------------------------------------
# platform ids, identity, capture
# ----------------------------------------------------------------------------------------------


def test_cpu_platform_id_names_the_kernels_not_the_cpu_model():
    assert platform_id(FP) == PID
    assert platform_id(dict(FP, device_name="AMD EPYC 9654 96-Core Processor")) == PID
    assert fingerprint_diff(FP, dict(FP, device_name="AMD EPYC 9654")) == {}  # informative on CPU
    assert set(fingerprint_diff(FP, dict(FP, cpu_isa="avx512"))) == {"cpu_isa"}
    assert platform_id(dict(FP, cpu_isa="default")) == "cpu-default-torch2.13.0"
    assert platform_id(dict(FP, mkl_cbwr="AUTO")) == "cpu-avx2-torch2.13.0-mkl-auto"
    assert platform_id(dict(FP, numpy_blas="openblas-auto")) == "cpu-avx2-torch2.13.0-blas-openblas-auto"
    assert platform_id(dict(FP, numpy_blas="mkl")) == "cpu-avx2-torch2.13.0-blas-mkl"
    assert set(fingerprint_diff(FP, dict(FP, numpy_blas="openblas-skylakex"))) == {"numpy_blas"}
    assert platform_id(dict(FP, machine="aarch64", cpu_isa="sve256")) == "cpu-sve256-torch2.13.0-aarch64"
    assert fingerprint_diff(FP, dict(FP, torch="2.13.0")) == {}  # local build tag ignored
    cuda = dict(FP, device_kind="cuda", device_name="NVIDIA H200", torch="2.11.0+cu130", cuda="13.0", backend="nccl")
    assert platform_id(cuda) == "cuda-nvidia-h200-torch2.11.0-cu13.0"
    assert set(fingerprint_diff(cuda, dict(cuda, device_name="NVIDIA B200"))) == {"device_name"}
    here = platform_fingerprint("cpu")
    assert here["cpu_isa"] in ("avx2", "default", "avx512") and platform_id(here).startswith("cpu-")


def test_golden_identity_leaves_out_name_steps_and_stored_steps():
    a = make_scenario({"name": "x", "world": 4, "steps": 30})
    b = make_scenario({"name": "x[steps=3]", "world": 4, "steps": 3, "golden_tensor_steps": [0]})
    assert golden.scenario_config(a) == golden.scenario_config(b) == {"world": 4}  # defaults left out
    c = make_scenario({"name": "x[lr=0.01]", "world": 4, "lr": 0.01})
    assert golden.fingerprint(golden.scenario_config(c)) != golden.fingerprint(golden.scenario_config(a))
    assert golden.base_name("default[steps=3+world=1]") == "default"
    assert golden.tensor_steps([0, -1], 30) == [0, 29] and golden.tensor_steps([0, -1], 1) == [0]
    assert golden.tensor_steps([5, -40], 4) == [] and golden.tensor_steps([], 4) == []
    # the bounds are Python's: -steps is the first step, steps is past the end
    assert golden.tensor_steps([-4], 4) == [0] and golden.tensor_steps([4], 4) == []


def test_capture_keeps_rank0_tensors_at_stored_steps_only():
    rec = record()
    assert rec.steps == 4 and sorted(rec.ranks) == [0, 1] and rec.tensor_steps == [0, 3]
    assert set(rec.memory[0]) == set(rec.ranks[0].keys)  # every phase's tensors of rank 0
    r0 = rec.ranks[0]
    assert r0.keys["param_sync/w.fp8.rowwise_data"] == ("uint8", (32,))
    assert all(len(d) == 4 and all(len(x) == 16 for x in d) for d in r0.digests.values())
    loss = live(1, 0, "forward")["loss"]
    assert r0.loss[1] == f"0x{loss.view(torch.int32).item() & 0xFFFFFFFF:08x}"


# ----------------------------------------------------------------------------------------------
# write, load, compare
# ----------------------------------------------------------------------------------------------


def test_write_load_compare_pass(tmp_path):
    path = write(tmp_path)
    assert path == tmp_path / "tiny" / PID
    assert sorted(p.name for p in path.iterdir()) == [
        "manifest.json", "tensors_step_00000.safetensors", "tensors_step_00003.safetensors"]
    g = golden.load(path)
    assert g.steps == 4 and g.tensor_steps == [0, 3] and g.config == {} and g.platform == FP
    c = golden.compare(g, record())
    assert c.status == "pass" and c.differences == [] and c.drift == [] and c.drift_steps == [0, 3]
    assert c.summary() == f"bit-identical to tiny/{PID} over 4 steps"
    with pytest.raises(GoldenExistsError):
        write(tmp_path)
    # a record just written describes itself as its files do when loaded, from a str root too
    rec = record()
    again = golden.write(rec, golden.golden_dir(tmp_path / "again", rec))
    assert golden.describe(rec) == golden.describe(golden.load(again))
    assert [(r.scenario, r.platform_id) for r in golden.list_goldens(str(tmp_path / "again"))] == [("tiny", PID)]


def test_first_difference_and_one_ulp_drift_at_a_stored_step(tmp_path):
    g = golden.load(write(tmp_path))
    run = record(edit=lambda *a: bump_master(*a, at=(3, 0)))
    c = golden.compare(g, run)
    assert c.status == "fail"
    d = c.first()
    assert (d.step, d.phase, d.tensor, d.rank, d.reason) == (3, "optimizer", "w.master", 0, "digest")
    ((step, key, t),) = c.drift
    assert (step, key, t.n_diff, t.max_ulp, t.first_index) == (3, "optimizer/w.master", 1, 1, (3,))
    assert "first difference at step 3 / optimizer / w.master / rank 0 (digest, 1 of 8 elements, max 1 ULP)" \
        in c.summary()
    assert any("step 3 optimizer/w.master: 1 of 8 elements, max 1 ULP, hist 0: 7, 1: 1" in m for m in c.messages())
    per_phase = [m.split() for m in c.messages() if m.startswith("  step ") and "tensors differ" in m]
    assert len(per_phase) == 10  # each stored step's five phases, each compared
    assert ["step", "3", "optimizer", "1", "of", "2", "tensors", "differ,", "max", "1", "ULP"] in per_phase
    # at a step without stored tensors only the digest names it; the earliest step wins
    c = golden.compare(g, record(edit=lambda st, r, ph, t: (bump_master(st, r, ph, t, at=(2, 1)),
                                                            bump_master(st, r, ph, t, at=(3, 0)))))
    assert c.first().where() == "step 2 / optimizer / w.master / rank 1" and c.first_drift() is None
    assert [(x.step, x.rank) for x in c.differences] == [(2, 1), (3, 0)]
    # what `parity golden check` prints names each (of the first five)
    assert {"step 2 / optimizer / w.master / rank 1: digest", "step 3 / optimizer / w.master / rank 0: digest"} \
        <= set(c.messages())
    # within a step the earliest phase wins over the lowest rank: rank 1's forward comes before
    # rank 0's optimizer, though the records are walked rank by rank

    def two(step, rank, phase, t):
        bump_master(step, rank, phase, t, at=(2, 0))
        if (step, rank, phase) == (2, 1, "forward"):
            t["output"].view(torch.int16)[0, 0] += 1
    c = golden.compare(g, record(edit=two))
    assert [(x.step, x.phase, x.rank) for x in c.differences] == [(2, "forward", 1), (2, "optimizer", 0)]


def test_structural_differences_and_loss(tmp_path):
    g = golden.load(write(tmp_path))

    def edit(step, rank, phase, t):
        if rank == 1 and phase == "grad_reduce":
            t["w"] = t["w"].double()  # a record keeps one dtype and shape per tensor
            if step == 1:
                t["new"] = t.pop("b")
        if step == 2 and phase == "forward":
            t["loss"].view(torch.int32).add_(2)

    c = golden.compare(g, record(edit=edit))
    kinds = {(d.step, d.tensor, d.reason) for d in c.differences}
    assert {(1, "b", "missing"), (1, "new", "extra"), (0, "w", "dtype"), (3, "w", "dtype")} <= kinds
    assert (2, "loss", "digest") in kinds
    assert [(s, r) for s, r, _, _ in c.loss] == [(2, 0), (2, 1)]
    assert any("2 ULP" in m for m in c.messages())


def test_prefix_and_longer_runs(tmp_path):
    g = golden.load(write(tmp_path))
    short = make_scenario({"name": "tiny[steps=2]", "world": 2, "steps": 2, "golden_tensor_steps": [0, -1]})
    c = golden.compare(g, record(short))
    assert c.status == "pass" and c.steps == 2 and c.drift_steps == [0]
    assert c.notes == ["checked the golden's first 2 of 4 steps"]
    bad = golden.compare(g, record(short, edit=lambda *a: bump_master(*a, at=(1, 1))))
    assert bad.status == "fail" and bad.first().where() == "step 1 / optimizer / w.master / rank 1"
    long = make_scenario({"name": "tiny[steps=6]", "world": 2, "steps": 6, "golden_tensor_steps": [0, -1]})
    c = golden.compare(g, record(long))
    assert c.status == "pass" and c.steps == 4 and "beyond the golden" in c.notes[0]


def test_approximate_tier_judges_the_loss_and_reports_the_drift(tmp_path):
    g = golden.load(write(tmp_path))

    def small(step, rank, phase, t):
        for v in t.values():
            if v.is_floating_point():
                v.view(torch.int16 if v.element_size() == 2 else torch.int32).add_(1)

    c = golden.compare(g, record(edit=small), "approx")
    assert c.status == "pass" and c.differences and c.drift  # bits differ: reported, not judged
    assert c.summary().startswith(f"approximate tier against tiny/{PID}: loss within 0.05 relative")
    assert any("drift vs the golden" in m for m in c.messages())

    def big(step, rank, phase, t):
        if phase == "forward" and step == 3:
            t["loss"].mul_(1.2)

    assert golden.compare(g, record(edit=big), "approx").status == "fail"

    # the same bits on another platform: said so, and no drift table
    same = golden.compare(g, record(), "approx")
    assert same.summary() == (f"approximate tier against tiny/{PID}: every tensor record bit-identical "
                              "(loss within 0.05 relative) over 4 steps")
    assert golden.drift_lines(same) == []
    # a golden that keeps only digests has no drift to show: said in one line
    bare = make_scenario({"name": "tiny", "world": 2, "steps": 4})
    c = golden.compare(golden.load(write(tmp_path / "bare", bare)), record(bare, edit=small), "approx")
    assert c.differences and golden.drift_lines(c) == [
        "no element-wise drift: the golden stores no tensors of the steps compared (only digests)"]


# ----------------------------------------------------------------------------------------------
# find: missing, stale, other platform, format
# ----------------------------------------------------------------------------------------------


def test_find(tmp_path):
    with pytest.raises(GoldenMissing) as e:
        golden.find(tmp_path, SCEN, FP)
    assert e.value.exit_code == 2 and e.value.platform_id == PID and f"no golden for {PID}" in str(e.value)
    write(tmp_path)
    g, tier = golden.find(tmp_path, SCEN, FP)
    assert tier == "exact" and g.path == tmp_path / "tiny" / PID
    # a shorter run (CLI override) finds the same golden
    assert golden.find(tmp_path, make_scenario({"name": "tiny[steps=2]", "world": 2, "steps": 2}), FP)[1] == "exact"
    # another configuration of an overridden scenario has no golden
    with pytest.raises(GoldenMissing, match="this configuration of 'tiny'.*lr: 0.001 in the golden, 0.01 here"):
        golden.find(tmp_path, make_scenario({"name": "tiny[lr=0.01]", "world": 2, "steps": 4, "lr": 0.01}), FP)
    # ... unless another scenario ran that configuration: an override whose run is another
    # scenario's (`parity run --recipe blockwise --ep 8` runs blockwise-moe-w8-ep8-overlap-off's
    # configuration) is checked against that scenario's golden, its own scenario's first
    write(tmp_path, make_scenario({"name": "tiny-lr", "world": 2, "steps": 4, "lr": 0.01}))
    g, tier = golden.find(tmp_path, make_scenario({"name": "tiny[lr=0.01]", "world": 2, "steps": 6, "lr": 0.01}), FP)
    assert (g.scenario, tier) == ("tiny-lr", "exact")
    write(tmp_path, make_scenario({"name": "tiny-lr-long", "world": 2, "steps": 5, "lr": 0.01}))
    g, _ = golden.find(tmp_path, make_scenario({"name": "tiny[lr=0.01]", "world": 2, "steps": 6, "lr": 0.01}), FP)
    assert (g.scenario, g.steps) == ("tiny-lr-long", 5)  # of two, the golden that covers more steps
    assert golden.find(tmp_path, make_scenario({"name": "tiny[steps=3]", "world": 2, "steps": 3}), FP)[0].scenario \
        == "tiny"
    # a scenario under its own name never borrows another's golden: it needs its own
    with pytest.raises(GoldenMissing, match="scenario 'tiny-copy' has none"):
        golden.find(tmp_path, make_scenario({"name": "tiny-copy", "world": 2, "steps": 4}), FP)
    # the scenario file changed: stale
    with pytest.raises(GoldenStale, match="stale.*seed"):
        golden.find(tmp_path, make_scenario({"name": "tiny", "world": 2, "steps": 4, "seed": 7}), FP)
    # another platform: missing, naming the ones that exist; usable in the approximate tier
    other = dict(FP, cpu_isa="avx512")
    with pytest.raises(GoldenMissing, match=f"goldens exist for: {PID}") as e:
        golden.find(tmp_path, SCEN, other)
    assert e.value.others == (PID,)
    assert golden.find(tmp_path, SCEN, other, allow_other_platform=True)[1] == "approx"
    # ... and so is a golden of an override's configuration under another scenario's name
    lr = make_scenario({"name": "tiny[lr=0.01]", "world": 2, "steps": 6, "lr": 0.01})
    with pytest.raises(GoldenMissing, match=f"this configuration of 'tiny'; goldens of it exist for: {PID}") as e:
        golden.find(tmp_path, lr, other)
    assert e.value.others == (PID,)
    g, tier = golden.find(tmp_path, lr, other, allow_other_platform=True)
    assert (g.scenario, tier) == ("tiny-lr-long", "approx")
    # ... its own scenario's golden first, though another of its configuration covers more steps
    own = make_scenario({"name": "tiny-lr[steps=6]", "world": 2, "steps": 6, "lr": 0.01})
    g, tier = golden.find(tmp_path, own, other, allow_other_platform=True)
    assert (g.scenario, g.steps, tier) == ("tiny-lr", 4, "approx")


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _save(path: Path, m) -> None:
    (path / "manifest.json").write_text(m if isinstance(m, str) else json.dumps(m))


def _with_digests(m: dict, text: str) -> dict:
    m["ranks"]["0"]["tensors"]["forward/loss"]["digests"] = text
    return m


def _with_loss(m: dict, step: int, text: str) -> dict:
    loss = m["ranks"]["0"]["loss"].split(" ")
    m["ranks"]["0"]["loss"] = " ".join(loss[:step] + ([text] if text else []) + loss[step + 1:])
    return m


@pytest.mark.parametrize("edit, error, match", [
    (lambda m: "{not json", GoldenError, "not valid JSON"),
    (lambda m: [], GoldenError, "top level"),
    (lambda m: {**m, "format_version": 1}, GoldenFormatError, "format 1.*regenerate it on its platform"),
    (lambda m: {**m, "format_version": 3}, GoldenFormatError, "upgrade parity"),
    (lambda m: {**m, "config": {"world": 4}}, GoldenError, "'fingerprint' does not match"),
    (lambda m: {**m, "files": {}}, GoldenError, "not listed"),
    (lambda m: {**m, "files": {k: {"bytes": f["bytes"]} for k, f in m["files"].items()}}, GoldenError,
     "file entries need bytes and sha256"),
    (lambda m: _with_digests(m, "0123 zz"), GoldenError, "rank 0 'forward/loss': bad digest list"),
    (lambda m: {k: v for k, v in m.items() if k != "scenario"}, GoldenError, "'scenario' or 'config' missing"),
    (lambda m: {**m, "steps": 5}, GoldenError, "4 entries for 5 steps"),
    (lambda m: {**m, "format": "other-tool"}, GoldenError, "'format' is not 'parity-golden'"),
    (lambda m: _with_digests(m, m["ranks"]["0"]["tensors"]["forward/loss"]["digests"].rsplit(" ", 1)[0]), GoldenError,
     "rank 0 'forward/loss': 3 entries for 4 steps"),
    (lambda m: _with_loss(m, 3, None), GoldenError, "rank 0: 'loss' has 3 entries for 4 steps"),
    (lambda m: _with_loss(m, 2, "1.25"), GoldenError, "rank 0: a 'loss' entry is not float32 bits"),
    (lambda m: _with_loss(m, 0, "0x3f80000"), GoldenError, "rank 0: a 'loss' entry is not float32 bits"),
])
def test_malformed_manifest_is_a_clean_error(tmp_path, edit, error, match):
    path = write(tmp_path)
    _save(path, edit(_manifest(path)))
    with pytest.raises(error, match=match) as e:
        golden.load(path)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_old_format_golden_is_a_typed_error(tmp_path):
    # a golden of the previous format (per-phase digests) as the CUDA goldens were shipped
    d = tmp_path / "tiny" / "cuda-nvidia-h200-torch2.11.0-cu13.0"
    d.mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"format": "parity-golden", "format_version": 1, "scenario": "tiny"}))
    cuda = dict(FP, device_kind="cuda", device_name="NVIDIA H200", torch="2.11.0+cu130", cuda="13.0", backend="nccl")
    with pytest.raises(GoldenFormatError, match="parity golden regen tiny"):
        golden.find(tmp_path, SCEN, cuda)


@pytest.mark.parametrize("damage", ["truncated", "missing", "garbage"])
def test_damaged_tensor_file(tmp_path, damage):
    path = write(tmp_path)
    f = path / "tensors_step_00003.safetensors"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "missing":
        f.unlink()
    else:
        f.write_bytes(b"x" * f.stat().st_size)
    with pytest.raises(GoldenError, match="tensors_step_00003.safetensors") as e:
        golden.load(path)
    assert e.value.exit_code == 2
    # a shorter run (an overridden scenario) takes this golden by another path: never unchecked
    short = make_scenario({"name": "tiny[steps=2]", "world": 2, "steps": 2, "golden_tensor_steps": [0, -1]})
    with pytest.raises(GoldenError) as e:
        golden.find(tmp_path, short, FP)
    if damage == "garbage":  # the manifest and the sizes check out: only the digest tells
        assert "tensors_step_00003.safetensors does not match its digest" in str(e.value)


def test_stored_tensor_that_disagrees_with_its_digest(tmp_path):
    path = write(tmp_path)
    m = _manifest(path)
    e = m["ranks"]["0"]["tensors"]["optimizer/w.master"]
    digests = e["digests"].split()
    digests[0] = "0" * 16
    e["digests"] = " ".join(digests)
    _save(path, m)
    g = golden.load(path)
    with pytest.raises(GoldenError, match="modified after recording"):
        golden.compare(g, record())


def test_a_stored_step_is_read_once_per_pass_not_per_row(tmp_path, monkeypatch):
    """Triage asks a record for a stored step once per differing tensor there (in step order); the
    step file, which holds every tensor of the step, is read and checked against the digests once
    per pass over the steps: once by the comparison, once by the triage rows."""
    from parity.harness import triage

    g = golden.load(write(tmp_path))
    run = golden.load(write(tmp_path / "run", version=1))  # every tensor differs at every step
    reads = []
    real = golden.read_snapshot
    monkeypatch.setattr(golden, "read_snapshot", lambda path: reads.append(str(path)) or real(path))
    c = golden.compare(g, run)  # reads the stored steps of both records for the drift table
    rows, _ = triage.golden_rows("tiny", c, {}, {})
    at_stored = [r for r in rows if r["step"] in (0, 3) and r["rank"] == 0 and r["max_ulp"] is not None]
    assert len(at_stored) > 4  # several rows per stored step, each with element statistics
    files = [str(rec.path / f"tensors_step_{s:05d}.safetensors") for rec in (g, run) for s in (0, 3)]
    assert sorted(reads) == sorted(2 * files)


# ----------------------------------------------------------------------------------------------
# atomic replacement
# ----------------------------------------------------------------------------------------------


def test_crash_before_swap_keeps_old_golden(tmp_path, monkeypatch):
    path = write(tmp_path)

    def crash(staging, target):
        assert (staging / "manifest.json").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(atomic, "_swap_into_place", crash)
    with pytest.raises(KeyboardInterrupt):
        golden.write(record(version=1), path, overwrite=True)
    assert sorted(p.name for p in path.parent.iterdir()) == [PID]
    assert golden.compare(golden.load(path), record()).status == "pass"


def test_crash_between_fallback_renames_keeps_old_golden_readable(tmp_path, monkeypatch):
    path = write(tmp_path)
    monkeypatch.setattr(atomic, "_rename_exchange", lambda a, b: False)
    monkeypatch.setattr(atomic, "_between_renames", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        golden.write(record(version=1), path, overwrite=True)
    assert not path.exists()  # the window: only the moved-aside copy
    (ref,) = golden.list_goldens(tmp_path)
    assert (ref.scenario, ref.platform_id) == ("tiny", PID)
    assert golden.compare(golden.load(ref.path), record()).status == "pass"
    monkeypatch.setattr(atomic, "_between_renames", lambda: None)
    golden.write(record(version=1), path, overwrite=True)  # the next writer puts things right
    assert sorted(p.name for p in path.parent.iterdir()) == [PID]
    assert golden.compare(golden.load(path), record(version=1)).status == "pass"


def test_sigkill_mid_write_keeps_old_golden(tmp_path):
    path = write(tmp_path)
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = [{str(REPO)!r}, {str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        import parity.harness.golden as g
        import test_golden as tg
        g.write_snapshot = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        g.write(tg.record(version=1), {str(path)!r}, overwrite=True)
        """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    names = sorted(p.name for p in path.parent.iterdir())
    assert len(names) == 2 and names[0].startswith(f".{PID}.tmp-")
    assert golden.compare(golden.load(path), record()).status == "pass"
    golden.write(record(version=1), path, overwrite=True)  # removes the dead writer's staging dir
    assert sorted(p.name for p in path.parent.iterdir()) == [PID]


# ----------------------------------------------------------------------------------------------
# The command line (real runs)
# ----------------------------------------------------------------------------------------------

TINY1 = """\
name = "tiny1"
world = 1
steps = 4
golden_tensor_steps = [0, -1]
model = { num_layers = 1, seq_len = 16, micro_batch = 1 }
"""


def parity(*args, env=None, timeout=600) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if k not in ("PARITY_GOLDENS", "ATEN_CPU_CAPABILITY", "MKL_CBWR")}
    e.update(env or {})
    return cli_fork.run(args, env=e, timeout=timeout, cwd=REPO)


def test_manifest_changes_are_named_by_their_dotted_paths():
    old = {"info": {"note": "x", "by": "a"}, "steps": 4, "platform": {"python": "3.11.7"}, "gone": 1}
    new = {"info": {"by": "a"}, "steps": 4, "platform": {"python": "3.11.9"}, "tensor_steps": [0]}
    assert golden.manifest_changes(old, new) == ["gone", "info.note", "platform.python", "tensor_steps"]
    assert golden.manifest_changes(old, old) == []
    assert golden.manifest_changes({"a": None}, {}) == ["a"]  # a key with a null value is still a key


def test_check_steps_is_a_prefix_never_an_extension():
    from parity.harness.goldens_cli import _prefix

    assert _prefix(SCEN, None) is SCEN and _prefix(SCEN, 4) is SCEN and _prefix(SCEN, 99) is SCEN
    assert (_prefix(SCEN, 2).name, _prefix(SCEN, 2).steps) == ("tiny[steps=2]", 2)


def test_golden_show(tmp_path):
    write(tmp_path)
    r = parity("golden", "show", "tiny", "--goldens", tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"tiny/{PID} at ") and "4 steps, ranks [0, 1]" in r.stdout, r
    # a name with no golden is bad input: one line, exit 2, after what was found
    r = parity("golden", "show", "tiny", "no-such", "--goldens", tmp_path)
    assert r.returncode == 2 and f"tiny/{PID}" in r.stdout, r
    assert r.stderr.strip() == f"parity: no golden under {tmp_path} for: no-such"
    # a damaged golden is listed as unusable
    (tmp_path / "tiny" / PID / "manifest.json").write_text("{")
    r = parity("golden", "show", "--goldens", tmp_path)
    assert r.returncode == 0 and r.stdout.startswith(f"tiny/{PID}: unusable: "), r
    r = parity("golden", "show", "--goldens", tmp_path / "empty")
    assert r.returncode == 0 and r.stdout.strip() == f"no goldens under {tmp_path / 'empty'}", r


def _shipped_default_or_approx() -> list[str]:
    """`--allow-other-platform` where the shipped default golden is not for this platform (CI on
    another kernel set): the approximate tier, with the drift printed instead of a skip."""
    here = platform_id(platform_fingerprint("cpu"))
    return [] if (REPO / "goldens" / "default" / here).is_dir() else ["--allow-other-platform"]


@pytest.mark.slow
@pytest.mark.ranks(4)
def test_run_checks_the_shipped_golden_by_default_and_a_shared_bug_fails_it(tmp_path):
    """A bug both sides share (a catalogued shared fault: the expert grads scaled by the expert-DP
    size, EP times too large) passes every in-run check; the shipped golden is what fails it."""
    extra = _shipped_default_or_approx()
    r = parity("run", "--steps", "3", "--quiet", "--out", tmp_path / "ok", *extra)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "default[steps=3]: PASS" in r.stdout and "golden pass" in r.stdout
    assert "checked the golden's first 3 of 30 steps" in r.stdout
    (e,) = json.loads((tmp_path / "ok" / "report.json").read_text())["scenarios"]
    assert e["golden"] == "pass" and e["golden_detail"]["steps"] == 3
    if extra:
        print(r.stdout)  # the drift table of the approximate tier
        return
    r = parity("run", "--steps", "3", "--quiet", "--out", tmp_path / "bug", "--inject",
               "expert-grads-scaled-by-expert-dp")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "default[steps=3]: PASS" in r.stdout and "golden fail" in r.stdout  # ON == OFF still holds
    (e,) = json.loads((tmp_path / "bug" / "report.json").read_text())["scenarios"]
    assert e["failed_checks"] == [] and e["first_divergence"] is None
    first = e["golden_detail"]["first"]  # on a rank that holds that expert
    assert e["golden"] == "fail" and first.pop("rank") in range(4) and first == {
        "step": 0, "phase": "grad_reduce", "tensor": "layers.1.mlp.experts.0.fc1.weight", "reason": "digest"}
    summary = (tmp_path / "bug" / "summary.md").read_text()
    assert "| fail: differs from default/" in summary and "step 0 / grad_reduce / layers.1.mlp.experts" in summary
    # without the golden nothing sees it: the run passes, and says before it starts that it cannot tell
    r = parity("run", "--steps", "1", "--quiet", "--golden", "off", "--out", tmp_path / "off", "--inject",
               "expert-grads-scaled-by-expert-dp")
    assert r.returncode == 0, r.stdout + r.stderr
    assert ("note: --inject expert-grads-scaled-by-expert-dp: only a golden of this platform can see it, and "
            "default[steps=1] is checked against none") in r.stdout


@pytest.mark.slow
@pytest.mark.ranks(4)
@pytest.mark.parametrize("flags, scenario", [(["--recipe", "blockwise", "--ep", "8"], "blockwise-moe-w8-ep8-overlap-off"),
                                             (["--recipe", "mxfp8"], "mxfp8-moe-w4-ep2")],
                         ids=["blockwise-ep8", "mxfp8"])
def test_a_hand_run_command_is_checked_against_the_golden_of_its_configuration(tmp_path, flags, scenario):
    """`parity run --recipe blockwise --ep 8` overrides the default scenario into the configuration
    blockwise-moe-w8-ep8-overlap-off runs, and `parity run --recipe mxfp8` into mxfp8-moe-w4-ep2's:
    that scenario's golden is the command's."""
    here = platform_id(platform_fingerprint("cpu"))
    if not (REPO / "goldens" / scenario / here).is_dir():
        pytest.skip(f"no golden of {scenario} for {here}")
    r = parity("run", *flags, "--steps", "2", "--quiet", "--out", tmp_path / "o")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"golden: bit-identical to {scenario}/{here} over 2 steps" in r.stdout, r.stdout
    (e,) = json.loads((tmp_path / "o" / "report.json").read_text())["scenarios"]
    assert e["golden"] == "pass" and e["golden_detail"]["steps"] == 2


@pytest.mark.slow
def test_missing_golden_is_reported_required_or_skipped(tmp_path):
    scen = tmp_path / "tiny1.toml"
    scen.write_text(TINY1)
    empty = tmp_path / "none"
    here = platform_id(platform_fingerprint("cpu"))
    r = parity("run", scen, "--steps", "1", "--goldens", empty, "--out", tmp_path / "a", "--quiet")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "golden missing" in r.stdout and f"no golden for {here}" in r.stdout
    (e,) = json.loads((tmp_path / "a" / "report.json").read_text())["scenarios"]
    assert e["status"] == "pass" and e["golden"] == "missing"
    assert f"missing: no golden for {here}" in (tmp_path / "a" / "summary.md").read_text()
    r = parity("run", scen, "--steps", "1", "--goldens", empty, "--golden", "require", "--out", tmp_path / "b")
    assert r.returncode == 1 and "golden fail" in r.stdout and "a golden is required" in r.stdout
    r = parity("run", scen, "--steps", "1", "--goldens", empty, "--golden", "off", "--out", tmp_path / "c")
    assert r.returncode == 0 and "golden" not in r.stdout.replace(str(tmp_path), "").replace("goldens", "")


@pytest.mark.slow
def test_regen_check_and_triage_of_a_one_ulp_master_change(tmp_path):
    scen = tmp_path / "tiny1.toml"
    scen.write_text(TINY1)
    root = tmp_path / "g"
    r = parity("golden", "regen", scen, "--goldens", root)
    assert r.returncode == 1 and "golden created" in r.stdout and "not accepted" in r.stdout  # review first
    accept = "goldens were written but not accepted: review the changes above, then rerun with --accept"
    assert accept in r.stdout
    r = parity("golden", "regen", scen, "--goldens", root)
    assert r.returncode == 0 and "golden unchanged" in r.stdout and accept not in r.stdout
    # a golden that still passes but differs in a field the checks ignore: --only-failing keeps it
    (manifest,) = root.rglob(golden.MANIFEST_NAME)
    m = json.loads(manifest.read_text())
    m["info"]["note"] = "kept"
    manifest.write_text(json.dumps(m, indent=1))
    r = parity("golden", "regen", scen, "--goldens", root, "--only-failing")
    assert r.returncode == 0 and "tiny1: golden pass, skipped (--only-failing)" in r.stdout, r.stdout + r.stderr
    assert json.loads(manifest.read_text())["info"]["note"] == "kept"
    # without it the golden is rewritten, and the regen says what changed besides the records
    r = parity("golden", "regen", scen, "--goldens", root)
    assert r.returncode == 1 and "tiny1: golden changed at" in r.stdout, r.stdout + r.stderr
    assert "  bit-identical to tiny1/" in r.stdout and "  the manifest differs in: info.note\n" in r.stdout
    assert "note" not in json.loads(manifest.read_text())["info"]
    # an unusable golden is named and replaced (written, not accepted)
    manifest.write_text("{ not json")
    r = parity("golden", "regen", scen, "--goldens", root)
    assert r.returncode == 1 and "tiny1: replacing an unusable golden (" in r.stdout, r.stdout + r.stderr
    assert "tiny1: golden created at" in r.stdout and accept in r.stdout
    assert json.loads(manifest.read_text())["info"]["recorded_by"] == "parity golden regen"
    r = parity("golden", "check", scen, "--goldens", root, "--steps", "2", "--out", tmp_path / "o")
    assert r.returncode == 0 and "tiny1[steps=2]: golden pass" in r.stdout, r.stdout + r.stderr
    # a one-ULP bump of the first Muon master after step 1's update; the golden stores step 1? no:
    # it stores steps 0 and 3, so the run (4 steps) compares element by element at step 3 too.
    run = tmp_path / "run"
    r = parity("run", scen, "--goldens", root, "--out", run, "--quiet", "--inject", "ulp:3:optimizer:*")
    assert r.returncode == 1, r.stdout + r.stderr
    master = "layers.0.attn.qkv.weight.master"
    assert f"first difference at step 3 / optimizer / {master} / rank 0 (digest, 1 of 49152 elements, " \
           "max 1 ULP)" in r.stdout
    t = parity("triage", run, "--against", "golden", "--goldens", root)
    assert t.returncode == 1, t.stdout + t.stderr
    assert f"first divergence at step 3 / optimizer / {master} / rank 0 (1 element, max 1 ULP)" in t.stdout
    files = {p.name for p in (run / "triage").iterdir()}
    assert {"triage.md", "divergences.csv", "per_step_phase.csv"} <= files and any(f.endswith(".png") for f in files)
    rows = (run / "triage" / "divergences.csv").read_text().splitlines()
    assert any(f",3,optimizer,4,0,{master}," in row and ",1,49152," in row for row in rows), rows[:3]


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="lists CUDA scenarios as skipped on a CPU-only machine")
def test_golden_check_skips_what_this_machine_cannot_run(tmp_path):
    r = parity("golden", "check", "--device", "cuda", "--out", tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "cuda-blockwise-dense-w1-overlap-off: skipped (needs CUDA)" in r.stdout
    n = r.stdout.count(": skipped (needs CUDA)")
    assert n >= 11 and f"0 run, {n} skipped, all pass" in r.stdout
    # a golden whose scenario is gone fails the check of every scenario (not of named ones)
    root = tmp_path / "g"
    write(root, make_scenario({"name": "gone", "world": 2, "steps": 4, "golden_tensor_steps": [0, -1]}))
    r = parity("golden", "check", "--device", "cuda", "--goldens", root, "--out", tmp_path / "o")
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"gone: unused golden (no such scenario); remove {root / 'gone'}" in r.stdout
    assert r.stdout.rstrip().endswith(f"0 run, {n} skipped, see above")


@pytest.mark.parametrize("gpus,world,why", [(0, 1, "needs CUDA"), (1, 2, "needs 2 GPUs (1 visible)"), (2, 2, None),
                                            (4, 2, None)])
def test_a_cuda_scenario_is_runnable_with_a_gpu_per_rank(monkeypatch, gpus, world, why):
    from parity.harness import goldens_cli

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    s = make_scenario({"name": "c", "world": world, "device": "cuda"})
    assert goldens_cli.why_not_runnable(s) == why
    assert goldens_cli.why_not_runnable(make_scenario({"name": "c", "world": world})) is None  # CPU: always
