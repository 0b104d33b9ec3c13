"""The record of which injected faults took their deviation (parity.vocab.FaultSet): what lets a
run tell an injected fault that never ran from one the checks did not see."""

import pickle

import pytest
import torch

from parity.model.config import ModelConfig
from parity.optim.config import StackConfig
from parity.vocab import FIRED, Fault, FaultSet


@pytest.fixture
def fired():
    FIRED.clear()
    yield FIRED
    FIRED.clear()  # the record is per process: leave none to another test


def test_a_membership_test_that_finds_its_fault_is_recorded_and_no_other(fired):
    fs = FaultSet({Fault.STALE_SCALE_INV})
    assert Fault.FP32_VIA_BF16 not in fs and fired == set()  # not injected: no deviation to take
    assert not (Fault.STALE_SCALE_INV not in fs)  # the correct path skipped: the deviation taken
    assert fired == {Fault.STALE_SCALE_INV}


def test_a_stack_config_holds_its_faults_as_a_fault_set_that_survives_pickling():
    cfg = StackConfig(model=ModelConfig(), recipe="blockwise", fp8_param_gather=True,
                      faults=frozenset({Fault.STALE_SCALE_INV}))
    assert type(cfg.faults) is FaultSet and cfg.faults == {Fault.STALE_SCALE_INV}
    back = pickle.loads(pickle.dumps(cfg))  # as it travels to a spawned rank
    assert type(back.faults) is FaultSet and back.faults == cfg.faults


def test_injected_asks_without_recording(fired):
    fs = FaultSet({Fault.STALE_SCALE_INV})
    assert fs.injected(Fault.STALE_SCALE_INV) and not fs.injected(Fault.FP32_VIA_BF16)
    assert fired == set()


def _fp8_param(hp):
    from parity.model.fp8_linear import QuantizedParameter, quantize_weight

    return QuantizedParameter(quantize_weight(hp.to(torch.bfloat16), "blockwise"))


@pytest.mark.parametrize("fault", [Fault.STALE_SCALE_INV, Fault.FTZ_SUBNORMAL_SCALE_INV])
def test_a_master_write_records_a_scale_fault_only_where_it_changes_the_scales(fired, fault):
    """stale-scale-inv deviates only where the new scale grid differs from the old one, and
    ftz-subnormal-scale-inv only where a scale_inv is subnormal: elsewhere they write what the
    correct write does, and a run there has tested nothing of them."""
    from parity.optim.mixed_precision import copy_master_to_param

    faults = FaultSet({fault})
    w = torch.ones(128, 128)
    p = _fp8_param(w)
    copy_master_to_param(p, w * 1.5, faults)  # same power-of-two scale, no tiny block
    assert fired == set()
    # the scale moves by a power of two (stale); a tiny block (ftz)
    edge = torch.full_like(w, 1e-37 if fault == Fault.FTZ_SUBNORMAL_SCALE_INV else 2.0)
    copy_master_to_param(p, edge, faults)
    assert fired == {fault}


def test_injection_specs_parse_and_print_back():
    from parity.harness.errors import UsageError
    from parity.harness.faults import parse_injection

    for spec in ("ulp:3:optimizer:*", "crash:1:2", "hang:0:5", "crash:1:2:grad_reduce", "hang:0:5:forward"):
        assert str(parse_injection(spec)) == spec
    u = parse_injection("ulp:3:optimizer:layers.0.attn.qkv.weight")
    assert (u.kind, u.step, u.phase, u.param) == ("ulp", 3, "optimizer", "layers.0.attn.qkv.weight")
    c = parse_injection("crash:1:2")
    assert (c.kind, c.rank, c.step, c.phase) == ("crash", 1, 2, "")
    h = parse_injection("hang:1:2:param_sync")
    assert (h.kind, h.rank, h.step, h.phase) == ("hang", 1, 2, "param_sync")
    for bad, why in (("ulp:3:sideways:*", "unknown phase 'sideways'"), ("ulp:3:optimizer", "expected ulp:STEP"),
                     ("crash:1", "expected ulp:STEP"), ("hang:x:1", "expected ulp:STEP"),
                     ("crash:1:2:sideways", "unknown phase 'sideways'"), ("hang:0:1:forward:x", "hang:RANK:STEP")):
        with pytest.raises(UsageError, match=why):
            parse_injection(bad)


def test_one_ulp_is_the_next_value_away_from_zero_in_every_dtype():
    import torch

    from parity.harness.faults import bump_one_ulp

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        t = torch.tensor([1.5, -2.0], dtype=dtype)
        bump_one_ulp(t, 1)
        assert t[0] == 1.5 and t[1] == torch.nextafter(torch.tensor(-2.0, dtype=dtype),
                                                        torch.tensor(-4.0, dtype=dtype)), dtype
    # raw FP8 bytes: the next code, but never onto NaN (0x7F / 0xFF in E4M3): from the largest
    # finite code it steps back
    raw = torch.tensor([0x10, 0x7E, 0xFE, 0x7D], dtype=torch.uint8)
    for i in range(4):
        bump_one_ulp(raw, i)
    assert raw.tolist() == [0x11, 0x7D, 0xFD, 0x7E]


def test_a_crash_or_hang_in_a_run_that_finished_never_fired():
    """A crash or hang that fires ends its run in an error; in a run that finished, its rank never
    reached that step and phase (a --resume-from run that starts later, say), so `parity run`
    refuses it after the run as it refuses a catalogued fault that took its deviation nowhere."""
    from parity.cli import _not_fired
    from parity.harness.faults import parse_injection

    inj = [parse_injection(s) for s in ("crash:1:2:grad_reduce", "hang:0:1", "ulp:0:forward:*",
                                        "muon-normalize-without-eps", "stale-scale-inv")]
    ended = {"status": "pass", "faults_fired": ["stale-scale-inv"]}
    assert _not_fired(inj, ended) == ["crash:1:2:grad_reduce", "hang:0:1", "muon-normalize-without-eps"]
    assert _not_fired(inj, {**ended, "status": "fail"}) == ["crash:1:2:grad_reduce", "hang:0:1",
                                                            "muon-normalize-without-eps"]
    assert _not_fired(inj, {"status": "error", "faults_fired": []}) == []
