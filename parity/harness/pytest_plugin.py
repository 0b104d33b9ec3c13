"""pytest plugin: parity scenarios as test items.

    pytest --parity scenarios/               # every scenario file is collected, one item each
    pytest --parity scenarios/matrix.toml --parity-regen   # regenerate (and accept) goldens

Each item runs its scenario's lockstep pair (ON == OFF bit for bit) and then checks its golden
(a missing golden fails unless --parity-regen). Items are independent, so pytest-xdist can spread
them; a regenerated golden is written atomically per scenario.
"""

from __future__ import annotations

import pytest


def pytest_addoption(parser):
    g = parser.getgroup("parity")
    g.addoption("--parity", action="store_true", default=False,
                help="collect scenarios/*.toml files as parity scenario tests")
    g.addoption("--parity-regen", action="store_true", default=False,
                help="regenerate the golden of every collected scenario (accepted)")
    g.addoption("--parity-goldens", default=None, help="golden root (default: the repo's goldens/)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: multi-rank or long cases")


def pytest_collect_file(parent, file_path):
    if parent.config.getoption("--parity") and file_path.suffix == ".toml":
        return ScenarioFile.from_parent(parent, path=file_path)
    return None


class ScenarioFile(pytest.File):
    def collect(self):
        from parity.harness.scenario import load_file

        for s in load_file(self.path):
            yield ScenarioItem.from_parent(self, name=s.name, scenario=s)


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario, **kw):
        super().__init__(**kw)
        self.scenario = scenario
        self.add_marker(pytest.mark.slow)

    def runtest(self):
        import torch

        from parity.harness.golden import regen_golden
        from parity.harness.goldens_cli import check_results, recorder_from_results
        from parity.harness.driver import run_scenario
        from parity.harness.runner import RunOptions

        s = self.scenario
        if s.device == "cuda" and torch.cuda.device_count() < s.world:
            pytest.skip(f"needs {s.world} CUDA device(s)")
        entry, results = run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=True))
        if entry["status"] != "pass":
            raise ScenarioFailure(entry)
        root = self.config.getoption("--parity-goldens")
        if self.config.getoption("--parity-regen"):
            regen_golden(recorder_from_results(s, results), root or _default_root(), accept=True)
            return
        status, msgs = check_results(s, results, root)
        if status != "pass":
            raise ScenarioFailure({**entry, "golden": status, "golden_messages": msgs})

    def repr_failure(self, excinfo):
        if isinstance(excinfo.value, ScenarioFailure):
            e = excinfo.value.entry
            lines = [f"scenario {e['name']}: status {e['status']}, golden {e.get('golden', 'off')}"]
            if e.get("error"):
                lines.append(f"error: {e['error']}")
            if e.get("first_divergence"):
                lines.append(f"first divergence: {e['first_divergence']}")
            lines += [c["message"] for c in e.get("failed_checks", [])[:5]]
            lines += e.get("golden_messages", [])[:10]
            return "\n".join(lines)
        return super().repr_failure(excinfo)

    def reportinfo(self):
        return self.path, 0, f"scenario: {self.name}"


class ScenarioFailure(Exception):
    def __init__(self, entry):
        super().__init__(entry.get("name"))
        self.entry = entry


def _default_root():
    from parity.harness.goldens_cli import default_root
    return default_root()
