"""The record of which injected faults took their deviation (parity.vocab.FaultSet): what lets a
run tell an injected fault that never ran from one the checks did not see."""

import pickle

import pytest

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
