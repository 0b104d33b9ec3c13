"""Detector power: every catalogued fault is caught by the check that exists for it, at the
expected place, and the same scenario passes clean."""

import pytest

from parity.harness.faults import CATALOGUE
from parity.harness.selftest import CASES, run_selftest


def test_every_catalogued_fault_has_a_case():
    assert set(CASES) == set(CATALOGUE)
    assert len(CATALOGUE) >= 16


@pytest.mark.slow
@pytest.mark.parametrize("fault", sorted(CASES))
def test_fault_is_caught(fault):
    (row,) = run_selftest([fault], out=lambda *_: None)
    assert row["clean_passes"], f"{row['scenario']} fails without any fault: the check proves nothing"
    assert row["caught"], f"{fault}: expected {row['expected']}, observed {row['observed']}"
