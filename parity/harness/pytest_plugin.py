"""pytest plugin: parity scenarios as test items.

    pytest --parity scenarios/               # every scenario file is collected, one item each
    pytest --parity scenarios/matrix.toml --parity-regen   # regenerate (and accept) goldens

Each item runs its scenario's lockstep pair (ON == OFF bit for bit) and then checks its golden
for this platform (a missing golden fails; --parity-regen records it instead). A scenario this
machine cannot run (CUDA, too few GPUs) is skipped with the reason. Items are independent, so
pytest-xdist can spread them; a regenerated golden is written atomically per scenario.
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
        from parity.harness import goldens_cli
        from parity.harness.driver import run_scenario
        from parity.harness.runner import RunOptions

        s = self.scenario
        why = goldens_cli.why_not_runnable(s)
        if why:
            pytest.skip(why)
        root = self.config.getoption("--parity-goldens") or goldens_cli.default_root()
        regen = self.config.getoption("--parity-regen")
        found = None if regen else goldens_cli.prepare([s], root)[s.name]  # an unusable golden fails now
        entry, results = run_scenario(s, RunOptions(progress=False, snapshot="none", golden_digests=True))
        if entry["status"] != "pass":
            raise ScenarioFailure(entry)
        if regen:
            from parity.harness import golden
            rec = golden.record_from_results(s, results, goldens_cli.platform_of(s))
            golden.write(rec, golden.golden_dir(root, rec), overwrite=True)
            return
        goldens_cli.check(entry, s, results, found, require=True)
        if entry["golden"] != "pass":
            raise ScenarioFailure(entry)

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

