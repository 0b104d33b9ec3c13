"""docs/ci: the GPU CI gate as a GitHub Actions workflow and a GitLab CI job.

Each file is validated against its platform's published JSON schema, as vendored (offline) by
check-jsonschema, and a broken copy is shown to fail the same validation. Then the gate itself:
the documented commands, the summary into the job summary, the artifacts on failure, the manual
golden regeneration.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

CI = Path(__file__).resolve().parents[2] / "docs" / "ci"
GATE = "parity run --set quick --golden require --junit"
REGEN = "parity golden regen --accept"

FILES = {
    # file: (check-jsonschema built-in schema, a line of the file, the same line made invalid)
    "github-workflow.yml": ("vendor.github-workflows", "    runs-on: [self-hosted, linux, gpu]",
                            "    runs_on: [self-hosted, linux, gpu]"),
    "gitlab-ci.yml": ("vendor.gitlab-ci", "    when: always", "    when: sometimes"),
}


def _validate(schema: str, path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", schema, str(path)],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", sorted(FILES))
def test_ci_file_matches_its_schema(name, tmp_path):
    schema, line, broken = FILES[name]
    r = _validate(schema, CI / name)
    assert r.returncode == 0, r.stdout + r.stderr
    text = (CI / name).read_text()
    assert line + "\n" in text
    bad = tmp_path / name
    bad.write_text(text.replace(line + "\n", broken + "\n"))
    r = _validate(schema, bad)
    assert r.returncode == 1 and "Schema validation errors" in r.stdout, r.stdout + r.stderr


def _scripts(job: dict) -> str:
    lines = []
    for key in ("script", "after_script"):
        for item in job.get(key, []):
            lines += item if isinstance(item, list) else [item]
    for step in job.get("steps", []):
        lines.append(step.get("run", ""))
    return "\n".join(lines)


def test_github_workflow_gate():
    wf = yaml.load((CI / "github-workflow.yml").read_text(), Loader=yaml.BaseLoader)  # 'on' stays a str
    gate, regen = wf["jobs"]["parity"], wf["jobs"]["regen-goldens"]
    assert "self-hosted" in gate["runs-on"] and "gpu" in gate["runs-on"]
    assert GATE in _scripts(gate) and "pip install" in _scripts(gate)
    summary = next(s for s in gate["steps"] if "GITHUB_STEP_SUMMARY" in s.get("run", ""))
    assert "summary.md" in summary["run"] and summary["if"] == "${{ always() }}"
    upload = next(s for s in gate["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "${{ failure() }}" and "parity-out/" in upload["with"]["path"]
    triage = next(s for s in gate["steps"] if "parity triage" in s.get("run", ""))
    assert triage["if"] == "${{ failure() }}"
    # The manual job: only on workflow_dispatch, regenerates and offers the goldens as an artifact.
    assert "workflow_dispatch" in wf["on"] and "workflow_dispatch" in regen["if"]
    assert REGEN in _scripts(regen)
    up = next(s for s in regen["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert up["with"]["path"] == "goldens/"


def test_gitlab_job_gate():
    ci = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
    gate, regen = ci["parity-gpu"], ci["parity-regen-goldens"]
    assert "gpu" in gate["tags"] and GATE in _scripts(gate)
    assert gate["artifacts"]["reports"]["junit"] == "parity-junit.xml"
    assert "parity triage" in _scripts(gate) and '"$CI_JOB_STATUS" = "failed"' in _scripts(gate)
    assert "parity-failure/" in gate["artifacts"]["paths"]
    assert {"when": "manual"} in regen["rules"] and REGEN in _scripts(regen)
    assert regen["artifacts"]["paths"] == ["goldens/"]
