"""The LR schedule (linear warmup, cosine decay) and the optimizer config's validation."""

import math

import pytest

from parity.optim.schedule import lr_at
from parity.optim.config import OptimConfig


def test_constant_schedule_is_the_lr_itself():
    # The default must leave every existing scenario's lr untouched, bit for bit.
    assert all(lr_at(k, lr=1e-3) == 1e-3 for k in range(50))
    assert all(OptimConfig().lr_at(k) == OptimConfig().lr for k in range(50))


def test_warmup_is_linear_from_zero_and_reaches_the_peak():
    lrs = [lr_at(k, lr=1e-3, warmup_steps=4, decay_steps=20, decay_style="cosine") for k in range(5)]
    assert lrs[0] == 0.0  # step 0 is trained at lr 0, as upstream's scheduler
    assert lrs == [1e-3 * k / 4 for k in range(5)]
    assert lrs[4] == 1e-3


def test_the_warmups_last_step_is_a_warmup_step():
    """Step ``warmup_steps`` still takes the warmup's formula, as upstream's (``<=``): lr * 3 / 3
    is not 0.1 in floats, so the peak it reaches differs in the last bit from the decay branch's."""
    for style, kw in (("constant", {}), ("cosine", dict(decay_steps=9))):
        at_peak = lr_at(3, lr=0.1, warmup_steps=3, decay_style=style, **kw)
        assert at_peak == 0.1 * 3.0 / 3.0 != 0.1, style


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
    (dict(weight_decay=-0.1), "weight_decay"),
    (dict(muon_momentum=1.0), "muon_momentum"),
    (dict(muon_ns_steps=0), "muon_ns_steps"),
    (dict(muon_scale_mode="frobenius"), "muon_scale_mode"),
    (dict(muon_extra_scale_factor=0.0), "muon_extra_scale_factor"),
    (dict(adam_betas=(0.9,)), "adam_betas"),
    (dict(adam_betas=(0.9, 1.0)), "adam_betas"),
    (dict(adam_eps=0.0), "adam_eps"),
])
def test_optim_config_rejects_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        OptimConfig(**kw)


def test_a_prefix_keeps_the_schedule_length_and_the_golden_identity():
    """`--steps N` and CI's golden prefix run the first N steps of the same run: a cosine schedule
    keeps its length (else every lr from step 1 on would differ and the golden prefix could not
    match), and the prefix identifies the same golden as the full run."""
    from parity.harness.golden import scenario_config
    from parity.harness.scenario import make_scenario

    full = make_scenario({"name": "c", "steps": 12, "lr_decay_style": "cosine", "lr_warmup_steps": 2})
    short = full.prefix(4)
    assert short.steps == 4 and short.name == "c[steps=4]" and short.decay_steps == 12
    assert short.optim_config().lr_decay_steps == full.optim_config().lr_decay_steps == 12
    assert scenario_config(short) == scenario_config(full)
    # an explicit length stays; a constant LR has no length to keep
    assert make_scenario({"name": "d", "steps": 12, "lr_decay_style": "cosine", "lr_decay_steps": 20}
                         ).prefix(4).decay_steps == 20
    const = make_scenario({"name": "e", "steps": 12})
    assert const.prefix(4).lr_decay_steps is None and scenario_config(const.prefix(4)) == scenario_config(const)
    # a different length is a different run: another golden
    other = make_scenario({"name": "c", "steps": 8, "lr_decay_style": "cosine", "lr_warmup_steps": 2})
    assert scenario_config(other) != scenario_config(full)


@pytest.mark.parametrize("optim, msg", [
    ({"muon_nestrov": True}, "key 'optim.muon_nestrov': unknown optim key; allowed: weight_decay, muon_momentum"),
    ({"muon_nesterov": 1}, "key 'optim.muon_nesterov': expected bool, got int 1"),
    ({"muon_ns_steps": 2.5}, "key 'optim.muon_ns_steps': expected int, got float 2.5"),
    ({"adam_betas": ["0.9", 0.99]}, "key 'optim.adam_betas': expected a list of numbers"),
    ({"muon_momentum": 1}, "key 'optim.muon_momentum': optim.muon_momentum must be in [0, 1), got 1.0"),
])
def test_a_bad_optim_table_is_one_clear_line_naming_its_key(optim, msg):
    from parity.harness.errors import ConfigError
    from parity.harness.scenario import make_scenario

    with pytest.raises(ConfigError) as e:
        make_scenario({"name": "o", "optim": optim}, source="s.toml")
    assert str(e.value).startswith("s.toml: " + msg), str(e.value)


def test_an_optim_table_is_part_of_the_golden_identity_and_its_absence_is_not():
    from parity.harness.golden import scenario_config
    from parity.harness.scenario import make_scenario

    plain = make_scenario({"name": "o"})
    assert "optim" not in scenario_config(plain) and "optim" not in plain.to_dict()
    scaled = make_scenario({"name": "o", "optim": {"muon_extra_scale_factor": 0.2}})
    assert scenario_config(scaled)["optim"] == {"muon_extra_scale_factor": 0.2}
    assert make_scenario(scaled.to_dict()).optim_config().muon_extra_scale_factor == 0.2
