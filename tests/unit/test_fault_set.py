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
