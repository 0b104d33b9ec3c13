"""`parity diff A B`: per-tensor comparison of two snapshot files or directories; exit 0/1/2."""

from __future__ import annotations

import io
import shutil

import pytest
import torch

from parity.cli import main
from parity.harness.diff import diff_command, diff_dirs, diff_files, diff_paths
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


def test_tensors_on_one_side_only_are_the_only_difference(snap, tmp_path, capsys):
    t, md = read_snapshot(snap)
    del t["B/forward/loss"]
    t["A/init/extra.master"] = torch.zeros(2)
    other = tmp_path / "b.safetensors"
    write_snapshot(other, t, md)
    assert diff_command(str(snap), str(other)) == 1
    out = capsys.readouterr().out.splitlines()
    assert "B/forward/loss: only in A (torch.float32, shape (1,))" in out
    assert "A/init/extra.master: only in B (torch.float32, shape (2,))" in out
    assert out[-1] == "DIFFER: 5 tensors compared, 5 equal, 0 differ, 1 only in A, 1 only in B"


def test_lines_follow_side_then_the_phases_dataflow_order(tmp_path):
    """A's tensors before B's; within a side init, forward, ..., param_sync (not alphabetical:
    init would come after grad_reduce, optimizer before param_sync only by luck)."""
    names = ["B/forward/loss", "A/param_sync/w", "A/optimizer/w.master", "A/init/w.master", "A/forward/loss",
             "A/grad_reduce/w"]
    p = tmp_path / "s.safetensors"
    write_snapshot(p, {n: torch.zeros(1) for n in names})
    out = io.StringIO()
    assert diff_files(str(p), str(p), out=out).ok  # the API takes str paths too
    order = [line.split(":")[0] for line in out.getvalue().splitlines()]
    assert order == ["A/init/w.master", "A/forward/loss", "A/grad_reduce/w", "A/optimizer/w.master",
                     "A/param_sync/w", "B/forward/loss"]
    # a golden record's tensor files name tensors without a side: the phase order still holds
    g = tmp_path / "tensors_step_00000.safetensors"
    write_snapshot(g, {n: torch.zeros(1) for n in ("forward/loss", "init/w.master")})
    out = io.StringIO()
    assert diff_files(g, g, out=out).ok
    assert [line.split(":")[0] for line in out.getvalue().splitlines()] == ["init/w.master", "forward/loss"]


def test_the_file_api_names_the_side_of_a_bad_path(snap, tmp_path):
    with pytest.raises(SnapshotError, match=r"^B: .*nope.safetensors not found"):
        diff_files(snap, tmp_path / "nope.safetensors")
    with pytest.raises(SnapshotError, match=r"^A: .* is not a regular file"):
        diff_files(tmp_path, snap)


def test_a_file_only_in_b_is_a_difference(snap, tmp_path):
    a, b = snap.parent, tmp_path / "b"
    b.mkdir()
    shutil.copy(snap, b / snap.name)
    shutil.copy(snap, b / "step_00004_rank_000.safetensors")
    out = io.StringIO()
    res = diff_dirs(str(a), str(b), out=out)  # str paths, as the API allows
    assert not res.ok and res.only_b == ["step_00004_rank_000.safetensors"]
    assert "step_00004_rank_000.safetensors: file only in B" in out.getvalue().splitlines()
    assert res.summary() == "DIFFER: 6 tensors compared, 6 equal, 0 differ, 1 only in B"
