"""Bit-exact comparison: every check is shown to catch a planted fault."""

from __future__ import annotations

import json

import pytest
import torch

import parity.harness.compare as cmp
from parity.harness.compare import (
    ULP_BUCKETS,
    ULP_NAN,
    ULP_SATURATED,
    compare_captures,
    compare_tensors,
    require_nonempty_phases,
    ulp_distance,
)
from parity.harness.errors import (
    MismatchError,
    ParityError,
    UsageError,
    VacuousComparisonError,
)

FLOAT_DTYPES = [
    torch.float32,
    torch.float64,
    torch.bfloat16,
    torch.float16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
    torch.float8_e8m0fnu,
]
OTHER_DTYPES = [torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool]


def _make(dtype: torch.dtype, shape=(8, 16), seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if not dtype.is_floating_point:
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    if dtype == torch.float8_e8m0fnu:  # powers of two only
        return (2.0 ** torch.randint(-8, 8, shape, generator=g).float()).to(dtype)
    return torch.randn(shape, generator=g).to(dtype)


def _flip_bit(t: torch.Tensor, index: tuple[int, ...], bit: int = 0) -> torch.Tensor:
    out = t.clone()
    v = cmp.bit_view(out)
    v[index] ^= 1 << bit
    return out


def _bits(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` with the given (unsigned) bit patterns."""
    width = torch.empty((), dtype=dtype).element_size()
    if width == 1:
        return torch.tensor(values, dtype=torch.uint8).view(dtype)
    int_dtype = {2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    top = 1 << (8 * width)
    return torch.tensor([v - top if v >= top // 2 else v for v in values], dtype=int_dtype).view(dtype)


# ----------------------------------------------------------------------------------------------
# compare_tensors: planted faults
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + OTHER_DTYPES, ids=str)
def test_equal_tensors_pass(dtype):
    a = _make(dtype)
    d = compare_tensors(a, a.clone(), "p")
    assert d.equal and d.reason == "equal" and d.n_diff == 0 and d.fraction == 0.0
    if dtype in FLOAT_DTYPES:
        assert d.max_ulp == 0 and d.ulp_hist == {"0": a.numel(), "1": 0, "2": 0, "3-10": 0, "11-100": 0, ">100": 0}
    else:
        assert d.max_ulp is None and d.ulp_hist is None


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + OTHER_DTYPES, ids=str)
def test_one_flipped_bit_is_found_at_the_right_index(dtype):
    a = _make(dtype)
    if dtype.is_floating_point:
        a[3, 7] = 1.0  # so that flipping the lowest bit is exactly one ULP in every format
    b = _flip_bit(a, (3, 7), bit=0)
    d = compare_tensors(a, b, "step 12/grad_reduce/w/rank 3")
    assert not d.equal and d.reason == "values"
    assert d.n_diff == 1 and d.first_index == (3, 7)
    assert d.numel == 128 and d.fraction == pytest.approx(1 / 128)
    if dtype in FLOAT_DTYPES:
        assert d.max_ulp == 1
        assert d.ulp_hist == {"0": 127, "1": 1, "2": 0, "3-10": 0, "11-100": 0, ">100": 0}
        assert d.first_values[0] == 1.0 and d.first_values[1] != 1.0
    m = d.message()
    assert m.startswith("step 12/grad_reduce/w/rank 3: 1 of 128 elements differ")
    assert "first at (3, 7)" in m


@pytest.mark.parametrize("bit", range(32))
def test_every_fp32_bit_position_is_detected(bit):
    a = torch.linspace(-3, 3, 50)
    b = _flip_bit(a, (17,), bit)
    d = compare_tensors(a, b, "x")
    assert not d.equal and d.n_diff == 1 and d.first_index == (17,)
    assert d.max_ulp >= 1


def test_signed_zero_is_a_difference():
    a = torch.tensor([0.0, 1.0, 2.0])
    b = torch.tensor([-0.0, 1.0, 2.0])
    assert torch.equal(a, b)  # value equality would miss it
    d = compare_tensors(a, b, "z")
    assert not d.equal and d.n_diff == 1 and d.first_index == (0,)
    assert d.max_ulp == 1 and d.first_bits == ("0x00000000", "0x80000000")
    assert "0.0 (0x00000000) vs -0.0 (0x80000000)" in d.message()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_nan_payloads_are_a_difference(dtype):
    if dtype == torch.float32:
        a, b = _bits([0x7FC00000, 0x7FC00001], dtype), _bits([0x7FC00000, 0x7FC00002], dtype)
    elif dtype == torch.float64:
        a = _bits([0x7FF8000000000000, 0x7FF8000000000001], dtype)
        b = _bits([0x7FF8000000000000, 0xFFF8000000000001], dtype)
    elif dtype == torch.bfloat16:
        a, b = _bits([0x7FC0, 0x7FC1], dtype), _bits([0x7FC0, 0x7FC2], dtype)
    else:
        a, b = _bits([0x7E00, 0x7E01], dtype), _bits([0x7E00, 0x7E02], dtype)
    assert a.isnan().all() and b.isnan().all()
    d = compare_tensors(a, b, "n")
    assert not d.equal and d.n_diff == 1 and d.first_index == (1,)
    assert d.max_ulp == ULP_NAN and d.ulp_hist[">100"] == 1 and d.ulp_hist["0"] == 1
    assert d.nan_a == 2 and d.nan_b == 2
    assert "max NaN ULP" in d.message() and "NaN 2 vs 2" in d.message()  # as summary.md words it
    # identical NaN bits are equal
    assert compare_tensors(a, a.clone(), "n").equal


def test_bf16_one_ulp_histogram():
    a = torch.randn(64, 512).bfloat16()
    a[a == 0] = 1.0
    b = a.clone()
    bv = b.view(torch.int16)
    bv[5, 100:117] += 1  # +1 ULP away from zero for 17 elements
    d = compare_tensors(a, b, "bf16")
    assert d.n_diff == 17 and d.max_ulp == 1 and d.first_index == (5, 100)
    assert d.ulp_hist == {"0": 64 * 512 - 17, "1": 17, "2": 0, "3-10": 0, "11-100": 0, ">100": 0}
    assert sum(d.ulp_hist.values()) == d.numel
    assert "17 of 32768 elements differ (0.052%), max 1 ULP, hist {0: 32751, 1: 17}" in d.message()


def test_histogram_buckets_cover_all_elements():
    a = torch.ones(8)
    b = a.clone()
    bv = b.view(torch.int32)
    for i, delta in enumerate([1, 2, 3, 10, 11, 100, 101]):
        bv[i + 1] += delta
    d = compare_tensors(a, b, "h")
    assert list(d.ulp_hist) == list(ULP_BUCKETS)
    assert d.ulp_hist == {"0": 1, "1": 1, "2": 1, "3-10": 2, "11-100": 2, ">100": 1}
    assert d.max_ulp == 101


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_differences(dtype):
    a = torch.tensor([0.5, 1.0, -2.0, 448.0 if dtype == torch.float8_e4m3fn else 57344.0]).to(dtype)
    b = a.clone()
    b.view(torch.uint8)[2] += 2  # two codes further from zero
    d = compare_tensors(a, b, "f8")
    assert d.n_diff == 1 and d.first_index == (2,) and d.max_ulp == 2
    assert d.first_values[0] == -2.0
    assert d.dtype_a == str(dtype)


def test_fp8_raw_bytes_as_uint8_are_compared_bitwise():
    data = torch.randn(32).to(torch.float8_e4m3fn).view(torch.uint8)
    other = data.clone()
    other[9] ^= 0x80
    d = compare_tensors(data, other, "param_sync/w.fp8.rowwise_data")
    assert d.n_diff == 1 and d.first_index == (9,) and d.max_ulp is None


def test_dtype_and_shape_mismatch_are_differences():
    d = compare_tensors(torch.ones(3), torch.ones(3, dtype=torch.bfloat16), "d")
    assert not d.equal and d.reason == "dtype" and d.n_diff is None
    assert d.message() == "d: dtype differs: torch.float32 vs torch.bfloat16 (shape (3,) vs (3,))"
    d = compare_tensors(torch.ones(3, 4), torch.ones(4, 3), "s")
    assert not d.equal and d.reason == "shape" and "(3, 4) vs (4, 3)" in d.message()


def test_views_and_strides():
    buf = torch.arange(64, dtype=torch.float32)
    a = buf.view(8, 8).t()  # non-contiguous view
    b = buf.clone().view(8, 8).t().contiguous()  # same values, other strides
    assert compare_tensors(a, b, "v").equal
    b[2, 5] = -1.0
    d = compare_tensors(a, b, "v")
    assert d.n_diff == 1 and d.first_index == (2, 5) and d.first_values == (a[2, 5].item(), -1.0)


def test_zero_dim_and_empty():
    assert compare_tensors(torch.tensor(1.5), torch.tensor(1.5), "s").equal
    d = compare_tensors(torch.tensor(1.5), torch.tensor(-1.5), "s")
    assert d.first_index == () and d.first_values == (1.5, -1.5)
    assert compare_tensors(torch.empty(0, 4), torch.empty(0, 4), "e").equal


def test_chunked_statistics_match_a_single_pass(monkeypatch):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(1000, generator=g)
    b = a.clone()
    idx = torch.randperm(1000, generator=g)[:37]
    b.view(torch.int32)[idx] += torch.randint(1, 300, (37,), generator=g, dtype=torch.int32)
    whole = compare_tensors(a, b, "c")
    monkeypatch.setattr(cmp, "_CHUNK", 7)
    chunked = compare_tensors(a, b, "c")
    assert whole == chunked
    assert chunked.first_index == (int(idx.min()),) and chunked.n_diff == 37


def test_count_nonfinite_on_equal_tensors():
    a = torch.tensor([1.0, float("nan"), float("inf"), -float("inf")])
    d = compare_tensors(a, a.clone(), "f")
    assert d.equal and d.nan_a is None
    d = compare_tensors(a, a.clone(), "f", count_nonfinite=True)
    assert d.equal and (d.nan_a, d.nan_b, d.inf_a, d.inf_b) == (1, 1, 2, 2)


@pytest.mark.parametrize("dtype, nan", [(torch.float8_e8m0fnu, 0xFF), (torch.float8_e4m3fn, 0x7F),
                                        (torch.float8_e4m3fnuz, 0x80)], ids=str)
def test_nonfinite_counts_of_the_fp8_formats_without_inf(dtype, nan):
    """E8M0 (unsigned: 0xFF), E4M3 (0x7F and 0xFF) and the FNUZ formats (0x80) have NaNs and no Inf."""
    e = _bits([nan, 0x01, 0x02], dtype)
    d = compare_tensors(e, e.clone(), "s", count_nonfinite=True)
    assert (d.nan_a, d.nan_b, d.inf_a, d.inf_b) == (1, 1, 0, 0)


def test_the_inf_count_in_the_message():
    d = compare_tensors(torch.tensor([float("inf"), 1.0]), torch.tensor([1.0, 1.0]), "x")
    assert "Inf 1 vs 0" in d.message()


def test_percentages_in_messages():
    assert [cmp._fmt_pct(f) for f in (0.0, 0.005, 0.01, 0.5, 1.0)] == ["0.0%", "0.5%", "1.0%", "50.0%", "100%"]


def test_to_dict_is_json():
    a = torch.tensor([1.0, float("nan")])
    b = torch.tensor([2.0, float("nan")])
    d = compare_tensors(a, b, "j")
    out = json.loads(json.dumps(d.to_dict()))
    assert out["n_diff"] == 1 and out["first_index"] == [0] and out["fraction"] == 0.5
    assert out["ulp_hist"] == {"0": 1, "1": 0, "2": 0, "3-10": 0, "11-100": 0, ">100": 1}
    assert out["first_values"] == [1.0, 2.0] and out["first_bits"] == ["0x3f800000", "0x40000000"]
    flags = compare_tensors(torch.tensor([True, False]), torch.tensor([True, True]), "b")
    ints = compare_tensors(torch.tensor([3, 4]), torch.tensor([3, 5]), "i")
    for d, want in ((flags, [False, True]), (ints, [4, 5])):  # a bool reads as a bool, an int as an int
        got = d.to_dict()["first_values"]
        assert got == want and [type(v) for v in got] == [type(v) for v in want], got


def test_nonfinite_counts_over_several_chunks(monkeypatch):
    a = torch.tensor([float("nan"), 1.0, float("inf"), 2.0, float("nan"), -float("inf"), 3.0])
    monkeypatch.setattr(cmp, "_CHUNK", 3)  # three chunks: every one counted, not the last one's
    d = compare_tensors(a, a.clone(), "f", count_nonfinite=True)
    assert (d.nan_a, d.inf_a) == (2, 2)


def test_unsupported_inputs_are_usage_errors():
    with pytest.raises(UsageError) as e:
        compare_tensors([1.0], torch.ones(1), "bad")
    assert e.value.exit_code == 2 and "bad" in str(e.value)
    with pytest.raises(UsageError, match="bad: b is a list"):  # either side is checked, the second too
        compare_tensors(torch.ones(1), [1.0], "bad")

    class Sub(torch.Tensor):
        pass

    with pytest.raises(UsageError, match="subclass"):
        compare_tensors(torch.ones(2).as_subclass(Sub), torch.ones(2), "sub")
    with pytest.raises(UsageError, match="layout"):
        compare_tensors(torch.ones(2).to_sparse(), torch.ones(2).to_sparse(), "sp")


def test_requires_grad_and_parameters():
    p = torch.nn.Parameter(torch.ones(3))
    assert compare_tensors(p, torch.ones(3), "p").equal


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda():
    a = torch.randn(1 << 20, device="cuda")
    b = _flip_bit(a, (12345,))
    d = compare_tensors(a, b, "cuda")
    assert d.n_diff == 1 and d.first_index == (12345,) and d.max_ulp == 1
    assert compare_tensors(a, b.cpu(), "mixed").n_diff == 1


# ----------------------------------------------------------------------------------------------
# ulp_distance
# ----------------------------------------------------------------------------------------------


def test_ulp_distance_conventions():
    tiny = 1e-45  # fp32 smallest subnormal
    fmax = torch.finfo(torch.float32).max
    a = torch.tensor([1.0, -tiny, 0.0, fmax, 2.0, -1.0])
    b = torch.tensor([1.0, tiny, -0.0, float("inf"), 2.0, 1.0])
    b[0] = _bits([0x3F800001], torch.float32)[0]  # the next fp32 after 1.0
    d = ulp_distance(a, b)
    assert d.dtype == torch.int64
    assert d[0] == 1  # next float up
    assert d[1] == 3  # -tiny, -0, +0, +tiny
    assert d[2] == 1  # -0 and +0 are adjacent
    assert d[3] == 1  # inf follows the largest finite value
    assert d[4] == 0
    assert d[5] == 2 * 0x3F800000 + 1
    # the same conventions in float64, whose sign is read from the int64 view directly
    tiny64 = torch.tensor([5e-324, 5e-324, -0.0], dtype=torch.float64)
    assert ulp_distance(torch.tensor([0.0, -5e-324, 0.0], dtype=torch.float64), tiny64).tolist() == [1, 3, 1]


def test_ulp_distance_matches_integer_difference_for_same_sign():
    g = torch.Generator().manual_seed(3)
    a = torch.rand(1000, generator=g) + 0.5
    b = torch.rand(1000, generator=g) + 0.5
    expected = (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()
    assert torch.equal(ulp_distance(a, b), expected)
    assert torch.equal(ulp_distance(-a, -b), expected)
    assert torch.equal(ulp_distance(a, b), ulp_distance(b, a))


def test_ulp_distance_nan_and_fp64_saturation():
    d = ulp_distance(torch.tensor([float("nan"), 1.0]), torch.tensor([1.0, float("nan")]))
    assert d.tolist() == [ULP_NAN, ULP_NAN]
    inf = torch.tensor([float("inf")], dtype=torch.float64)
    assert ulp_distance(-inf, inf).item() == ULP_SATURATED
    # the markers are never real distances: a sign flip of the largest double below 2 is 2^63 - 1
    # ULP (ULP_NAN's value) and saturates, as does 2^63 - 2 (ULP_SATURATED's); 2^63 - 3 is counted
    below2 = _bits([0x3FFFFFFFFFFFFFFF, 0x3FFFFFFFFFFFFFFE, 0x3FFFFFFFFFFFFFFE], torch.float64)
    other = -_bits([0x3FFFFFFFFFFFFFFF, 0x3FFFFFFFFFFFFFFF, 0x3FFFFFFFFFFFFFFE], torch.float64)
    assert ulp_distance(below2, other).tolist() == [ULP_SATURATED, ULP_SATURATED, 2**63 - 3]
    d = compare_tensors(below2[:1], other[:1], "x")
    assert d.max_ulp == ULP_SATURATED and "NaN" not in d.message()
    e4 = torch.tensor([448.0]).to(torch.float8_e4m3fn)
    nan = _bits([0x7F], torch.float8_e4m3fn)
    assert ulp_distance(e4, nan).item() == ULP_NAN


def test_ulp_distance_fnuz_and_e8m0():
    # fnuz formats have no -0: -tiny to +tiny is 2 steps
    a = _bits([0x81], torch.float8_e4m3fnuz)
    b = _bits([0x01], torch.float8_e4m3fnuz)
    assert ulp_distance(a, b).item() == 2
    nan = _bits([0x80], torch.float8_e4m3fnuz)
    assert ulp_distance(a, nan).item() == ULP_NAN
    # e8m0 is unsigned: 0.5 -> 1 -> 2 -> 4
    e = torch.tensor([0.5, 4.0]).to(torch.float8_e8m0fnu)
    assert ulp_distance(e[:1], e[1:]).item() == 3


def test_the_ulp_dtypes_are_the_float_formats():
    """What triage asks before it measures distances."""
    assert all(cmp.is_ulp_dtype(d) for d in (torch.float32, torch.bfloat16, torch.float64, torch.float8_e4m3fn))
    assert not any(cmp.is_ulp_dtype(d) for d in (torch.int32, torch.uint8, torch.bool))


def test_ulp_distance_rejects_mixed_or_unsupported():
    with pytest.raises(UsageError, match="ulp_distance"):
        ulp_distance([1.0], torch.ones(1))  # either argument is checked, the first as well
    with pytest.raises(UsageError, match="b is a list"):
        ulp_distance(torch.ones(1), [1.0])
    with pytest.raises(UsageError):
        ulp_distance(torch.ones(2), torch.ones(3))
    with pytest.raises(UsageError):
        ulp_distance(torch.ones(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32))


# ----------------------------------------------------------------------------------------------
# compare_captures
# ----------------------------------------------------------------------------------------------


def _capture(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "param_sync/w.fp8.rowwise_data": torch.randint(0, 255, (16,), generator=g, dtype=torch.uint8),
        "forward/loss": torch.randn((), generator=g),
        "grad_reduce/decoder.0.mlp.fc1.weight": torch.randn(8, 8, generator=g).bfloat16(),
        "optimizer/decoder.0.mlp.fc1.weight": torch.randn(8, 8, generator=g),
    }


def test_equal_captures():
    a = _capture()
    r = compare_captures(a, {k: v.clone() for k, v in a.items()}, prefix="step 1/", suffix="/rank 0")
    assert r.ok and not r.failures and r.messages() == []
    assert len(r.diffs) == 4 and r.n_elements == 16 + 1 + 64 + 64
    assert [d.path for d in r.diffs][0] == "step 1/forward/loss/rank 0"  # phase order
    assert "OK" in r.summary()
    r.raise_on_failure()


def test_missing_and_extra_keys_fail():
    a = _capture()
    b = {k: v.clone() for k, v in a.items()}
    del b["grad_reduce/decoder.0.mlp.fc1.weight"]
    b["forward/extra"] = torch.zeros(1)
    r = compare_captures(a, b, prefix="step 2/", suffix="/rank 1", labels=("OFF", "ON"))
    assert not r.ok
    assert r.missing == ["grad_reduce/decoder.0.mlp.fc1.weight"] and r.extra == ["forward/extra"]
    assert r.summary().endswith(", 1 missing from ON, 1 missing from OFF"), r.summary()
    msgs = r.messages()
    assert "step 2/forward/extra/rank 1: present in ON, missing from OFF" in msgs
    assert "step 2/grad_reduce/decoder.0.mlp.fc1.weight/rank 1: present in OFF, missing from ON" in msgs
    assert compare_captures(a, {k: b[k] for k in b if k != "forward/extra"}).ok is False
    allowed = compare_captures({k: a[k] for k in b if k in a}, b, allow_extra=True)
    assert allowed.ok
    with pytest.raises(MismatchError) as e:
        r.raise_on_failure()
    assert e.value.exit_code == 1


def test_first_failure_follows_phase_order():
    a = _capture()
    b = {k: v.clone() for k, v in a.items()}
    b["param_sync/w.fp8.rowwise_data"][0] ^= 1
    b["grad_reduce/decoder.0.mlp.fc1.weight"].view(torch.int16)[1, 1] += 1
    r = compare_captures(a, b, prefix="step 3/")
    assert [d.path for d in r.failures] == [
        "step 3/grad_reduce/decoder.0.mlp.fc1.weight",
        "step 3/param_sync/w.fp8.rowwise_data",
    ]
    assert r.first_failure.startswith("step 3/grad_reduce/decoder.0.mlp.fc1.weight: 1 of 64")


def test_a_missing_key_is_placed_in_phase_order_among_the_differing_tensors():
    a = _capture()
    b = {k: v.clone() for k, v in a.items() if k != "optimizer/decoder.0.mlp.fc1.weight"}
    b["forward/loss"].view(torch.int32).add_(1)
    r = compare_captures(a, b, prefix="step 3/")
    assert r.missing == ["optimizer/decoder.0.mlp.fc1.weight"]
    assert r.first_failure.startswith("step 3/forward/loss: ")  # forward comes before the optimizer
    assert r.messages()[1] == "step 3/optimizer/decoder.0.mlp.fc1.weight: present in a, missing from b"


def test_empty_key_set_is_vacuous():
    with pytest.raises(VacuousComparisonError) as e:
        compare_captures({}, {})
    assert e.value.exit_code == 1 and isinstance(e.value, ParityError)
    with pytest.raises(VacuousComparisonError):
        compare_captures({"forward/x": torch.empty(0)}, {"forward/x": torch.empty(0)})
    # a one-sided capture is not vacuous, it is a failure
    r = compare_captures({"forward/x": torch.ones(1)}, {})
    assert not r.ok and r.missing == ["forward/x"]


def test_require_nonempty_phases():
    cap = _capture()
    assert require_nonempty_phases(cap, ["forward", "grad_reduce"]) == {"forward": 1, "grad_reduce": 1}
    with pytest.raises(VacuousComparisonError, match="grad_local"):
        require_nonempty_phases(cap, ["forward", "grad_local"], where="step 1/rank 0")
    with pytest.raises(VacuousComparisonError):
        require_nonempty_phases({"forward/x": torch.empty(0)}, ["forward"])
    # phases as any iterable, a generator read once included
    assert require_nonempty_phases(cap, (p for p in ("forward", "optimizer"))) == {"forward": 1, "optimizer": 1}
    with pytest.raises(VacuousComparisonError, match="grad_local"):
        require_nonempty_phases(cap, (p for p in ("forward", "grad_local")))
