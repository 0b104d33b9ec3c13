"""Snapshots: exact round trips, atomic writes, clean errors on damaged files."""

from __future__ import annotations

import hashlib
import json
import os
import struct

import pytest
import safetensors.torch
import torch

import parity.harness.snapshot as snap
from parity.harness.compare import compare_tensors
from parity.harness.errors import ParityError, SnapshotError, UsageError
from parity.harness.snapshot import (
    parse_snapshot_filename,
    read_snapshot,
    read_snapshot_metadata,
    snapshot_filename,
    tensor_sha256,
    write_snapshot,
)


def _header(path) -> dict:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n))


def _capture() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    buf = torch.randn(256, generator=g)
    return {
        "forward/loss": torch.tensor(2.5),
        "grad_reduce/w": buf[:64].view(8, 8),  # views into one shared buffer
        "grad_reduce/w_t": buf[:64].view(8, 8).t(),  # overlapping, non-contiguous
        "grad_reduce/strided": buf[::3],
        "optimizer/w.bf16": buf[64:128].bfloat16(),
        "param_sync/w.fp16": buf[:10].half(),
        "param_sync/w.fp64": buf[:10].double(),
        "param_sync/w.e4m3": buf[128:160].to(torch.float8_e4m3fn),
        "param_sync/w.e5m2": buf[128:160].to(torch.float8_e5m2),
        "param_sync/w.scale_e8m0": torch.tensor([0.25, 1.0, 8.0]).to(torch.float8_e8m0fnu),
        "param_sync/w.fp8.rowwise_data": buf[160:192].to(torch.float8_e4m3fn).view(torch.uint8),
        "param_sync/mask": buf[:16] > 0,
        "param_sync/idx": torch.arange(5, dtype=torch.int64),
        "param_sync/empty": torch.empty(0, 3),
        "forward/signed_zero_nan": torch.tensor([-0.0, float("nan"), float("-inf")]),
    }


def test_snapshot_filename():
    assert snapshot_filename(12, 3) == "step_00012_rank_003.safetensors"
    assert parse_snapshot_filename("/x/step_00012_rank_003.safetensors") == (12, 3)
    assert parse_snapshot_filename("step_123456_rank_1000.safetensors") == (123456, 1000)
    assert parse_snapshot_filename("manifest.json") is None
    with pytest.raises(UsageError):
        snapshot_filename(-1, 0)


def test_round_trip_is_bit_exact(tmp_path, umask):
    cap = _capture()
    path = write_snapshot(tmp_path / "s" / snapshot_filename(1, 0), cap, {"scenario": "tiny", "step": "1"})
    tensors, md = read_snapshot(path)
    assert md == {"scenario": "tiny", "step": "1"}
    assert set(tensors) == set(cap)
    for k, v in cap.items():
        assert tensors[k].dtype == v.dtype and tensors[k].shape == v.shape, k
        assert tensors[k].is_contiguous()
        assert compare_tensors(v, tensors[k], k).equal, k  # bits, incl. -0 and NaN payload
    assert read_snapshot_metadata(path) == md
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask  # as a plain write makes it (not mkstemp's 0600)
    again = write_snapshot(str(tmp_path / "s" / snapshot_filename(2, 0)), cap)  # a str path as well as a Path
    assert again == tmp_path / "s" / snapshot_filename(2, 0) and set(read_snapshot(again)[0]) == set(cap)


def test_float8_is_stored_as_its_own_dtype_and_raw_bytes_stay_uint8(tmp_path):
    path = write_snapshot(tmp_path / "f.safetensors", _capture())
    h = _header(path)
    assert h["param_sync/w.e4m3"]["dtype"] == "F8_E4M3"
    assert h["param_sync/w.e5m2"]["dtype"] == "F8_E5M2"
    assert h["param_sync/w.fp8.rowwise_data"]["dtype"] == "U8"
    assert h["optimizer/w.bf16"]["dtype"] == "BF16"


def test_views_are_cloned_not_shared(tmp_path):
    buf = torch.arange(16, dtype=torch.float32)
    cap = {"a": buf[:8], "b": buf[4:12], "c": buf.view(4, 4).t()}
    with pytest.raises(Exception):  # safetensors itself refuses shared storage
        safetensors.torch.save_file(cap, str(tmp_path / "raw.safetensors"))
    path = write_snapshot(tmp_path / "v.safetensors", cap)
    buf.zero_()  # later changes to the source do not matter
    tensors, _ = read_snapshot(path)
    assert tensors["b"].tolist() == list(range(4, 12))
    assert tensors["c"][0].tolist() == [0.0, 4.0, 8.0, 12.0]


def test_only_what_safetensors_cannot_take_is_copied(tmp_path, monkeypatch):
    """A step's tensors can be gigabytes: a contiguous CPU tensor that owns its storage is written
    as it is; a view, and a second key naming the same tensor (a tied weight), are copied."""
    copied = []
    real = snap.to_cpu_contiguous
    monkeypatch.setattr(snap, "to_cpu_contiguous", lambda t: copied.append(t) or real(t))
    own, base = torch.arange(8, dtype=torch.float32), torch.arange(16, dtype=torch.float32)
    path = write_snapshot(tmp_path / "c.safetensors", {"own": own, "tied": own, "view": base[2:6]})
    assert [t.data_ptr() for t in copied] == [own.data_ptr(), base.data_ptr() + 8]  # the tie, the view
    tensors, _ = read_snapshot(path)
    assert tensors["tied"].tolist() == own.tolist() and tensors["view"].tolist() == [2.0, 3.0, 4.0, 5.0]


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open files through /proc")
def test_writing_leaves_no_file_open(tmp_path):
    before = len(os.listdir("/proc/self/fd"))
    for i in range(20):
        write_snapshot(tmp_path / f"s{i}.safetensors", {"x": torch.zeros(2)})
    assert len(os.listdir("/proc/self/fd")) == before


def test_read_returns_private_copies(tmp_path):
    path = write_snapshot(tmp_path / "p.safetensors", {"x": torch.arange(100, dtype=torch.float32)})
    tensors, _ = read_snapshot(path)
    with open(path, "r+b") as f:  # overwrite the data region in place
        f.seek(-8, os.SEEK_END)
        f.write(b"\xff" * 8)
    assert tensors["x"][-2:].tolist() == [98.0, 99.0]


def test_metadata_validation(tmp_path):
    t = {"x": torch.ones(2)}
    with pytest.raises(UsageError, match="str to str") as e:
        write_snapshot(tmp_path / "m.safetensors", t, {"step": 3})
    assert e.value.exit_code == 2
    with pytest.raises(UsageError, match="reserved"):
        write_snapshot(tmp_path / "m.safetensors", t, {"parity.snapshot.dtypes": "{}"})
    with pytest.raises(UsageError, match="no tensors"):
        write_snapshot(tmp_path / "m.safetensors", {})
    with pytest.raises(UsageError, match="not a torch.Tensor"):
        write_snapshot(tmp_path / "m.safetensors", {"x": [1.0]})
    with pytest.raises(UsageError, match="reserved"):
        write_snapshot(tmp_path / "m.safetensors", {"__metadata__": torch.ones(1)})
    assert not list(tmp_path.iterdir())


def test_write_is_atomic_and_leaves_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "a.safetensors"
    write_snapshot(path, {"x": torch.ones(4)}, {"v": "1"})
    write_snapshot(path, {"x": torch.zeros(4)}, {"v": "2"})  # replace
    assert read_snapshot(path)[1] == {"v": "2"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]

    def boom(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(snap.safetensors.torch, "save_file", boom)
    with pytest.raises(KeyboardInterrupt):
        write_snapshot(path, {"x": torch.full((4,), 7.0)}, {"v": "3"})
    tensors, md = read_snapshot(path)  # the previous file is untouched
    assert md == {"v": "2"} and tensors["x"].tolist() == [0.0] * 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]


def test_write_error_is_a_clean_parity_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(SnapshotError) as e:
        write_snapshot(blocker / "sub" / "s.safetensors", {"x": torch.ones(1)})
    assert e.value.exit_code == 2 and "cannot write snapshot" in str(e.value) and str(blocker) in str(e.value)


@pytest.mark.parametrize(
    "damage",
    ["missing", "empty", "truncated_data", "truncated_header", "garbage", "directory"],
)
def test_damaged_files_give_a_clean_error(tmp_path, damage):
    path = tmp_path / "d.safetensors"
    write_snapshot(path, {"x": torch.arange(1000, dtype=torch.float32)}, {"k": "v"})
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "truncated_data":
        path.write_bytes(data[:-100])
    elif damage == "truncated_header":
        path.write_bytes(data[:20])
    elif damage == "garbage":
        path.write_bytes(b"\x00\x01garbage" * 50)
    elif damage == "directory":
        path.unlink()
        path.mkdir()
    with pytest.raises(SnapshotError) as e:
        read_snapshot(path)
    assert isinstance(e.value, ParityError) and e.value.exit_code == 2
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(SnapshotError):
        read_snapshot_metadata(path)


def test_read_subset_and_missing_key(tmp_path):
    path = write_snapshot(tmp_path / "k.safetensors", {"a": torch.ones(1), "b": torch.zeros(1)})
    tensors, _ = read_snapshot(path, keys=["b"])
    assert list(tensors) == ["b"]
    with pytest.raises(SnapshotError, match="no tensor 'c'"):
        read_snapshot(path, keys=["c"])


def test_tensors_come_back_in_the_order_they_were_written(tmp_path):
    """safetensors stores a file's tensors sorted by name; the writer records the order it was
    handed (a run's: the order the stack produced them) and the reader restores it. A file
    without that record (any other writer) reads in its own order, as does one whose record does
    not name its tensors."""
    order = ["forward/z", "forward/a", "forward/m"]
    path = write_snapshot(tmp_path / "o.safetensors", {k: torch.ones(1) for k in order}, {"note": "x"})
    assert list(read_snapshot(path)[0]) == order
    assert read_snapshot_metadata(path) == {"note": "x"}  # the record is not user metadata
    plain = tmp_path / "plain.safetensors"
    safetensors.torch.save_file({k: torch.ones(1) for k in order}, str(plain))
    assert list(read_snapshot(plain)[0]) == sorted(order)
    odd = tmp_path / "odd.safetensors"
    safetensors.torch.save_file({k: torch.ones(1) for k in order}, str(odd),
                                metadata={"parity.snapshot.order": json.dumps(["forward/z"])})
    assert list(read_snapshot(odd)[0]) == sorted(order)


def test_unsupported_dtype_falls_back_to_an_integer_view(tmp_path, monkeypatch):
    real = snap._safetensors_supports
    monkeypatch.setattr(snap, "_safetensors_supports", lambda dt: dt != torch.bfloat16 and real(dt))
    x = torch.randn(8).bfloat16()
    path = write_snapshot(tmp_path / "fb.safetensors", {"x": x}, {"k": "v"})
    assert _header(path)["x"]["dtype"] == "I16"
    tensors, md = read_snapshot(path)
    assert md == {"k": "v"}  # the reserved key is not shown
    assert tensors["x"].dtype == torch.bfloat16 and compare_tensors(x, tensors["x"], "x").equal


def test_tensor_sha256():
    x = torch.arange(12, dtype=torch.int32).view(3, 4)
    assert tensor_sha256(x) == hashlib.sha256(struct.pack("<12i", *range(12))).hexdigest()
    assert tensor_sha256(x.t()) == tensor_sha256(x.t().contiguous())
    assert tensor_sha256(torch.empty(0)) == hashlib.sha256(b"").hexdigest()
    assert tensor_sha256(torch.tensor(0.0)) != tensor_sha256(torch.tensor(-0.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_round_trip(tmp_path):
    buf = torch.randn(64, device="cuda")
    cap = {"a": buf[:32].view(4, 8).t(), "b": buf.bfloat16(), "c": buf[:16].to(torch.float8_e4m3fn)}
    path = write_snapshot(tmp_path / "c.safetensors", cap)
    tensors, _ = read_snapshot(path, device="cuda")
    for k, v in cap.items():
        assert tensors[k].device.type == "cuda" and compare_tensors(v, tensors[k], k).equal
    assert tensor_sha256(cap["a"]) == tensor_sha256(cap["a"].cpu())
