"""AdamW: the formulas, and bit-identical sharded vs unsharded steps."""

import pytest
import torch

from parity.optim.adam import Adam
from parity.optim.numerics import ieee_sqrt


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _bits(t):
    return t.contiguous().view(torch.int32)


def _reference_adamw(p, grads, lr, betas, eps, weight_decay):
    """Textbook AdamW in float64."""
    b1, b2 = betas
    p = p.double()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        g = g.double()
        p = p - lr * weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        p = p - lr * m_hat / (v_hat.sqrt() + eps)
    return p, m, v


def _run(params_and_grads, steps, **kw):
    """Step Adam over (param, [grad per step]) pairs; returns the params and the optimizer."""
    params = [p.clone() for p, _ in params_and_grads]
    opt = Adam(params, **kw)
    for k in range(steps):
        for p, (_, grads) in zip(params, params_and_grads):
            p.grad = grads[k]
        opt.step()
    return params, opt


def test_matches_float64_reference():
    kw = dict(lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)
    p0 = _randn(33, 17, seed=1)
    grads = [_randn(33, 17, seed=10 + k) for k in range(5)]
    (p,), opt = _run([(p0, grads)], 5, **kw)
    ref_p, ref_m, ref_v = _reference_adamw(p0, grads, **kw)
    st = opt.state[p]
    assert st["step"] == 5 and type(st["step"]) is int
    assert torch.allclose(p.double(), ref_p, atol=1e-6, rtol=0)
    assert torch.allclose(st["exp_avg"].double(), ref_m, atol=1e-6, rtol=1e-5)
    assert torch.allclose(st["exp_avg_sq"].double(), ref_v, atol=1e-8, rtol=1e-5)


def test_same_bits_as_torch_adamw_single_tensor(monkeypatch):
    # Same op sequence as torch's own for-loop AdamW, so the bits match too once torch's square
    # root is the correctly rounded one (on the CPU torch's is MKL's, which is not).
    kw = dict(lr=3e-3, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.05)
    p0 = _randn(40, 7, seed=2)
    grads = [_randn(40, 7, seed=20 + k) for k in range(4)]
    (p,), _ = _run([(p0, grads)], 4, **kw)
    q = p0.clone()
    opt = torch.optim.AdamW([q], foreach=False, fused=False, **kw)
    monkeypatch.setattr(torch.Tensor, "sqrt", ieee_sqrt)
    for g in grads:
        q.grad = g
        opt.step()
    assert torch.equal(_bits(p), _bits(q))


def test_ieee_sqrt_is_correctly_rounded():
    """Each root r lies between the midpoints to its neighbours: (r-)^2 <= v <= (r+)^2, squared
    exactly in float64 (25 significant bits each)."""
    g = torch.Generator().manual_seed(5)
    v = torch.rand(65536, generator=g) * torch.exp2(torch.randint(-140, 120, (65536,), generator=g).float())
    v[:4] = torch.tensor([0.0, 1.0e-45, 3.4e38, 2.0])
    r = ieee_sqrt(v)
    zero = v == 0
    assert r.dtype == torch.float32 and bool((r[zero] == 0).all()) and int(zero.sum()) < 100
    r, v64 = r[~zero], v[~zero].double()
    below = (r.double() + torch.nextafter(r, torch.tensor(0.0)).double()) / 2
    above = (r.double() + torch.nextafter(r, torch.tensor(float("inf"))).double()) / 2
    assert bool(((below * below <= v64) & (v64 <= above * above)).all())


@pytest.mark.parametrize("numel,cut", [(1037, 517), (100_003, 40_961), (64, 1)])
def test_sharded_step_is_bit_identical(numel, cut):
    # DistributedOptimizer steps each rank's slice of a flat buffer; stepping the two slices as
    # separate params must give exactly the bits of stepping the whole buffer. The cuts are not
    # SIMD-aligned, and the large case crosses torch's intra-op parallel grain.
    steps = 4
    full = _randn(numel, seed=3)
    grads = [_randn(numel, seed=30 + k) for k in range(steps)]
    (whole,), whole_opt = _run([(full, grads)], steps, lr=1e-2, weight_decay=0.1)
    shards, shard_opt = _run([(full[:cut], [g[:cut] for g in grads]),
                              (full[cut:], [g[cut:] for g in grads])], steps, lr=1e-2, weight_decay=0.1)
    assert torch.equal(_bits(whole), _bits(torch.cat(shards)))
    for key in ("exp_avg", "exp_avg_sq"):
        joined = torch.cat([shard_opt.state[s][key] for s in shards])
        assert torch.equal(_bits(whole_opt.state[whole][key]), _bits(joined))


def test_grouping_does_not_matter():
    a0, b0 = _randn(5, 6, seed=4), _randn(9, seed=5)
    ga, gb = [_randn(5, 6, seed=40 + k) for k in range(2)], [_randn(9, seed=50 + k) for k in range(2)]
    together, _ = _run([(a0, ga), (b0, gb)], 2)
    alone_a, _ = _run([(a0, ga)], 2)
    alone_b, _ = _run([(b0, gb)], 2)
    assert torch.equal(_bits(together[0]), _bits(alone_a[0]))
    assert torch.equal(_bits(together[1]), _bits(alone_b[0]))


def test_skips_params_without_grad():
    a, b = _randn(4, seed=6), _randn(4, seed=7)
    a.grad = _randn(4, seed=8)
    opt = Adam([a, b])
    opt.step()
    assert b not in opt.state and torch.equal(_bits(b), _bits(_randn(4, seed=7)))
    assert opt.state[a]["step"] == 1
