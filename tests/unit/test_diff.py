"""`parity diff A B`: per-tensor comparison of two snapshot files or directories; exit 0/1/2."""

from __future__ import annotations

import shutil

import pytest
import torch

from parity.cli import main
from parity.harness.diff import diff_command, diff_paths
from parity.harness.errors import SnapshotError, UsageError
from parity.harness.snapshot import read_snapshot, write_snapshot


def _capture(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "A/forward/loss": torch.tensor([2.5]),
        "A/grad_reduce/layers.0.attn.qkv.weight": torch.randn(24, 8, generator=g),
        "A/param_sync/layers.0.attn.qkv.weight.fp8.rowwise_data": torch.randint(0, 120, (24, 8), dtype=torch.uint8,
                                                                                generator=g),
        "B/forward/loss": torch.tensor([2.5]),
        "B/optimizer/layers.0.attn_norm.weight.master": torch.randn(16, generator=g),
        "B/param_sync/layers.0.attn_norm.weight": torch.randn(16, generator=g).to(torch.bfloat16),
    }


@pytest.fixture
def snap(tmp_path):
    p = tmp_path / "a" / "step_00003_rank_000.safetensors"
    write_snapshot(p, _capture(), {"step": "3"})
    return p


def _flip_one_bit(src, dst, key, index=5, bit=0):
    t, md = read_snapshot(src)
    flat = t[key].view(-1).view(torch.int32)
    flat[index] ^= 1 << bit
    write_snapshot(dst, t, md)


def test_equal_files_exit_0(snap, tmp_path, capsys):
    other = tmp_path / "b.safetensors"
    shutil.copy(snap, other)
    assert main(["diff", str(snap), str(other)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(_capture()) + 1  # one line per tensor, then the summary
    assert all(": equal (" in line for line in out[:-1])
    assert out[-1].startswith("EQUAL: 6 tensors compared")


def test_one_flipped_bit_exit_1_names_the_tensor(snap, tmp_path, capsys):
    key = "A/grad_reduce/layers.0.attn.qkv.weight"
    other = tmp_path / "b.safetensors"
    _flip_one_bit(snap, other, key)
    assert main(["diff", str(snap), str(other)]) == 1
    out = capsys.readouterr().out.splitlines()
    bad = [line for line in out if ": equal (" not in line and not line.startswith(("EQUAL", "DIFFER"))]
    assert len(bad) == 1 and bad[0].startswith(key + ": 1 of 192 elements differ")
    assert "max 1 ULP" in bad[0] and "hist {0: 191, 1: 1}" in bad[0] and "first at (0, 5)" in bad[0]
    assert out[-1] == "DIFFER: 6 tensors compared, 5 equal, 1 differ"


def test_missing_tensor_and_dtype_change_are_differences(snap, tmp_path, capsys):
    t, md = read_snapshot(snap)
    del t["B/forward/loss"]
    t["A/forward/loss"] = t["A/forward/loss"].double()
    other = tmp_path / "b.safetensors"
    write_snapshot(other, t, md)
    assert diff_command(str(snap), str(other)) == 1
    out = capsys.readouterr().out
    assert "B/forward/loss: only in A" in out
    assert "A/forward/loss: dtype differs: torch.float32 vs torch.float64" in out


def test_raw_fp8_bytes_compared_bitwise(snap, tmp_path, capsys):
    t, md = read_snapshot(snap)
    t["A/param_sync/layers.0.attn.qkv.weight.fp8.rowwise_data"].view(-1)[7] += 1
    other = tmp_path / "b.safetensors"
    write_snapshot(other, t, md)
    assert diff_command(str(snap), str(other)) == 1
    assert "A/param_sync/layers.0.attn.qkv.weight.fp8.rowwise_data: 1 of 192 elements differ" in capsys.readouterr().out


def test_directories_pair_files_by_name(snap, tmp_path, capsys):
    a, b = snap.parent, tmp_path / "b"
    write_snapshot(a / "step_00004_rank_000.safetensors", _capture(1))
    b.mkdir()
    shutil.copy(a / "step_00004_rank_000.safetensors", b / "step_00004_rank_000.safetensors")
    _flip_one_bit(snap, b / snap.name, "B/optimizer/layers.0.attn_norm.weight.master", index=2, bit=3)
    assert main(["diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out.splitlines()
    bad = [line for line in out if ": equal (" not in line]
    assert bad[0].startswith("step_00003_rank_000.safetensors:B/optimizer/layers.0.attn_norm.weight.master: "
                             "1 of 16 elements differ")
    assert "max 8 ULP" in bad[0]
    assert bad[-1] == "DIFFER: 12 tensors compared in 2 file pairs, 11 equal, 1 differ"
    # identical directories
    shutil.copy(snap, b / snap.name)
    assert main(["diff", str(a), str(b)]) == 0
    # a file on one side only is a difference
    (b / snap.name).unlink()
    assert main(["diff", str(a), str(b)]) == 1
    assert "step_00003_rank_000.safetensors: file only in A" in capsys.readouterr().out


@pytest.mark.parametrize("case", ["missing", "not-safetensors", "truncated", "empty", "file-vs-dir", "empty-dirs"])
def test_bad_input_exit_2_with_a_clean_message(case, snap, tmp_path, capsys):
    b = tmp_path / "b.safetensors"
    if case == "missing":
        args = [str(snap), str(tmp_path / "nope.safetensors")]
        want = "not found"
    elif case == "not-safetensors":
        b.write_text("this is not a safetensors file\n")
        args, want = [str(snap), str(b)], "truncated or corrupt"
    elif case == "truncated":
        b.write_bytes(snap.read_bytes()[: snap.stat().st_size - 100])
        args, want = [str(b), str(snap)], "truncated or corrupt"
    elif case == "empty":
        b.write_bytes(b"")
        args, want = [str(snap), str(b)], "truncated or corrupt"
    elif case == "file-vs-dir":
        args, want = [str(snap), str(tmp_path)], "cannot compare a file"
    else:
        (tmp_path / "x").mkdir()
        (tmp_path / "y").mkdir()
        args, want = [str(tmp_path / "x"), str(tmp_path / "y")], "holds a .safetensors file"
    assert main(["diff", *args]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # (a usage line may come first for usage errors)
    assert last.startswith("parity: ") and want in last
    assert "Traceback" not in err


def test_api_raises_parity_errors(snap, tmp_path):
    with pytest.raises(SnapshotError):
        diff_paths(snap, tmp_path / "missing")
    with pytest.raises(UsageError):
        diff_paths(snap, tmp_path)
