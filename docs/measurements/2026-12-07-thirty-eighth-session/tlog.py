# A pytest plugin that logs each test's start and end per xdist worker to /tmp/tlog-<worker>.jsonl
# (run: PYTHONPATH=<this dir> python -m pytest -n 2 -p tlog ...).
import os, time, json
_f = None
def pytest_runtest_logstart(nodeid, location):
    global _f
    if _f is None:
        _f = open(f"/tmp/tlog-{os.environ.get('PYTEST_XDIST_WORKER','main')}.jsonl", "a", buffering=1)
    _f.write(json.dumps(["start", nodeid, time.time()]) + "\n")
def pytest_runtest_logfinish(nodeid, location):
    _f.write(json.dumps(["end", nodeid, time.time()]) + "\n")
