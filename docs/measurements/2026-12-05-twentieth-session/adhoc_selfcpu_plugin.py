"""pytest plugin: per test, the CPU-seconds of the test process itself (RUSAGE_SELF) and of the children it
reaped, and the wall time; one file per process under /tmp/plug. Ranks started by the fork server are
neither (measure those with tools/suite_cpu.py).

    PYTHONPATH=THIS_FOLDER python -m pytest -n 2 -p adhoc_selfcpu_plugin -q
"""
import resource, time, pytest, os
_rows = []
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    s0 = resource.getrusage(resource.RUSAGE_SELF); c0 = resource.getrusage(resource.RUSAGE_CHILDREN); t0 = time.time()
    yield
    s1 = resource.getrusage(resource.RUSAGE_SELF); c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    _rows.append((s1.ru_utime+s1.ru_stime-s0.ru_utime-s0.ru_stime, c1.ru_utime+c1.ru_stime-c0.ru_utime-c0.ru_stime, time.time()-t0, item.nodeid))
def pytest_sessionfinish(session):
    with open(f"/tmp/plug/rows.{os.getpid()}.txt", "w") as f:
        for r in _rows: f.write("%.2f\t%.2f\t%.2f\t%s\n" % r)
