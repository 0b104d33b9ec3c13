import os, time, pytest
@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    t0 = time.time(); yield
    with open(os.environ.get("TLOG", "/tmp/tlog.txt"), "a") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER')} {t0:.3f} {time.time():.3f} {bool(item.get_closest_marker('ranks'))} {item.nodeid}\n")
