"""Block-scaled FP8 GEMM: the emulated cuBLAS model against an exact rational scalar reference,
thread-count independence, a float64 sanity bound, and (on CUDA sm90) torch's scaled_mm."""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from parity.fp8 import Operand, fp8_gemm, quantize, scaled_mm_supported
from parity.fp8.formats import FP8_TORCH_DTYPE
from parity.fp8.gemm import accumulate_blocks

F32 = torch.float32
BF16 = torch.bfloat16


# ---------------------------------------------------------------------------------------------
# exact scalar reference (Python Fractions): the same model, one output element at a time
# ---------------------------------------------------------------------------------------------
_FMT = {F32: (24, -126, 127), BF16: (8, -126, 127), torch.float16: (11, -14, 15)}


def rn(x: Fraction, dtype=F32) -> Fraction:
    """Round a rational to the nearest value of ``dtype`` (ties to even, subnormals, overflow -> inf)."""
    p, emin, emax = _FMT[dtype]
    if x == 0:
        return Fraction(0)
    neg, a = x < 0, abs(x)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    while Fraction(2) ** e > a:
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (max(e, emin) - p + 1)
    t = a / ulp
    n = t.numerator // t.denominator
    rem = t - n
    if rem > Fraction(1, 2) or (rem == Fraction(1, 2) and n % 2 == 1):
        n += 1
    r = n * ulp
    if r >= Fraction(2) ** (emax + 1):
        raise OverflowError("reference result overflows (not expected in these tests)")
    return -r if neg else r


def ref_gemm(a: Operand, b: Operand, out_dtype, rule="auto"):
    """rule: "auto" (the model's: "product" when a 128x128 operand is involved, else "a_first"),
    or force "a_first" = fma(RN(p*s_a), s_b, y), "b_first" = fma(RN(p*s_b), s_a, y),
    "product" = fma(p, RN(s_a*s_b), y)."""
    A = a.data.view(FP8_TORCH_DTYPE[a.fp8_dtype]).float().tolist()
    B = b.data.view(FP8_TORCH_DTYPE[b.fp8_dtype]).float().tolist()
    SA, SB = a.scale_inv.tolist(), b.scale_inv.tolist()
    M, K = a.data.shape
    N = b.data.shape[0]
    blk = a.block_len
    if rule == "auto":
        rule = "product" if (a.tile_2d is not None or b.tile_2d is not None) else "a_first"
    out = torch.empty(M, N, dtype=F32)
    for m in range(M):
        Am = [Fraction(v) for v in A[m]]
        for n in range(N):
            Bn = [Fraction(v) for v in B[n]]
            y = Fraction(0)
            for kb in range(-(-K // blk)):
                ks = range(kb * blk, min(K, (kb + 1) * blk))
                p = rn(sum((Am[k] * Bn[k] for k in ks), Fraction(0)))
                sa, sb = Fraction(SA[m][kb]), Fraction(SB[n][kb])
                if rule == "product":
                    y = rn(p * rn(sa * sb) + y)
                else:
                    s1, s2 = (sa, sb) if rule == "a_first" else (sb, sa)
                    y = rn(rn(p * s1) * s2 + y)
            out[m, n] = float(y)
    return out.to(out_dtype) if out_dtype != F32 else out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({F32: torch.int32, BF16: torch.int16, torch.float16: torch.int16}[t.dtype])


def varied(shape, seed, spread=6):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    mag = torch.randint(-spread, spread + 1, shape, generator=g).float()
    return x * torch.exp2(mag)


def operands(kind_a, kind_b, fmt_a, fmt_b, M, N, K, seed, pow2=False):
    """(a, b) operands; kind is '1x128', '128x128' or 'mxfp8'."""
    def make(kind, fmt, rows, s):
        x = varied((rows, K), s)
        if kind == "mxfp8":
            return quantize(x, "mxfp8", fp8_dtype=fmt).gemm_operand("rowwise")
        return quantize(x, "blockwise", block=kind, fp8_dtype=fmt, pow2_scales=pow2).gemm_operand("rowwise")

    return make(kind_a, fmt_a, M, seed), make(kind_b, fmt_b, N, seed + 1)


SCALAR_CASES = [
    # kind_a, kind_b, fmt_a, fmt_b, out dtype, M, N, K
    ("1x128", "128x128", "e4m3", "e4m3", F32, 6, 5, 300),      # 1D x 2D (fprop)
    ("128x128", "1x128", "e4m3", "e4m3", F32, 5, 6, 300),      # 2D x 1D: b's scale first
    ("1x128", "1x128", "e5m2", "e4m3", BF16, 4, 5, 256),       # 1D x 1D, mixed formats
    ("1x128", "1x128", "e5m2", "e5m2", F32, 4, 4, 200),        # E5M2 x E5M2 (split dot path)
    ("mxfp8", "mxfp8", "e4m3", "e4m3", F32, 32, 32, 64),       # 32-long blocks, E8M0 scales
]


@pytest.mark.parametrize("case", SCALAR_CASES, ids=[f"{c[0]}x{c[1]}-{c[2]}{c[3]}-{str(c[4])[6:]}" for c in SCALAR_CASES])
def test_emulated_matches_scalar_reference(case):
    ka, kb, fa, fb, out_dtype, M, N, K = case
    a, b = operands(ka, kb, fa, fb, M, N, K, seed=len(case[0]) + M * 7 + K)
    if ka == "mxfp8":  # keep the scalar loop small
        a = Operand(a.data[:4].contiguous(), a.fp8_dtype, a.scale_inv[:4].contiguous(), 32)
        b = Operand(b.data[:3].contiguous(), b.fp8_dtype, b.scale_inv[:3].contiguous(), 32)
    got = fp8_gemm(a, b, out_dtype=out_dtype, backend="emulated")
    want = ref_gemm(a, b, out_dtype)
    assert got.dtype == out_dtype and got.shape == want.shape
    assert torch.equal(bits(got), bits(want)), (got - want).abs().max()


@pytest.mark.parametrize("ka,kb", [("1x128", "1x128"), ("1x128", "128x128"), ("128x128", "1x128")])
def test_scale_rule_matters_and_is_followed(ka, kb):
    """With fp32 (non-pow2) scales the candidate epilogues round differently; the emulation must
    follow the measured one (1Dx1D: s_a first; with a 2D operand: the scale product)."""
    a, b = operands(ka, kb, "e4m3", "e4m3", 8, 8, 384, seed=99)
    got = fp8_gemm(a, b, out_dtype=F32, backend="emulated")
    right = ref_gemm(a, b, F32)
    assert torch.equal(bits(got), bits(right))
    others = {"a_first", "b_first", "product"} - {"product" if "128x128" in (ka, kb) else "a_first"}
    for rule in others:
        wrong = ref_gemm(a, b, F32, rule=rule)
        assert int((bits(right) != bits(wrong)).sum()) > 0, f"test data too easy: {rule} agrees everywhere"


def test_pow2_scales_make_rules_agree():
    a, b = operands("1x128", "128x128", "e4m3", "e4m3", 4, 4, 256, seed=3, pow2=True)
    outs = [ref_gemm(a, b, F32, rule=r) for r in ("a_first", "b_first", "product")]
    assert all(torch.equal(bits(o), bits(outs[0])) for o in outs)
    assert torch.equal(bits(fp8_gemm(a, b, out_dtype=F32, backend="emulated")), bits(outs[0]))


def test_exact_block_dot_with_cancellation():
    """E5M2 x E5M2 products span 2^-32 .. 2^31.6: a plain float64 sum is not exact, ours is."""
    e5 = lambda vals: torch.tensor(vals, dtype=F32).to(torch.float8_e5m2).view(torch.uint8)  # noqa: E731
    big, tiny = 57344.0, 2.0 ** -16
    a_vals = [big, tiny, big] + [0.0] * 125
    b_vals = [big, tiny, -big] + [0.0] * 125
    a = Operand(e5([a_vals]), "e5m2", torch.ones(1, 1), 128)
    b = Operand(e5([b_vals]), "e5m2", torch.ones(1, 1), 128)
    y = fp8_gemm(a, b, out_dtype=F32, backend="emulated")
    assert y.item() == 2.0 ** -32
    # also with the elements in another order and in several rows (any BLAS blocking)
    perm = torch.randperm(128, generator=torch.Generator().manual_seed(0))
    a2 = Operand(a.data[:, perm].repeat(3, 1), "e5m2", torch.ones(3, 1), 128)
    b2 = Operand(b.data[:, perm].repeat(2, 1), "e5m2", torch.ones(2, 1), 128)
    assert torch.all(fp8_gemm(a2, b2, out_dtype=F32, backend="emulated") == 2.0 ** -32)


def test_a_block_dot_on_an_fp32_midpoint_is_pushed_off_it_by_the_tiny_piece():
    """E5M2's split dot: the large pieces sum to 2^24 + 1, an fp32 midpoint (ties to even: 2^24),
    and the tiny pieces to 2^-32, below float64's ulp there, so adding the partials rounds it away.
    The exact dot lies just above the midpoint and rounds to 2^24 + 2: only the partials' TwoSum
    error, carried into the final rounding, keeps that."""
    e5 = lambda vals: torch.tensor(vals, dtype=F32).to(torch.float8_e5m2).view(torch.uint8)  # noqa: E731
    vals = [[4096.0, 1.0, 2.0 ** -16] + [0.0] * 125]
    a = Operand(e5(vals), "e5m2", torch.ones(1, 1), 128)
    b = Operand(e5(vals), "e5m2", torch.ones(1, 1), 128)
    y = fp8_gemm(a, b, out_dtype=F32, backend="emulated")
    assert y.item() == 2.0 ** 24 + 2
    assert torch.equal(bits(y), bits(ref_gemm(a, b, F32)))


def test_fma_is_single_rounding():
    """fma(t, s, y) must round once. Block 0 gives y = 1 + 2^-23 (odd last bit); block 1 adds
    t*s = 2^-24 * (1 + 2^-16) * (1 - 2^-16) = 2^-24 - 2^-56, so the exact sum lies just below the
    midpoint 1 + 2^-23 + 2^-24 and rounds down to 1 + 2^-23. Rounding to float64 first would land
    on the midpoint and tie to even, 1 + 2^-22."""
    e4 = lambda vals: torch.tensor(vals, dtype=F32).to(torch.float8_e4m3fn).view(torch.uint8)  # noqa: E731
    sa = torch.tensor([[1.0 + 2.0 ** -23, 2.0 ** -24 * (1 + 2.0 ** -16)]], dtype=F32)
    sb = torch.tensor([[1.0, 1.0 - 2.0 ** -16]], dtype=F32)
    a = Operand(e4([[1.0, 1.0]]), "e4m3", sa, 1)
    b = Operand(e4([[1.0, 1.0]]), "e4m3", sb, 1)
    y = fp8_gemm(a, b, out_dtype=F32, backend="emulated")
    assert y.item() == 1.0 + 2.0 ** -23
    assert torch.equal(bits(y), bits(ref_gemm(a, b, F32)))
    naive = ((1.0 + 2.0 ** -23) + (2.0 ** -24 * (1 + 2.0 ** -16)) * (1.0 - 2.0 ** -16))
    assert torch.tensor(naive, dtype=torch.float64).float().item() == 1.0 + 2.0 ** -22  # the trap is real


@pytest.mark.parametrize("fa,fb", [("e4m3", "e4m3"), ("e5m2", "e5m2")])
def test_emulated_independent_of_thread_count(fa, fb):
    a, b = operands("1x128", "128x128", fa, fb, 96, 80, 1000, seed=5)
    before = torch.get_num_threads()  # one, as conftest sets it for every test process
    try:
        torch.set_num_threads(1)
        y1 = fp8_gemm(a, b, out_dtype=F32, backend="emulated")
        torch.set_num_threads(2)
        y2 = fp8_gemm(a, b, out_dtype=F32, backend="emulated")
    finally:
        torch.set_num_threads(before)
    assert torch.equal(bits(y1), bits(y2))


@pytest.mark.parametrize("ka,kb,fa,fb", [("1x128", "128x128", "e4m3", "e4m3"), ("128x128", "1x128", "e4m3", "e5m2"),
                                         ("1x128", "1x128", "e5m2", "e4m3"), ("mxfp8", "mxfp8", "e4m3", "e4m3")])
def test_close_to_float64_dequantized_matmul(ka, kb, fa, fb):
    a, b = operands(ka, kb, fa, fb, 64, 96, 512, seed=17)

    def deq(op):
        v = op.data.view(FP8_TORCH_DTYPE[op.fp8_dtype]).double()
        return v * op.scale_inv.double().repeat_interleave(op.block_len, dim=1)[:, : v.shape[1]]

    A, B = deq(a), deq(b)
    ref = A @ B.t()
    bound = (A.abs() @ B.abs().t()) * 2.0 ** -20 + 1e-30
    y = fp8_gemm(a, b, out_dtype=F32, backend="emulated").double()
    assert torch.all((y - ref).abs() <= bound)
    yb = fp8_gemm(a, b, out_dtype=BF16, backend="emulated")
    assert torch.equal(bits(yb), bits(y.float().to(BF16)))


def test_gemm_of_columnwise_operands():
    """dgrad/wgrad shapes: operands from the columnwise copies contract over the original rows."""
    x = varied((256, 384), 3)
    g = varied((256, 128), 4)
    qx = quantize(x, "blockwise", block="1x128")
    qg = quantize(g, "blockwise", block="1x128")
    # wgrad: dW[128, 384] = g^T @ x  -> a = g^T [128, 256], b = x^T [384, 256]
    dw = fp8_gemm(qg.gemm_operand("columnwise"), qx.gemm_operand("columnwise"), out_dtype=F32, backend="emulated")
    ref = qg.dequantize(torch.float64).t() @ qx.dequantize(torch.float64)
    assert dw.shape == (128, 384)
    rel = ((dw.double() - ref).norm() / ref.norm()).item()
    assert rel < 0.2  # columnwise copies are different quantizations of the same data
    rel_hp = ((dw.double() - g.double().t() @ x.double()).norm() / ref.norm()).item()
    assert rel_hp < 0.2


def test_accumulate_into():
    a, b = operands("1x128", "128x128", "e4m3", "e4m3", 16, 24, 256, seed=8)
    c = varied((16, 24), 9).to(BF16)
    c0 = c.clone()
    out = fp8_gemm(a, b, out_dtype=BF16, backend="emulated", accumulate_into=c)
    assert out is c
    plain = fp8_gemm(a, b, out_dtype=BF16, backend="emulated")
    assert torch.equal(bits(out), bits(plain + c0))
    with pytest.raises(ValueError):
        fp8_gemm(a, b, out_dtype=F32, accumulate_into=torch.zeros(16, 24, dtype=BF16))


@pytest.mark.parametrize("device, backend", [
    ("cpu", "emulated"),
    pytest.param("cuda", "emulated", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
    pytest.param("cuda", "auto", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs CUDA")]),
])
@pytest.mark.parametrize("m, n", [(0, 32), (16, 0), (0, 0)])
def test_empty_operand_gives_an_empty_product(m, n, device, backend):
    """An operand without rows gives an empty [M, N] result, as a matmul does (the FP8 linear
    skips its GEMMs for an expert without tokens, but the function must not fail either): the
    epilogue's scale checks failed on the empty scale tensors. On CUDA, "auto" would pick
    scaled_mm for these shapes (0 is a multiple of 16)."""
    a, b = operands("1x128", "128x128", "e4m3", "e4m3", 16, 32, 256, seed=10)
    a = Operand(data=a.data[:m], fp8_dtype=a.fp8_dtype, scale_inv=a.scale_inv[:m], block_len=128)
    b = Operand(data=b.data[:n], fp8_dtype=b.fp8_dtype, scale_inv=b.scale_inv[:n], block_len=128,
                tile_2d=b.tile_2d[: -(-n // 128)])
    if device != "cpu":
        a, b = (Operand(data=o.data.to(device), fp8_dtype=o.fp8_dtype, scale_inv=o.scale_inv.to(device),
                        block_len=128, tile_2d=None if o.tile_2d is None else o.tile_2d.to(device))
                for o in (a, b))
    out = fp8_gemm(a, b, out_dtype=BF16, backend=backend)
    assert out.shape == (m, n) and out.dtype == BF16 and out.device.type == device
    acc = torch.zeros(m, n, dtype=BF16, device=device)
    assert fp8_gemm(a, b, out_dtype=BF16, backend=backend, accumulate_into=acc) is acc


def test_argument_checks():
    a, b = operands("1x128", "1x128", "e4m3", "e4m3", 4, 4, 256, seed=1)
    c, _ = operands("1x128", "1x128", "e4m3", "e4m3", 4, 4, 384, seed=1)
    with pytest.raises(ValueError, match="contraction"):
        fp8_gemm(a, c, out_dtype=F32)
    with pytest.raises(ValueError, match="block"):
        fp8_gemm(a, Operand(b.data, "e4m3", torch.ones(4, 8), 32), out_dtype=F32)
    with pytest.raises(ValueError):
        fp8_gemm(a, b, out_dtype=F32, backend="cublas")
    with pytest.raises(ValueError):
        Operand(a.data, "e4m3", torch.ones(4, 3), 128)  # wrong scale shape
    with pytest.raises(ValueError, match="positive"):
        Operand(a.data[:, :0], "e4m3", torch.ones(4, 0), 0)
    # the fp8 format by a torch dtype or a name in any case: the same operand
    for name in (torch.float8_e4m3fn, "E4M3"):
        same = Operand(b.data, name, b.scale_inv, 128)
        assert same.fp8_dtype == "e4m3"
        assert torch.equal(bits(fp8_gemm(a, same, out_dtype=F32)), bits(fp8_gemm(a, b, out_dtype=F32)))
    # the float64 block dot is exact up to 53 bits: E5M2 x E5M2 pieces (18 + 18 bits) allow blocks of
    # up to 2^17 elements, and one element more is refused, not summed inexactly
    ones = torch.tensor([1.0], dtype=F32).to(torch.float8_e5m2).view(torch.uint8)
    for n, ok in ((2 ** 17, True), (2 ** 17 + 1, False)):
        op = Operand(ones.repeat(1, n), "e5m2", torch.ones(1, 1), n)
        if ok:
            assert fp8_gemm(op, op, out_dtype=F32, backend="emulated").item() == n
        else:
            with pytest.raises(ValueError, match="too large for an exact float64"):
                fp8_gemm(op, op, out_dtype=F32, backend="emulated")
    if not torch.cuda.is_available():
        assert not scaled_mm_supported(a, b)
        with pytest.raises(RuntimeError, match="scaled_mm"):
            fp8_gemm(a, b, out_dtype=F32, backend="scaled_mm")
        # auto falls back to the emulation off CUDA
        assert torch.equal(bits(fp8_gemm(a, b, out_dtype=F32)), bits(fp8_gemm(a, b, out_dtype=F32, backend="emulated")))


# ---------------------------------------------------------------------------------------------
# CUDA: torch.nn.functional.scaled_mm against the emulation (docs/spec/te.md 4: bit-identical on sm90)
# ---------------------------------------------------------------------------------------------
_CUDA = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
@pytest.mark.parametrize("ka,kb", [("1x128", "128x128"), ("1x128", "1x128"), ("128x128", "1x128")])
@pytest.mark.parametrize("out_dtype", [BF16, F32])
@pytest.mark.parametrize("mnk", [(128, 128, 128), (256, 640, 384), (320, 256, 336), (320, 64, 336)])
@pytest.mark.parametrize("pow2", [True, False])
def test_scaled_mm_vs_model(ka, kb, out_dtype, mnk, pow2):
    """On the GPU: (1) torch's scaled_mm equals the model's epilogue bit for bit when the model is
    fed the hardware's own per-block partials (tensorwise scaled_mm, unit scales, fp32 out);
    (2) the fully emulated result (exact partials) is close to scaled_mm, not bitwise equal."""
    M, K, N = mnk
    dev = torch.device("cuda")
    torch.manual_seed(M + K + N)
    x = (torch.randn(M, K, device=dev) * 3).to(BF16)
    w = (torch.randn(N, K, device=dev) * 0.05).to(BF16)
    a = quantize(x, "blockwise", block=ka, pow2_scales=pow2).gemm_operand("rowwise")
    b = quantize(w, "blockwise", block=kb, pow2_scales=pow2).gemm_operand("rowwise")
    if not scaled_mm_supported(a, b):
        pytest.skip("scaled_mm blockwise path not supported on this device/torch")
    y = fp8_gemm(a, b, out_dtype=out_dtype, backend="scaled_mm")
    assert y.shape == (M, N) and y.dtype == out_dtype
    one = torch.ones((), device=dev)
    Kb = -(-K // 128)
    hw_p = torch.stack([
        torch._scaled_mm(a.data[:, k * 128:(k + 1) * 128].contiguous().view(torch.float8_e4m3fn),
                         b.data[:, k * 128:(k + 1) * 128].contiguous().view(torch.float8_e4m3fn).t(),
                         scale_a=one, scale_b=one, out_dtype=F32, use_fast_accum=False)
        for k in range(Kb)])
    model = accumulate_blocks(hw_p, a, b, out_dtype)
    n_diff = int((bits(y.cpu()) != bits(model.cpu())).sum())
    assert n_diff == 0, f"epilogue: {n_diff} of {y.numel()} differ"
    e = fp8_gemm(a, b, out_dtype=out_dtype, backend="emulated")
    A = a.data.view(torch.float8_e4m3fn).double() * a.scale_inv.double().repeat_interleave(128, 1)[:, :K]
    B = b.data.view(torch.float8_e4m3fn).double() * b.scale_inv.double().repeat_interleave(128, 1)[:, :K]
    bound = (A.abs() @ B.abs().t()) * 2.0 ** -6 + 1e-30
    assert torch.all((y.double() - e.double()).abs() <= bound)


def _hopper_blockwise_scaled_mm() -> bool:
    """sm90 and a torch with the blockwise scaling types: read here, not from the code under test."""
    st = getattr(torch.nn.functional, "ScalingType", None)
    return (torch.cuda.get_device_capability()[0] == 9 and hasattr(torch.nn.functional, "scaled_mm")
            and hasattr(st, "BlockWise1x128") and hasattr(st, "BlockWise128x128"))


@pytest.mark.gpu
@pytest.mark.skipif(not _CUDA, reason="needs CUDA")
def test_scaled_mm_takes_what_hopper_runs_and_refuses_the_rest():
    """scaled_mm_supported is checked, not tried, and the comparison above skips where it says
    no: so it is tested on its own. On Hopper the three blockwise pairs at 16-aligned shapes are
    taken; 128x128 by 128x128, E5M2, unaligned rows and CPU operands are refused. A 128x128
    operand whose scale grid is not padded to 4 column tiles gives the same product."""
    if not _hopper_blockwise_scaled_mm():
        pytest.skip("the blockwise scaled_mm path is Hopper's, with torch's blockwise scaling types")
    torch.manual_seed(3)
    x = torch.randn(256, 384, device="cuda").to(BF16)
    op = {blk: quantize(x, "blockwise", block=blk).gemm_operand("rowwise") for blk in ("1x128", "128x128")}
    for ka, kb in (("1x128", "128x128"), ("1x128", "1x128"), ("128x128", "1x128")):
        assert scaled_mm_supported(op[ka], op[kb]), (ka, kb)
    assert not scaled_mm_supported(op["128x128"], op["128x128"])
    e5 = quantize(x, "blockwise", block="1x128", fp8_dtype="e5m2").gemm_operand("rowwise")
    assert not scaled_mm_supported(e5, op["1x128"]) and not scaled_mm_supported(op["1x128"], e5)
    odd = quantize(x[:200], "blockwise", block="1x128").gemm_operand("rowwise")  # 200 rows: not 16-aligned
    assert not scaled_mm_supported(odd, op["1x128"]) and not scaled_mm_supported(op["1x128"], odd)
    a = op["1x128"]
    on_cpu = Operand(data=a.data.cpu(), fp8_dtype=a.fp8_dtype, scale_inv=a.scale_inv.cpu(), block_len=128)
    assert not scaled_mm_supported(on_cpu, op["1x128"]) and not scaled_mm_supported(op["1x128"], on_cpu)
    w = op["128x128"]
    assert w.tile_2d.shape[1] == 4  # 3 column tiles, padded to 4
    narrow = Operand(data=w.data, fp8_dtype=w.fp8_dtype, scale_inv=w.scale_inv, block_len=128,
                     tile_2d=w.tile_2d[:, :3].contiguous())
    y = fp8_gemm(a, w, out_dtype=F32, backend="scaled_mm")
    assert torch.equal(bits(y), bits(fp8_gemm(a, narrow, out_dtype=F32, backend="scaled_mm")))


def test_fp32_shortcut_of_the_fma_equals_the_float64_fma():
    """Where t*s is an fp32 value, ``_fma32`` adds in fp32 instead of going through float64; it
    must give the bits of the float64 fma on every edge: signed zeros (an exactly zero product plus
    +0 is +0, a nonzero product that underflows keeps its sign), subnormal and overflowing
    products, inf * 0, NaN, and non-power-of-two scales (inexact products: the float64 path)."""
    from parity.fp8.gemm import _fma32, _round_to_f32, _two_sum

    def float64_fma(t, s, y):  # the float64 path alone
        prod = t.double() * s.double()
        return _round_to_f32(*_two_sum(prod, y.double().expand_as(prod)))

    edge = [0.0, -0.0, 1.0, -1.0, 2.0 ** -126, -(2.0 ** -149), 2.0 ** -149, 3.0 * 2.0 ** -140,
            2.0 ** -70, -(2.0 ** -80), 2.0 ** 100, -(2.0 ** 127), 3.4e38, float("inf"),
            -float("inf"), float("nan"), 1.0 + 2.0 ** -23, 0.75]
    g = torch.Generator().manual_seed(3)
    rand = torch.randn(64, generator=g) * torch.exp2(torch.randint(-140, 120, (64,), generator=g).float())
    pow2 = torch.exp2(torch.randint(-130, 120, (40,), generator=g).float())
    vals = torch.cat([torch.tensor(edge, dtype=F32), rand])
    shortcut = total = 0
    for t, s in ((vals[:, None], vals[None, :]), (rand[:, None], pow2[None, :]), (vals[:, None], pow2[None, :])):
        for y in (torch.zeros(t.shape[0], s.shape[1]), -torch.zeros(t.shape[0], s.shape[1]),
                  torch.randn(t.shape[0], s.shape[1], generator=g) * 2.0 ** -20):
            rows = [(t[i:i + 1], y[i:i + 1]) for i in range(t.shape[0])]
            for ti, yi in rows:  # row by row: some rows take the shortcut, others not
                got, want = _fma32(ti, s, yi), float64_fma(ti, s, yi)
                prod = ti.double() * s.double()
                total += 1
                shortcut += int(torch.equal(prod.float().double(), prod))
                assert torch.equal(got.isnan(), want.isnan())
                keep = ~got.isnan()  # a NaN's sign and payload are not part of the model (IEEE 754
                assert torch.equal(bits(got)[keep], bits(want)[keep])  # leaves them open)
    assert 0 < shortcut < total  # both paths were taken


@pytest.mark.parametrize("rule", ["1Dx1D", "product"])
def test_fp32_epilogue_equals_the_general_epilogue(monkeypatch, rule):
    """Where every scale is a normal power of two and the partials times the scales stay in fp32's
    normal range (``_fp32_steps_exact``), or where the float64 products say so, the epilogue adds
    fp32 products; it must give the bits of the step-by-step fma on both sides of that range's
    edges (products that would turn subnormal or overflow), for zeros, the largest partials,
    subnormal-bound sums, inf and NaN, and for a subnormal scale whose partials are all zero (the
    E8M0 scale of an all-zero MXFP8 block) or not."""
    from parity.fp8 import gemm as G

    blk, M, N, nb = 128, 6, 5, 3
    p_hi = 2.0 * blk * 448.0 * 448.0
    g = torch.Generator().manual_seed(11)
    taken = {True: 0, False: 0}
    checked = 0  # fp32 products that only the float64 check accepted
    # sa * sb exponents from far inside fp32's range to past both of its edges, for this rule.
    cases = [(ea, eb, frac, None) for ea, eb, frac in [
        (-10, -8, 1.0), (-10, -8, 0.75), (-40, -60, 1.0), (-52, -56, 1.0), (-54, -56, 1.0), (-60, -60, 1.0),
        (40, 60, 1.0), (48, 54, 1.0), (50, 53, 1.0), (60, 60, 1.0), (-120, 2, 1.0), (-126, 0, 1.0),
        (-10, -140, 1.0), (-10, 0, 0.0), (-10, 0, -1.0), (-10, 200, 1.0)]]  # subnormal, 0, negative, inf
    # a's row 3 with the E8M0 scale 2^-127 (subnormal in fp32): harmless where its partials are zero
    # (an all-zero MXFP8 block), not where they are not
    cases += [(-10, -8, 1.0, "zero"), (-10, -8, 1.0, "nonzero")]
    for ea, eb, frac, tiny_row in cases:
        sa = torch.full((M, nb), 2.0 ** ea)
        sb = torch.full((N, nb), 2.0 ** eb * frac, dtype=torch.float64).float()  # frac 0.75: not a power of two
        sa[0, 0] *= 2.0  # not a constant scale
        tile = torch.ones(1, 4) if rule == "product" else None
        a = Operand(torch.zeros(M, nb * blk, dtype=torch.uint8), "e4m3", sa, blk)
        b = Operand(torch.zeros(N, nb * blk, dtype=torch.uint8), "e4m3", sb, blk, tile_2d=tile)
        mags = torch.exp2(torch.randint(-18, 25, (nb, M, N), generator=g).double())
        partials = (torch.randn(nb, M, N, generator=g, dtype=torch.float64) * mags).clamp(-p_hi, p_hi).float()
        partials[0, 0, :3] = torch.tensor([0.0, -0.0, 2.0 ** -18])
        partials[1, 1, :3] = torch.tensor([p_hi, -p_hi, float("inf")])
        partials[2, 2, :2] = torch.tensor([float("nan"), -float("inf")])
        if tiny_row:
            sa[3, :] = 2.0 ** -127
            partials[:, 3, :] = 0.0 if tiny_row == "zero" else torch.randn(nb, N, generator=g)
            partials[2, 2, 0] = 1.0  # no NaN: it would send every product to the step-by-step path
        # y of the products' own size, so that a rounded product would change the sum
        y_near = (torch.randn(M, N, generator=g, dtype=torch.float64) * mags[0] * 2.0 ** (ea + eb)).float()
        for y in (torch.zeros(M, N), y_near):
            sa3, sb3 = sa.t().unsqueeze(2), sb.t().unsqueeze(1)
            fast = G._fp32_steps_exact(a, b, sa3, sb3)
            taken[fast] += 1
            checked += not fast and G._exact_fp32_products(partials, a, b, sa3, sb3, rule == "product") is not None
            got = accumulate_blocks(partials, a, b, None, y=y.clone())
            with monkeypatch.context() as m:
                m.setattr(G, "_exact_fp32_products", lambda *args: None)
                want = accumulate_blocks(partials, a, b, None, y=y.clone())
            assert torch.equal(got.isnan(), want.isnan())
            keep = ~got.isnan()
            assert torch.equal(bits(got)[keep], bits(want)[keep]), (rule, ea, eb, frac, tiny_row, fast)
    assert taken[True] and taken[False] and checked  # both sides of the edge, and the float64 check
