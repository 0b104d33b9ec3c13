"""Our quantizer against TransformerEngine reference outputs, bit for bit.

The vectors live in the repository (tests/assets/te_reference_vectors.safetensors; what they are and
how they were made: tests/assets/README.md). A missing file is a failure, never a skip.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from parity.fp8 import quantize

# tests/assets, found from this file's folder upwards so the test may sit in tests/ or a subfolder
TESTS_DIR = next(p for p in Path(__file__).resolve().parents if p.name == "tests")
VECTORS = TESTS_DIR / "assets" / "te_reference_vectors.safetensors"


def _load():
    if not VECTORS.is_file():
        raise FileNotFoundError(f"TE reference vectors missing: {VECTORS} (see tests/assets/README.md)")
    with safe_open(str(VECTORS), framework="pt") as f:
        cases = json.loads(f.metadata()["cases"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    return cases, tensors


CASES, TENSORS = _load()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view for exact comparison (never == on floats)."""
    if t.dtype == torch.float32:
        return t.contiguous().view(torch.int32)
    assert t.dtype == torch.uint8, t.dtype
    return t


def _assert_same(name: str, got: torch.Tensor, ref: torch.Tensor):
    assert tuple(got.shape) == tuple(ref.shape), f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert got.dtype == ref.dtype, f"{name}: dtype {got.dtype} != {ref.dtype}"
    diff = _bits(got) != _bits(ref)
    n = int(diff.sum())
    assert n == 0, f"{name}: {n} of {diff.numel()} elements differ (first at {diff.nonzero()[0].tolist()})"


def test_vectors_file_has_cases():
    recipes = {c["recipe"] for c in CASES}
    assert recipes == {"blockwise", "mxfp8"}
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", CASES, ids=[c["id"] for c in CASES])
def test_matches_te_reference(case):
    x = TENSORS[case["input"]]
    cid = case["id"]
    if case["recipe"] == "blockwise":
        q = quantize(x, "blockwise", block=case["block"], fp8_dtype=case["fp8_dtype"],
                     pow2_scales=case["pow2_scales"], eps=case["eps"])
        M, K = x.shape
        Mb, Kb = -(-M // 128), -(-K // 128)
        for part in ("rowwise_data", "columnwise_data"):
            _assert_same(f"{cid}.{part}", getattr(q, part), TENSORS[f"{cid}.{part}"])
        # scale grids: the valid region must match exactly; the file's padding is zero and so is ours
        valid = {
            ("1x128", "rowwise_scale_inv"): (Kb, M),
            ("1x128", "columnwise_scale_inv"): (Mb, K),
            ("128x128", "rowwise_scale_inv"): (Mb, Kb),
            ("128x128", "columnwise_scale_inv"): (Kb, Mb),
        }
        for part in ("rowwise_scale_inv", "columnwise_scale_inv"):
            ref = TENSORS[f"{cid}.{part}"]
            got = getattr(q, part)
            r, c = valid[(case["block"], part)]
            _assert_same(f"{cid}.{part}[valid]", got[:r, :c], ref[:r, :c])
            _assert_same(f"{cid}.{part}[full]", got, ref)
    else:
        q = quantize(x, "mxfp8", fp8_dtype=case["fp8_dtype"])
        M, K = x.shape
        _assert_same(f"{cid}.rowwise_data", q.rowwise_data, TENSORS[f"{cid}.rowwise_data"])
        _assert_same(f"{cid}.columnwise_data", q.columnwise_data, TENSORS[f"{cid}.columnwise_data"])
        _assert_same(f"{cid}.rowwise_scale", q.rowwise_scale_inv[:M, : K // 32],
                     TENSORS[f"{cid}.rowwise_scale_e8m0_valid"])
        _assert_same(f"{cid}.columnwise_scale", q.columnwise_scale_inv[: M // 32, :K],
                     TENSORS[f"{cid}.columnwise_scale_e8m0_valid"])
