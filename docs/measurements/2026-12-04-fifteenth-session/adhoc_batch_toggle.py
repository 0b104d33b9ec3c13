"""`parity ARGS` with LaunchConfig.batch_scheduling set by PARITY_ADHOC_BATCH (0 or 1) (ad hoc A/B).

    PARITY_ADHOC_BATCH=0 taskset -c 0,1 python adhoc_batch_toggle.py run --recipe blockwise --ep 8 ...
"""
import os
import sys

import parity.harness.driver as driver

_orig = driver.launch_config


def _launch_config(*a, **k):
    cfg = _orig(*a, **k)
    cfg.batch_scheduling = os.environ.get("PARITY_ADHOC_BATCH", "1") == "1"
    return cfg


driver.launch_config = _launch_config

if __name__ == "__main__":
    from parity.cli import main
    sys.exit(main(sys.argv[1:]))
