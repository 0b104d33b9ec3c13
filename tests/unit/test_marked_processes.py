"""The orphan check of the process tests (tests/marked_processes.py) can fail, and cleans up."""

import subprocess
import sys

import pytest
from marked_processes import assert_no_orphans, command_env, marked_pids, new_marker


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_process_left_behind_is_named_and_killed():
    marker = new_marker()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=command_env(marker))
    try:
        assert marked_pids(marker) == [child.pid]
        with pytest.raises(AssertionError, match=rf"processes left behind: \[{child.pid}\].*time.sleep"):
            assert_no_orphans(marker, within_s=0.2)
        assert child.wait(timeout=10) == -9  # killed by the check
        assert marked_pids(marker) == []
        assert_no_orphans(marker, within_s=0.2)  # nothing left: passes
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
