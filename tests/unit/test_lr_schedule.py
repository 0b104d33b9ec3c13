"""The LR schedule (linear warmup, cosine decay) and the optimizer config's validation."""

import math

import pytest

from parity.optim.schedule import lr_at
from parity.optim.stack import OptimConfig


def test_constant_schedule_is_the_lr_itself():
    # The default must leave every existing scenario's lr untouched, bit for bit.
    assert all(lr_at(k, lr=1e-3) == 1e-3 for k in range(50))
    assert all(OptimConfig().lr_at(k) == OptimConfig().lr for k in range(50))


def test_warmup_is_linear_from_zero_and_reaches_the_peak():
    lrs = [lr_at(k, lr=1e-3, warmup_steps=4, decay_steps=20, decay_style="cosine") for k in range(5)]
    assert lrs[0] == 0.0  # step 0 is trained at lr 0, as upstream's scheduler
    assert lrs == [1e-3 * k / 4 for k in range(5)]
    assert lrs[4] == 1e-3


def test_cosine_decays_monotonically_to_lr_min_and_stays_there():
    kw = dict(lr=1e-3, lr_min=1e-4, warmup_steps=2, decay_steps=12, decay_style="cosine")
    lrs = [lr_at(k, **kw) for k in range(2, 16)]
    assert all(a > b for a, b in zip(lrs[:10], lrs[1:11]))
    assert lr_at(12, **kw) == 1e-4 and lr_at(13, **kw) == 1e-4 and lr_at(100, **kw) == 1e-4
    # Halfway through the decay the cosine factor is 1/2.
    assert math.isclose(lr_at(7, **kw), 1e-4 + 0.5 * 9e-4, rel_tol=1e-15)


def test_schedule_is_a_pure_function_of_the_step():
    cfg = OptimConfig(lr_decay_style="cosine", lr_warmup_steps=3, lr_decay_steps=30, lr_min=1e-5)
    first = [cfg.lr_at(k) for k in range(30)]
    assert [cfg.lr_at(k) for k in reversed(range(30))][::-1] == first


@pytest.mark.parametrize("kw,match", [
    (dict(clip_grad=-1.0), "clip_grad"),
    (dict(lr_decay_style="linear"), "lr_decay_style"),
    (dict(lr_decay_style="cosine"), "lr_decay_steps"),
    (dict(lr_decay_style="cosine", lr_warmup_steps=5, lr_decay_steps=5), "lr_decay_steps"),
    (dict(lr_min=1.0), "lr_min"),
    (dict(lr_warmup_steps=-1), "lr_warmup_steps"),
    (dict(num_distributed_optimizer_instances=2), "s5 item 15"),
])
def test_optim_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kw)
