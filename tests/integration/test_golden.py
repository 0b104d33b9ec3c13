"""Golden records: write/load/check, tamper detection, platform pinning, atomic replacement."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import parity.harness.golden as golden_mod
from parity.harness.errors import (
    ConfigError,
    GoldenError,
    GoldenExistsError,
    ParityError,
    RuntimeFailure,
    UsageError,
)
from parity.harness.golden import (
    GoldenChecker,
    GoldenRecorder,
    KeyRecord,
    LossRecord,
    check_against_golden,
    describe_golden,
    golden_inventory,
    list_goldens,
    load_golden,
    regen_golden,
)
from parity.harness.platform import (
    EXACT_MATCH_KEYS,
    fingerprint_diff,
    platform_fingerprint,
    platform_id,
)

STEPS = (1, 2, 3)
RANKS = (0, 1)

FP = {
    "device_kind": "cpu",
    "device_name": "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
    "torch": "2.13.0+cpu",
    "cuda": "none",
    "te": "none",
    "backend": "gloo",
    "python": "3.11.7",
    "machine": "x86_64",
    "os": "linux",
    "nccl": "none",
    "cudnn": "none",
}
PID = "cpu-intel-xeon-platinum-8481c-torch2.13.0"


def capture(step: int, rank: int, *, version: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * version + 10 * step + rank)
    buf = torch.randn(96, generator=g)
    return {
        "forward/loss": buf[0].clone() + 3.0,
        "forward/out": buf[:16].view(4, 4),
        "grad_reduce/decoder.0.mlp.fc1.weight": buf[16:48].view(4, 8).bfloat16(),
        "optimizer/decoder.0.mlp.fc1.weight": buf[16:48].view(4, 8),
        "param_sync/decoder.0.mlp.fc1.weight.fp8.rowwise_data": buf[48:80].to(torch.float8_e4m3fn).view(torch.uint8),
        "param_sync/decoder.0.mlp.fc1.weight.fp8.scale_inv": buf[80:84].abs().to(torch.float8_e8m0fnu),
    }


def record(root: Path, *, store_tensors: bool = True, version: int = 0, fp=FP, overwrite=False) -> Path:
    rec = GoldenRecorder("tiny", "cfg-v1", fp, store_tensors=store_tensors, info={"git": "abc123"})
    for s in STEPS:
        for r in RANKS:
            rec.add(s, r, capture(s, r, version=version))
    return rec.write(root, overwrite=overwrite)


def assert_passes(g, version: int = 0):
    checker = GoldenChecker(g)
    for s in STEPS:
        for r in RANKS:
            assert checker.check(s, r, capture(s, r, version=version)) == []
    assert checker.unused() == []


# ----------------------------------------------------------------------------------------------
# errors and platform
# ----------------------------------------------------------------------------------------------


def test_exit_codes():
    assert UsageError("x").exit_code == 2
    assert ConfigError("x").exit_code == 2
    assert GoldenError("x").exit_code == 2
    assert RuntimeFailure("x").exit_code == 3
    assert ParityError("x", exit_code=5).exit_code == 5
    assert issubclass(GoldenExistsError, GoldenError)


def test_platform_fingerprint_and_id():
    fp = platform_fingerprint("cpu")
    assert set(EXACT_MATCH_KEYS) <= set(fp) and all(isinstance(v, str) for v in fp.values())
    assert fp["device_kind"] == "cpu" and fp["backend"] == "gloo" and fp["torch"] == torch.__version__
    pid = platform_id(fp)
    assert pid.startswith("cpu-") and "torch" in pid
    assert all(c.isalnum() or c in "-." for c in pid) and len(pid) <= 80
    assert platform_id(FP) == PID
    cuda = dict(FP, device_kind="cuda", device_name="NVIDIA H200", torch="2.11.0+cu130", cuda="13.0", backend="nccl")
    assert platform_id(cuda) == "cuda-nvidia-h200-torch2.11.0-cu13.0"
    assert platform_id(dict(cuda, te="2.3.0+abc")) == "cuda-nvidia-h200-torch2.11.0-cu13.0-te2.3.0"
    assert platform_id(dict(FP, backend="mpi")).endswith("-mpi")
    with pytest.raises(UsageError):
        platform_fingerprint("mps")


def test_fingerprint_diff_rules():
    assert fingerprint_diff(FP, dict(FP, python="3.12.0", os="darwin")) == {}  # informative only
    assert fingerprint_diff(FP, dict(FP, torch="2.13.0")) == {}  # local build tag ignored
    assert fingerprint_diff(FP, dict(FP, te="2.3.0")) == {}  # TE has no CPU kernels
    assert set(fingerprint_diff(FP, dict(FP, device_name="AMD EPYC 9654"))) == {"device_name"}
    cuda = dict(FP, device_kind="cuda", device_name="NVIDIA H200", cuda="13.0", backend="nccl")
    assert set(fingerprint_diff(cuda, dict(cuda, te="2.3.0"))) == {"te"}
    assert set(fingerprint_diff(cuda, dict(cuda, cuda="12.9"))) == {"cuda"}


# ----------------------------------------------------------------------------------------------
# write / load / check
# ----------------------------------------------------------------------------------------------


def test_write_load_check_pass(tmp_path):
    path = record(tmp_path)
    assert path == tmp_path / "tiny" / PID
    names = sorted(p.name for p in path.iterdir())
    assert names == ["manifest.json"] + [f"step_0000{s}_rank_00{r}.safetensors" for s in STEPS for r in RANKS]
    g = load_golden(tmp_path, "tiny", PID, platform=FP, scenario_fingerprint="cfg-v1")
    assert g.steps == [1, 2, 3] and g.ranks == [0, 1] and g.store_tensors
    assert_passes(g)
    m = json.loads((path / "manifest.json").read_text())
    assert m["format_version"] == 1 and m["platform"] == FP and m["info"] == {"git": "abc123"}
    loss = m["records"]["2"]["ranks"]["1"]["loss"]
    expected = capture(2, 1)["forward/loss"]
    assert loss["hex"] == f"0x{expected.view(torch.int32).item() & 0xFFFFFFFF:08x}"
    assert float(loss["repr"]) == expected.item()
    entry = m["records"]["1"]["ranks"]["0"]["tensors"]["param_sync/decoder.0.mlp.fc1.weight.fp8.rowwise_data"]
    assert entry["dtype"] == "uint8" and entry["shape"] == [32] and len(entry["sha256"]) == 64
    assert set(m["files"]) == {f"step_0000{s}_rank_00{r}.safetensors" for s in STEPS for r in RANKS}
    assert any("loss" in line for line in describe_golden(g))


def test_digest_only_golden(tmp_path):
    path = record(tmp_path, store_tensors=False)
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json"]
    g = load_golden(tmp_path, "tiny", PID, platform=FP)
    assert_passes(g)
    bad = capture(1, 0)
    bad["optimizer/decoder.0.mlp.fc1.weight"].view(torch.int32)[2, 3] ^= 1
    (m,) = check_against_golden(g, 1, 0, bad)
    assert m.kind == "digest" and m.path == "step 1/optimizer/decoder.0.mlp.fc1.weight/rank 0"
    # the same through precomputed records (as sent by a rank)
    checker = GoldenChecker(g)
    recs = {k: KeyRecord.from_tensor(v) for k, v in bad.items()}
    (m2,) = checker.check_digests(1, 0, recs, loss=LossRecord.from_tensor(bad["forward/loss"]))
    assert m2.kind == "digest"


def test_refuses_to_overwrite(tmp_path):
    record(tmp_path)
    with pytest.raises(GoldenExistsError) as e:
        record(tmp_path, version=1)
    assert e.value.exit_code == 2
    assert_passes(load_golden(tmp_path, "tiny", PID))
    record(tmp_path, version=1, overwrite=True)
    assert_passes(load_golden(tmp_path, "tiny", PID), version=1)


def test_planted_bit_flip_is_localized(tmp_path):
    record(tmp_path)
    g = load_golden(tmp_path, "tiny", PID)
    bad = capture(2, 1)
    bad["grad_reduce/decoder.0.mlp.fc1.weight"].view(torch.int16)[3, 5] ^= 1
    (m,) = check_against_golden(g, 2, 1, bad)
    assert m.kind == "values" and m.diff is not None
    assert m.diff.n_diff == 1 and m.diff.first_index == (3, 5) and m.diff.max_ulp == 1
    assert m.message.startswith("step 2/grad_reduce/decoder.0.mlp.fc1.weight/rank 1: 1 of 32 elements differ")


def test_loss_bits_and_key_sets(tmp_path):
    record(tmp_path)
    g = load_golden(tmp_path, "tiny", PID)
    bad = capture(1, 0)
    bad["forward/loss"] = torch.tensor(float.fromhex(bad["forward/loss"].double().item().hex())).float()
    assert check_against_golden(g, 1, 0, bad) == []  # same bits
    bad["forward/loss"].view(torch.int32).add_(1)
    (m,) = check_against_golden(g, 1, 0, bad)
    assert m.kind == "loss" and "vs golden" in m.message

    cap = capture(1, 0)
    del cap["forward/out"]
    cap["forward/new"] = torch.ones(2)
    kinds = sorted(m.kind for m in check_against_golden(g, 1, 0, cap))
    assert kinds == ["extra_key", "missing_key"]

    cap = capture(1, 0)
    cap["optimizer/decoder.0.mlp.fc1.weight"] = cap["optimizer/decoder.0.mlp.fc1.weight"].double()
    cap["forward/out"] = cap["forward/out"].reshape(16)
    assert sorted(m.kind for m in check_against_golden(g, 1, 0, cap)) == ["dtype", "shape"]

    checker = GoldenChecker(g)
    assert [m.kind for m in checker.check(4, 0, capture(4, 0))] == ["step_not_in_golden"]
    assert [m.kind for m in checker.check(1, 2, capture(1, 2))] == ["rank_not_in_golden"]
    checker.check(1, 0, capture(1, 0))
    unused = checker.unused()
    assert len(unused) == 5 and {m.kind for m in unused} == {"unused"}
    assert checker.unused(steps=[1]) == [u for u in unused if u.path == "step 1/rank 1"]


# ----------------------------------------------------------------------------------------------
# damaged goldens
# ----------------------------------------------------------------------------------------------


def _manifest(path: Path) -> dict:
    return json.loads((path / "manifest.json").read_text())


def _save_manifest(path: Path, m: dict) -> None:
    (path / "manifest.json").write_text(json.dumps(m, indent=1))


def test_changed_manifest_digest_is_detected(tmp_path):
    # digest-only golden: the check fails
    path = record(tmp_path / "d", store_tensors=False)
    m = _manifest(path)
    entry = m["records"]["3"]["ranks"]["0"]["tensors"]["forward/out"]
    entry["sha256"] = "0" * 64
    _save_manifest(path, m)
    g = load_golden(tmp_path / "d", "tiny", PID)
    (mm,) = check_against_golden(g, 3, 0, capture(3, 0))
    assert mm.kind == "digest" and mm.path == "step 3/forward/out/rank 0"

    # golden with tensors: the stored tensor no longer matches its manifest entry
    path = record(tmp_path / "t")
    m = _manifest(path)
    m["records"]["3"]["ranks"]["0"]["tensors"]["forward/out"]["sha256"] = "0" * 64
    _save_manifest(path, m)
    g = load_golden(tmp_path / "t", "tiny", PID)
    with pytest.raises(GoldenError, match="modified after recording") as e:
        check_against_golden(g, 3, 0, capture(3, 0))
    assert e.value.exit_code == 2


def test_changed_tensor_byte_is_detected(tmp_path):
    path = record(tmp_path)
    f = path / "step_00002_rank_001.safetensors"
    data = bytearray(f.read_bytes())
    data[-3] ^= 0x01  # one byte in the data region
    f.write_bytes(bytes(data))
    with pytest.raises(GoldenError, match="does not match its manifest digest") as e:
        load_golden(tmp_path, "tiny", PID)
    assert e.value.exit_code == 2
    # without the up-front file check, the per-tensor digests still catch it
    # (they are read when a digest differs and the element-level detail is wanted)
    g = load_golden(tmp_path, "tiny", PID, verify_files=False)
    bad = capture(2, 1)
    bad["param_sync/decoder.0.mlp.fc1.weight.fp8.scale_inv"].view(torch.uint8)[0] ^= 1
    with pytest.raises(GoldenError, match="modified after recording"):
        check_against_golden(g, 2, 1, bad)


@pytest.mark.parametrize("damage", ["truncated", "missing", "garbage"])
def test_damaged_tensor_file(tmp_path, damage):
    path = record(tmp_path)
    f = path / "step_00001_rank_000.safetensors"
    if damage == "truncated":
        f.write_bytes(f.read_bytes()[:-10])
    elif damage == "missing":
        f.unlink()
    else:
        f.write_bytes(b"x" * f.stat().st_size)
    with pytest.raises(GoldenError) as e:
        load_golden(tmp_path, "tiny", PID)
    assert e.value.exit_code == 2 and "step_00001_rank_000.safetensors" in str(e.value)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: "{not json", "not valid JSON"),
        (lambda m: [], "top level"),
        (lambda m: {**m, "format": "other"}, "format"),
        (lambda m: {**m, "records": {}}, "records"),
        (lambda m: {**m, "platform": {"device_kind": 3}}, "platform"),
        (lambda m: {**m, "format_version": 99}, "newer"),
        (lambda m: {**m, "scenario": "other"}, "lives in"),
        (lambda m: {**m, "files": {}}, "not listed"),
    ],
)
def test_malformed_manifest_is_a_clean_error(tmp_path, edit, match):
    path = record(tmp_path)
    new = edit(_manifest(path))
    (path / "manifest.json").write_text(new if isinstance(new, str) else json.dumps(new))
    with pytest.raises(GoldenError, match=match) as e:
        load_golden(tmp_path, "tiny", PID)
    assert e.value.exit_code == 2 and "\n" not in str(e.value)


def test_missing_golden(tmp_path):
    with pytest.raises(GoldenError, match="no golden for scenario 'tiny'") as e:
        load_golden(tmp_path, "tiny", PID)
    assert e.value.exit_code == 2
    record(tmp_path)
    with pytest.raises(GoldenError, match=f"goldens exist for: {PID}"):
        load_golden(tmp_path, "tiny", "cuda-nvidia-h200-torch2.11.0-cu13.0")
    (tmp_path / "tiny" / PID / "manifest.json").unlink()
    with pytest.raises(GoldenError, match="incomplete"):
        load_golden(tmp_path, "tiny", PID)


def test_other_platform_is_refused_unless_allowed(tmp_path):
    record(tmp_path)
    other = dict(FP, device_name="AMD EPYC 9654 96-Core Processor")
    with pytest.raises(GoldenError, match="another platform.*device_name") as e:
        load_golden(tmp_path, "tiny", PID, platform=other)
    assert e.value.exit_code == 2
    newer = dict(FP, torch="2.14.0+cpu")
    with pytest.raises(GoldenError, match="torch"):
        load_golden(tmp_path, "tiny", PID, platform=newer)
    g = load_golden(tmp_path, "tiny", PID, platform=other, allow_other_platform=True)
    assert_passes(g)
    # informative fields do not matter
    load_golden(tmp_path, "tiny", PID, platform=dict(FP, python="3.13.1"))


def test_stale_scenario_fingerprint(tmp_path):
    record(tmp_path)
    with pytest.raises(GoldenError, match="stale"):
        load_golden(tmp_path, "tiny", PID, scenario_fingerprint="cfg-v2")


# ----------------------------------------------------------------------------------------------
# approx tier
# ----------------------------------------------------------------------------------------------


def test_approx_tier_requires_both_tolerances(tmp_path):
    record(tmp_path)
    g = load_golden(tmp_path, "tiny", PID)
    cap = capture(1, 0)
    for kwargs, match in [
        (dict(rtol=1e-3), "got rtol but not atol"),
        (dict(atol=1e-5), "got atol but not rtol"),
        (dict(), "needs both"),
        (dict(rtol=-1.0, atol=0.0), "rtol must be"),
    ]:
        with pytest.raises(UsageError, match=match) as e:
            check_against_golden(g, 1, 0, cap, tier="approx", **kwargs)
        assert e.value.exit_code == 2
    with pytest.raises(UsageError, match="exact tier takes no tolerances"):
        check_against_golden(g, 1, 0, cap, rtol=1e-3, atol=1e-5)
    with pytest.raises(UsageError, match="unknown tier"):
        check_against_golden(g, 1, 0, cap, tier="fuzzy")


def test_approx_tier(tmp_path):
    record(tmp_path)
    g = load_golden(tmp_path, "tiny", PID)
    cap = capture(1, 0)
    cap["optimizer/decoder.0.mlp.fc1.weight"].view(torch.int32).add_(3)  # a few ULP everywhere
    cap["forward/loss"].view(torch.int32).add_(1)
    assert len(check_against_golden(g, 1, 0, cap)) == 2  # exact: loss and tensor
    assert check_against_golden(g, 1, 0, cap, tier="approx", rtol=1e-5, atol=1e-6) == []
    cap["optimizer/decoder.0.mlp.fc1.weight"][1, 2] += 0.5
    (m,) = check_against_golden(g, 1, 0, cap, tier="approx", rtol=1e-5, atol=1e-6)
    assert m.kind == "values" and "1 of 32 elements outside" in m.message and "(1, 2)" in m.message
    # integer tensors (raw fp8 bytes) stay exact under approx
    cap = capture(1, 0)
    cap["param_sync/decoder.0.mlp.fc1.weight.fp8.rowwise_data"][0] ^= 1
    (m,) = check_against_golden(g, 1, 0, cap, tier="approx", rtol=0.5, atol=0.5)
    assert "rowwise_data" in m.path
    # the approx tier needs stored tensors
    record(tmp_path / "d", store_tensors=False)
    with pytest.raises(GoldenError, match="digests only"):
        check_against_golden(load_golden(tmp_path / "d", "tiny", PID), 1, 0, cap, tier="approx", rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------
# atomicity
# ----------------------------------------------------------------------------------------------


def _entries(root: Path) -> list[str]:
    return sorted(p.name for p in (root / "tiny").iterdir())


def test_crash_before_swap_keeps_old_golden(tmp_path, monkeypatch):
    record(tmp_path)

    def crash(staging, target):
        assert (staging / "manifest.json").is_file()  # fully staged
        raise KeyboardInterrupt

    monkeypatch.setattr(golden_mod, "_swap_into_place", crash)
    with pytest.raises(KeyboardInterrupt):
        record(tmp_path, version=1, overwrite=True)
    assert _entries(tmp_path) == [PID]
    assert_passes(load_golden(tmp_path, "tiny", PID))


def test_crash_after_partial_files_keeps_old_golden(tmp_path, monkeypatch):
    record(tmp_path)
    real = golden_mod.write_snapshot
    calls = []

    def flaky(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(golden_mod, "write_snapshot", flaky)
    with pytest.raises(GoldenError, match="No space left") as e:
        record(tmp_path, version=1, overwrite=True)
    assert e.value.exit_code == 2
    assert _entries(tmp_path) == [PID]
    assert_passes(load_golden(tmp_path, "tiny", PID))


def test_crash_between_fallback_renames_keeps_old_golden_readable(tmp_path, monkeypatch):
    record(tmp_path)
    monkeypatch.setattr(golden_mod, "_rename_exchange", lambda a, b: False)

    def crash():
        raise KeyboardInterrupt

    monkeypatch.setattr(golden_mod, "_between_renames", crash)
    with pytest.raises(KeyboardInterrupt):
        record(tmp_path, version=1, overwrite=True)
    assert not (tmp_path / "tiny" / PID).exists()  # the window: only the moved-aside copy
    g = load_golden(tmp_path, "tiny", PID)
    assert_passes(g)
    assert [r.platform_id for r in list_goldens(tmp_path)] == [PID]
    with pytest.raises(GoldenExistsError):
        record(tmp_path, version=1)
    # the next write puts things right
    monkeypatch.setattr(golden_mod, "_between_renames", lambda: None)
    record(tmp_path, version=1, overwrite=True)
    assert _entries(tmp_path) == [PID]
    assert_passes(load_golden(tmp_path, "tiny", PID), version=1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux-only")
def test_rename_exchange_swaps_directories(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x").write_text("a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("b")
    if not golden_mod._rename_exchange(tmp_path / "a", tmp_path / "b"):
        pytest.skip("filesystem without RENAME_EXCHANGE")
    assert (tmp_path / "a" / "x").read_text() == "b" and (tmp_path / "b" / "x").read_text() == "a"


def test_overwrite_swaps_cleanly(tmp_path):
    record(tmp_path)
    record(tmp_path, version=1, overwrite=True)
    assert _entries(tmp_path) == [PID]
    assert_passes(load_golden(tmp_path, "tiny", PID), version=1)


def test_sigkill_mid_write_keeps_old_golden(tmp_path):
    record(tmp_path)
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import parity.harness.golden as gm
        import test_golden as tg
        real = gm.write_snapshot
        n = [0]
        def killer(*a, **k):
            n[0] += 1
            if n[0] == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **k)
        gm.write_snapshot = killer
        tg.record(__import__("pathlib").Path({str(tmp_path)!r}), version=1, overwrite=True)
        """
    )
    pythonpath = os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=pythonpath)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    leftovers = [n for n in _entries(tmp_path) if n != PID]
    assert len(leftovers) == 1 and leftovers[0].startswith(f".{PID}.tmp-")
    assert_passes(load_golden(tmp_path, "tiny", PID))
    assert [r.platform_id for r in list_goldens(tmp_path)] == [PID]
    record(tmp_path, version=1, overwrite=True)  # cleans the dead writer's staging dir
    assert _entries(tmp_path) == [PID]


# ----------------------------------------------------------------------------------------------
# regen and inventory
# ----------------------------------------------------------------------------------------------


def _recorder(version: int, store_tensors: bool = True) -> GoldenRecorder:
    rec = GoldenRecorder("tiny", "cfg-v1", FP, store_tensors=store_tensors, info={"git": "abc123"})
    for s in STEPS:
        for r in RANKS:
            c = capture(s, r)
            if version and s >= 2:
                c["optimizer/decoder.0.mlp.fc1.weight"].view(torch.int32).add_(version)
                c["forward/loss"].view(torch.int32).add_(version)
            rec.add(s, r, c)
    return rec


def test_regen_fails_unless_accepted(tmp_path):
    res = regen_golden(_recorder(0), tmp_path)
    assert res.created and res.changed and res.status == "fail" and res.exit_code == 1
    assert "created" in res.message()
    res = regen_golden(_recorder(0), tmp_path)
    assert not res.changed and res.status == "pass"
    res = regen_golden(_recorder(1), tmp_path)
    assert res.changed and res.status == "fail"
    text = "\n".join(res.summary)
    assert "2 of 3 steps changed (first: step 2)" in text and "tensors changed 8" in text
    assert "ULP histogram over changed tensors: 0: 0, 1: 132, 2: 0" in text  # 4 x (32 + loss)
    assert "loss step 2" in text
    g = load_golden(tmp_path, "tiny", PID)
    assert check_against_golden(g, 2, 0, _recorder(1)._tensors[(2, 0)]) == []
    res = regen_golden(_recorder(2), tmp_path, accept=True)
    assert res.changed and res.status == "pass" and res.exit_code == 0


def test_inventory_missing_and_unused(tmp_path):
    record(tmp_path)
    inv = golden_inventory(tmp_path, PID, known_scenarios=["tiny", "moe"], selected=["tiny"])
    assert inv.ok and inv.missing == [] and inv.unused == []
    inv = golden_inventory(tmp_path, PID, known_scenarios=["tiny", "moe"])
    assert inv.missing == ["moe"] and not inv.ok
    inv = golden_inventory(tmp_path, "cuda-nvidia-h200-torch2.11.0-cu13.0", known_scenarios=["tiny"])
    assert inv.missing == ["tiny"] and inv.other_platforms == {"tiny": [PID]}
    assert "exists for" in inv.messages()[0]
    inv = golden_inventory(tmp_path, PID, known_scenarios=["moe"], selected=[])
    assert [r.scenario for r in inv.unused] == ["tiny"] and "unused golden" in inv.messages()[0]
    assert list_goldens(tmp_path / "nowhere") == []


def test_recorder_validation(tmp_path):
    with pytest.raises(UsageError, match="scenario name"):
        GoldenRecorder("../evil", "x", FP)
    with pytest.raises(UsageError, match="lacks"):
        GoldenRecorder("tiny", "x", {"device_kind": "cpu"})
    rec = GoldenRecorder("tiny", "x", FP)
    with pytest.raises(UsageError, match="nothing recorded"):
        rec.write(tmp_path)
    rec.add(1, 0, capture(1, 0))
    with pytest.raises(UsageError, match="twice"):
        rec.add(1, 0, capture(1, 0))
    with pytest.raises(UsageError, match="empty capture"):
        rec.add(2, 0, {})
    with pytest.raises(UsageError, match="full sha256"):
        rec.add_digests(2, 0, {"forward/x": KeyRecord("float32", (1,), "abc")})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_captures(tmp_path):
    record(tmp_path)
    g = load_golden(tmp_path, "tiny", PID)
    cap = {k: v.cuda() for k, v in capture(1, 1).items()}
    assert check_against_golden(g, 1, 1, cap) == []
    cap["optimizer/decoder.0.mlp.fc1.weight"].view(torch.int32)[0, 1] ^= 1
    (m,) = check_against_golden(g, 1, 1, cap)
    assert m.diff.first_index == (0, 1) and m.diff.max_ulp == 1
    assert check_against_golden(g, 1, 1, cap, tier="approx", rtol=1e-6, atol=0.0) == []
