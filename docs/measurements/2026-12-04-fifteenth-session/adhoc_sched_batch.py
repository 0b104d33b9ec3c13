"""A/B (ad hoc): SCHED_BATCH (no wakeup preemption) for a rank's threads, PARITY_ADHOC_BATCH=
0 none, 1 all threads, main (the rank's main thread only), others (every thread but the main one)."""
import os, sys

import parity.harness.runner as runner
import parity.harness.driver as driver
orig = runner.rank_main

def rm(*a, **k):
    mode = os.environ.get("PARITY_ADHOC_BATCH", "0")
    for tid in map(int, os.listdir("/proc/self/task")):
        main = tid == os.getpid()
        if mode == "1" or (mode == "main" and main) or (mode == "others" and not main):
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    return orig(*a, **k)

runner.rank_main = rm
driver.rank_main = rm

if __name__ == "__main__":
    from parity.cli import main
    sys.exit(main(sys.argv[1:]))
