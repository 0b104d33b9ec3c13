"""Microbatch building blocks in one process: the data stream per microbatch, TE's
first-microbatch FP8 weight cache and wgrad rule in FP8Linear, the scenario key."""

import pytest
import torch

from parity.harness.errors import ConfigError
from parity.harness.scenario import make_scenario
from parity.model.data import batch
from parity.model.fp8_linear import FP8Linear
from parity.vocab import Fault


def bits(t: torch.Tensor) -> torch.Tensor:
    ints = {torch.bfloat16: torch.int16, torch.float32: torch.int32, torch.uint8: torch.uint8}
    return t.contiguous().view(ints.get(t.dtype, torch.uint8))


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def test_microbatch_zero_is_the_one_microbatch_stream():
    # The stream a one-microbatch run has always drawn (seeded as before microbatches existed).
    g = torch.Generator().manual_seed(1234 * 7919 + 5 * 104_729 + 1 * 1_299_709)
    ids = torch.randint(0, 128, (2, 65), generator=g)
    tokens, labels = batch(1234, 5, 1, 2, 64, 128)
    assert torch.equal(tokens, ids[:, :-1]) and torch.equal(labels, ids[:, 1:])
    assert torch.equal(batch(1234, 5, 1, 2, 64, 128, microbatch=0)[0], tokens)
    # Every microbatch draws its own batch, and not another step's or rank's.
    seen = {tuple(batch(1234, s, r, 2, 64, 128, microbatch=m)[0].flatten().tolist())
            for s in range(3) for r in range(2) for m in range(4)}
    assert len(seen) == 3 * 2 * 4


def layer(fp8_param: bool, recipe="blockwise") -> FP8Linear:
    g = torch.Generator().manual_seed(7)
    return FP8Linear(128, 128, recipe, torch.randn(128, 128, generator=g) * 0.02, fp8_param)


@pytest.mark.parametrize("recipe", ["blockwise", "mxfp8"])
def test_off_caches_its_fp8_weight_from_the_first_microbatch(recipe):
    m = layer(False, recipe)
    m.is_first_microbatch = True
    q0 = m.forward_weight()
    with torch.no_grad():
        m.weight.mul_(3.0)  # the optimizer updates the weight
    fresh = m.fp8_weight()
    assert not same(fresh.rowwise_data, q0.rowwise_data)
    m.is_first_microbatch = False  # later microbatches reuse the cache, whatever the weight holds
    assert m.forward_weight() is q0
    m.is_first_microbatch = True   # the next step's first microbatch requantizes
    q1 = m.forward_weight()
    assert same(q1.rowwise_data, fresh.rowwise_data) and same(q1.columnwise_data, fresh.columnwise_data)
    m.is_first_microbatch = None   # no flag: quantized on every forward, nothing cached
    assert m.forward_weight() is not m.forward_weight()


def test_fp8_cache_fault_keeps_the_stale_weight():
    m = layer(False)
    m.faults = frozenset({Fault.FP8_CACHE_NOT_REFRESHED})
    m.is_first_microbatch = True
    q0 = m.forward_weight()
    with torch.no_grad():
        m.weight.mul_(3.0)
    assert m.forward_weight() is q0  # the bug: first microbatch after the update, stale bytes


def test_on_uses_its_persisted_weight_on_every_microbatch():
    m = layer(True)
    for flag in (True, False, None):
        m.is_first_microbatch = flag
        assert m.forward_weight() is m.weight.qt


def _wgrad(m: FP8Linear, flag, start: torch.Tensor) -> torch.Tensor:
    m.is_first_microbatch = flag
    m.weight.main_grad = start.clone()
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16).requires_grad_()
    m(x).float().sum().backward()
    return m.weight.main_grad


@pytest.mark.parametrize("fp8_param", [False, True])
def test_wgrad_overwrites_main_grad_on_the_first_microbatch_only(fp8_param):
    m = layer(fp8_param)
    zero = torch.zeros(128, 128)
    junk = torch.full((128, 128), 0.5)  # e.g. a gather payload left in the grad buffer
    dw = _wgrad(m, None, zero)  # accumulated into zeros: the plain gradient
    assert torch.count_nonzero(dw) > 0
    assert same(_wgrad(m, True, junk), dw)           # first microbatch: overwritten
    assert same(_wgrad(m, False, junk), junk + dw)   # later microbatches: accumulated
    assert same(_wgrad(m, None, junk), junk + dw)    # no flag: accumulated (TE's None)


def test_microbatches_scenario_key():
    s = make_scenario({"name": "mb", "microbatches": 4})
    assert s.microbatches == 4
    assert all(c.microbatches == 4 for c in s.stack_configs())
    assert s.fingerprint() != make_scenario({"name": "mb"}).fingerprint()
    for bad in (0, -1):
        with pytest.raises(ConfigError, match="microbatches"):
            make_scenario({"name": "mb", "microbatches": bad})
    with pytest.raises(ConfigError, match="microbatches"):
        make_scenario({"name": "mb", "microbatches": 2.0})
