"""`parity triage`: first divergence, origin phase and diagnosis, drift per step, breakdowns.

The slow tests make real runs (`parity run` on 2 gloo ranks, 5 steps) and triage them:

* ``grad``: a 1-ULP bump of one reduced grad at step 2 (``ulp:2:grad_reduce:*``);
* ``spread``: a 1-ULP bump of one raw FP8 byte of the synced params at step 2, which the next
  forward sees, so the drift spreads through every phase of the later steps;
* ``clean``: no fault.

The fast tests triage hand-written reports (every origin phase, bad input, plots).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import cli_fork
import pandas as pd
import pytest
import torch

from parity.cli import main
from parity.harness import triage
from parity.harness.compare import ULP_BUCKETS, ULP_NAN, ULP_SATURATED
from parity.harness.errors import UsageError

QKV = "layers.0.attn.qkv.weight"
FP8_BYTE = QKV + ".fp8.rowwise_data"
SCENARIO = """\
name = "triage-w2"
recipe = "blockwise"
world = 2
ep = 2
moe = true
overlap = false
steps = 5
golden_tensor_steps = [0, -1]
"""


# --------------------------------------------------------------------------------------------
# Real runs (slow)
# --------------------------------------------------------------------------------------------


def _parity(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return cli_fork.run(args, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("triage-runs")
    scen = root / "triage-w2.toml"
    scen.write_text(SCENARIO)
    out = {}
    for name, extra, rc in (
        ("grad", ["--inject", "ulp:2:grad_reduce:*", "--snapshot", "all"], 1),
        ("spread", ["--inject", f"ulp:2:param_sync:{FP8_BYTE}", "--snapshot", "all"], 1),
        ("clean", ["--steps", "2", "--snapshot", "none"], 0),
    ):
        d = root / name
        p = _parity("run", str(scen), "--out", str(d), "--quiet", *extra)
        assert p.returncode == rc, f"{name}: rc {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
        out[name] = d
    return out


def _report_counts(run: Path) -> dict[int, int]:
    """Differing tensor comparisons per step, straight from report.json."""
    e = json.loads((run / "report.json").read_text())["scenarios"][0]
    counts: dict[int, int] = {}
    for d in e["divergence_table"]:
        counts[d["step"]] = counts.get(d["step"], 0) + 1
    return counts


@pytest.mark.slow
def test_grad_reduce_bump_is_traced_to_the_reduction(runs, capsys):
    df = triage.load_divergences(runs["grad"])
    fd = triage.first_divergence(df)
    assert (fd["step"], fd["phase"], fd["tensor"], fd["rank"]) == (2, "grad_reduce", QKV, 0)
    assert fd["n_diff"] == 1 and fd["max_ulp"] == 1
    assert fd["n_tensors"] == 2  # every rank bumped its replica of the reduced grad
    diag = triage.diagnose(df)
    assert diag.startswith(f"first divergence at step 2 / grad_reduce / {QKV} / rank 0 "
                           "(1 element, max 1 ULP, 2 tensor comparisons differ in that phase)"), diag
    assert "local grads equal, reduced grads differ: the reduction changed" in diag
    assert triage.origin(df)["phase"] == "grad_reduce"

    psp = triage.per_step_phase(df)
    assert sorted(psp["step"].unique()) == [2, 3, 4]  # every step after the first divergent one
    assert list(psp[psp["step"] == 2]["phase"]) == ["forward", "grad_local", "grad_reduce", "optimizer",
                                                    "param_sync"]
    row = psp[(psp["step"] == 2) & (psp["phase"] == "grad_reduce")].iloc[0]
    assert row["n_tensors"] == 2 and row["n_diff"] == 2 and row["max_ulp"] == 1 and row["median_ulp"] == 1
    assert row["median_exact"]  # every differing element's ULP distance, read from the snapshots
    assert row["n_compared"] > 2 and 0 < row["frac_diff"] < 1e-3
    assert psp[(psp["step"] == 2) & (psp["phase"] == "grad_local")].iloc[0]["n_tensors"] == 0
    # the per-step drift agrees with the run's own table, step by step
    dr = triage.drift(df).set_index("step")["n_tensors"].to_dict()
    want = _report_counts(runs["grad"])
    assert dr == {s: want.get(s, 0) for s in range(2, 5)}

    assert main(["triage", str(runs["grad"])]) == 1
    out = capsys.readouterr().out
    assert "the reduction changed" in out
    # both replicas of the reduced grad; whether Muon's bf16 update absorbs the bump depends on the values
    assert re.search(r"step 2: \d+ differing tensor comparisons? \(grad_reduce 2[,)]", out), out
    tdir = runs["grad"] / "triage"
    for f in ("triage.md", "divergences.csv", "per_step_phase.csv", "drift.csv", "per_param.csv", "per_layer.csv"):
        assert (tdir / f).is_file(), f
    md = (tdir / "triage.md").read_text()
    assert "**Diagnosis:** first divergence at step 2 / grad_reduce" in md
    assert "originates in **grad_reduce**" in md
    csv = pd.read_csv(tdir / "divergences.csv")
    assert len(csv) == len(df) and "ulps" not in csv.columns


@pytest.mark.slow
def test_drift_spreads_in_later_steps(runs):
    df = triage.load_divergences(runs["spread"])
    fd = triage.first_divergence(df)
    assert (fd["step"], fd["phase"], fd["tensor"]) == (2, "param_sync", FP8_BYTE)
    assert fd["max_ulp"] == 1  # raw FP8 bytes: the code distance, from the snapshots
    assert "masters equal, synced FP8 params differ (rowwise_data)" in triage.diagnose(df)
    dr = triage.drift(df).set_index("step")
    assert dr.loc[4, "n_tensors"] > dr.loc[3, "n_tensors"] > dr.loc[2, "n_tensors"] == 2
    assert dr.loc[4, "max_ulp"] > dr.loc[2, "max_ulp"]
    assert dr.loc[3, "phases"] == "forward,grad_local,grad_reduce,optimizer,param_sync"
    assert "drift spreads" in triage.drift_summary(df)[0]
    layers = triage.per_layer(df)
    assert {"layers.0", "layers.1", "(model)"} <= set(layers["layer"])
    params = triage.per_param(df)
    assert params.iloc[0]["param"] == QKV and params.iloc[0]["first_step"] == 2
    assert (params["first_step"] >= 2).all()


@pytest.mark.slow
def test_clean_run_says_no_divergence(runs, capsys):
    e = json.loads((runs["clean"] / "report.json").read_text())["scenarios"][0]
    out_dir = runs["clean"] / "tri"
    assert main(["triage", str(runs["clean"]), "--out", str(out_dir)]) == 0
    line = f"no divergence: all {e['compared']} comparisons over 2 steps equal"
    assert line in capsys.readouterr().out
    assert line in (out_dir / "triage.md").read_text()
    df = triage.load_divergences(runs["clean"])
    assert df.empty and triage.first_divergence(df) is None and triage.diagnose(df) == line


@pytest.mark.slow
def test_against_another_run(runs, capsys):
    # side A of `grad` vs side A of `spread` (the reference): `grad` bumped a reduced grad at
    # step 2, `spread` a synced FP8 byte after it, which then spreads
    df = triage.compare_runs(runs["grad"], runs["spread"])
    fd = triage.first_divergence(df)
    assert (fd["step"], fd["phase"], fd["tensor"]) == (2, "grad_reduce", QKV)
    assert "the reduction changed" in triage.diagnose(df)
    dr = triage.drift(df).set_index("step")
    assert dr.loc[4, "n_tensors"] > dr.loc[2, "n_tensors"]
    # every reduced grad of both ranks, as many as the clean run's harness compared in a step
    clean = json.loads((runs["clean"] / "report.json").read_text())["scenarios"][0]
    per_step = clean["compared_by_phase"]["grad_reduce"] / clean["steps"]
    meta = df.attrs["parity"]["scenarios"]["triage-w2"]
    assert meta["n_divergences"] == len(df) > 0
    assert meta["n_compared"][(2, "grad_reduce")] == per_step > 0
    assert meta["compared_by_phase"]["grad_reduce"] == per_step * meta["steps"]
    # a run without `--snapshot all` cannot be compared step by step
    assert main(["triage", str(runs["grad"]), "--against", str(runs["clean"])]) == 2
    assert "--snapshot all" in capsys.readouterr().err


@pytest.mark.slow
def test_against_golden(runs, tmp_path, capsys):
    import shutil

    root = tmp_path / "goldens"
    scen = runs["grad"].parent / "triage-w2.toml"
    p = _parity("golden", "regen", str(scen), "--goldens", str(root), "--accept")
    assert p.returncode == 0, p.stdout + p.stderr
    df = triage.compare_golden(runs["grad"], root)
    fd = triage.first_divergence(df)
    assert (fd["step"], fd["phase"], fd["tensor"], fd["rank"], fd["reason"]) == (2, "grad_reduce", QKV, 0, "digest")
    assert f"{QKV} / rank 0 (digest differs, 2 tensor comparisons" in triage.diagnose(df)
    assert "the reduction changed" in triage.diagnose(df)
    # The bump is on the test side only and the golden is the clean run's: the golden sees the
    # test side differ at exactly the steps where the run saw it differ from its reference. A
    # flipped FP8 weight byte spreads: the loss differs from the golden's from the next forward on.
    assert sorted(df["step"].unique()) == sorted(_report_counts(runs["grad"]))
    df = triage.compare_golden(runs["spread"], root)
    assert df[(df["step"] == 3) & (df["tensor"] == "loss")].iloc[0]["max_ulp"] > 0  # loss bits vs the golden's
    last = df[(df["step"] == 4) & (df["rank"] == 0)]  # the golden's stored step: element statistics
    assert len(last) and (last["reason"] == "values").all() and (last["n_diff"] > 0).all()
    floats = last[last["dtype"].str.contains("float")]  # raw FP8 bytes and counts have no ULP distance
    assert len(floats) and floats["max_ulp"].notna().all()
    assert main(["triage", str(runs["spread"]), "--against", "golden", "--goldens", str(root),
                 "--out", str(tmp_path / "t")]) == 1
    assert f"first divergence at step 2 / param_sync / {FP8_BYTE}" in capsys.readouterr().out
    # a 2-step run checks the golden's first 2 steps
    assert main(["triage", str(runs["clean"]), "--against", "golden", "--goldens", str(root),
                 "--out", str(tmp_path / "c")]) == 0
    assert "no divergence: all" in capsys.readouterr().out
    # a run without its record (made with --golden off) cannot be triaged against a golden
    bare = tmp_path / "bare"
    shutil.copytree(runs["clean"], bare)
    shutil.rmtree(bare / "golden")
    assert main(["triage", str(bare), "--against", "golden", "--goldens", str(root)]) == 2
    assert "has no golden record" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.ranks(2)
def test_run_golden_and_triage_name_the_same_first_tensor(tmp_path):
    """A stale scale grid (FP8 weights written without their new scales) differs in every FP8
    weight's scales at step 0's param sync. The run, its golden comparison and both triages name
    the same first tensor: the first the stack produced, a part of the first FP8 weight the
    forward uses (they used to disagree: the run named a tensor in report order, sorted by name
    within one report, and the golden comparison and triage the first by name in the phase). So
    does triage against a clean run's snapshots (safetensors sorts a file's tensors by name)."""
    out, clean = tmp_path / "r", tmp_path / "c"
    p = _parity("run", "quick-w2-ep2-stress", "--inject", "stale-scale-inv", "--out", str(out), "--quiet",
                "--snapshot", "all")
    assert p.returncode == 1, p.stdout + p.stderr
    c = _parity("run", "quick-w2-ep2-stress", "--out", str(clean), "--quiet", "--snapshot", "all", "--golden", "off")
    assert c.returncode == 0, c.stdout + c.stderr
    (e,) = json.loads((out / "report.json").read_text())["scenarios"]
    fd = e["first_divergence"]
    where = (fd["step"], fd["phase"], fd["rank"], fd["tensor"])
    assert where[:3] == (0, "param_sync", 0) and fd["tensor"].startswith(QKV + ".fp8."), fd
    assert fd["tensor"] in p.stdout.split("first divergence:")[1].splitlines()[0]
    t = triage.first_divergence(triage.load_divergences(out))
    assert (t["step"], t["phase"], t["rank"], t["tensor"]) == where
    t = triage.first_divergence(triage.compare_runs(out, clean))
    assert (t["step"], t["phase"], t["rank"], t["tensor"]) == where
    if e["golden_detail"]["tier"] == "exact":  # a golden of another platform differs from step 0's forward
        g = e["golden_detail"]["first"]
        assert (g["step"], g["phase"], g["rank"], g["tensor"]) == where
        t = triage.first_divergence(triage.compare_golden(out))
        assert (t["step"], t["phase"], t["rank"], t["tensor"]) == where


# --------------------------------------------------------------------------------------------
# Hand-written reports (fast)
# --------------------------------------------------------------------------------------------


def _hist(n_diff, numel, ulp):
    h = dict.fromkeys(ULP_BUCKETS, 0)
    h["0"] = numel - n_diff
    bucket = "1" if ulp == 1 else "2" if ulp == 2 else "3-10" if ulp <= 10 else "11-100" if ulp <= 100 else ">100"
    h[bucket] = n_diff
    return h


def _write_run(d: Path, rows, *, steps=4, overlap=False, status=None, failed_checks=(), error=None,
               name="s", n_divergences=None) -> Path:
    """rows: (step, phase, rank, tensor, n_diff, numel, max_ulp)."""
    d.mkdir(parents=True, exist_ok=True)
    table = [{"step": s, "phase": ph, "rank": r, "path": f"step {s}/{ph}/{t}/rank {r}", "n_diff": n,
              "numel": numel, "max_ulp": u, "ulp_hist": _hist(n, numel, u) if u is not None else None}
             for s, ph, r, t, n, numel, u in rows]
    by_phase = {"init": 4, "forward": 2 * steps, "grad_local": 0 if overlap else 10 * steps,
                "grad_reduce": 10 * steps, "optimizer": 20 * steps, "param_sync": 30 * steps}
    entry = {"name": name, "status": status or ("fail" if rows or failed_checks else "pass"), "steps": steps,
             "compared": sum(by_phase.values()), "compared_by_phase": by_phase,
             "first_divergence": None, "n_divergences": len(rows) if n_divergences is None else n_divergences,
             "failed_checks": list(failed_checks), "n_failed_checks": len(failed_checks), "messages": [],
             "loss": [], "scenario": {"name": name, "overlap": overlap}, "divergence_table": table}
    if error:
        entry = {"name": name, "status": "error", "steps": 0, "compared": 0, "first_divergence": None,
                 "error": error, "scenario": {"name": name}}
    (d / "report.json").write_text(json.dumps({"parity_version": "0", "platform": {}, "argv": ["parity", "run"],
                                               "scenarios": [entry], "status": entry["status"]}))
    return d


@pytest.mark.parametrize("rows,overlap,want", [
    ([(-1, "init", 0, "layers.0.attn.qkv.weight.master", 3, 100, 5),
      (0, "forward", 0, "loss", 1, 1, 1)], False,
     "masters differ before any update: master seeding changed"),
    ([(2, "forward", 1, "output", 7, 100, 3), (2, "grad_local", 0, QKV, 9, 100, 2)], False,
     "forward output differs first (params synced equal after step 1): the forward (weights or GEMM) changed"),
    ([(1, "grad_local", 0, QKV, 1, 100, 1)], False, "forward equal, local grads differ: the backward changed"),
    ([(1, "grad_reduce", 0, QKV, 1, 100, 1)], False,
     "local grads equal, reduced grads differ: the reduction changed"),
    ([(1, "grad_reduce", 0, QKV, 1, 100, 1)], True, "the backward or the reduction changed"),
    ([(3, "optimizer", 1, QKV + ".momentum_buffer", 1, 100, 2)], False,
     "reduced grads equal, optimizer state differs (momentum_buffer) while masters are equal"),
    ([(3, "optimizer", 1, QKV + ".master", 1, 100, 2)], False,
     "reduced grads equal, masters differ after the update: the optimizer step changed"),
    ([(0, "param_sync", 0, QKV + ".fp8.rowwise_scale_inv", 1, 12, 1),
      (0, "param_sync", 0, QKV + ".fp8.columnwise_data", 4, 100, None)], False,
     "masters equal, synced FP8 params differ (columnwise_data, rowwise_scale_inv)"),
    ([(0, "param_sync", 0, "layers.0.attn_norm.weight", 1, 128, 1)], False,
     "masters equal, synced params differ: the param cast or the param gather changed"),
])
def test_diagnosis_names_the_origin_phase(tmp_path, rows, overlap, want):
    df = triage.load_divergences(_write_run(tmp_path / "r", rows, overlap=overlap))
    assert want in triage.diagnose(df)


def test_first_divergence_follows_dataflow_order(tmp_path):
    rows = [(3, "forward", 0, "loss", 1, 1, 1), (2, "param_sync", 1, "b", 1, 8, 1),
            (2, "optimizer", 1, "a.master", 1, 8, 1), (2, "optimizer", 0, "z.master", 1, 8, 1)]
    df = triage.load_divergences(_write_run(tmp_path / "r", rows))
    fd = triage.first_divergence(df)
    assert (fd["step"], fd["phase"], fd["rank"], fd["tensor"]) == (2, "optimizer", 0, "z.master")
    assert triage.origin(df)["chain"] == ["optimizer", "param_sync"]


def assert_numeric_dtypes(df):
    """The table's numeric columns have the dtypes triage.COLUMNS documents, whatever rows it holds."""
    dtypes = {c: str(t) for c, t in df.dtypes.items() if str(t) not in ("object", "str", "string")}
    assert dtypes == {**dict.fromkeys(("step", "phase_idx", "rank"), "int64"),
                      **dict.fromkeys(("n_diff", "numel", "max_ulp", *triage._HIST_COLS), "Int64"),
                      "frac_diff": "float64", "median_ulp": "float64", "median_exact": "bool"}


def test_tables_medians_and_fractions(tmp_path):
    rows = [(1, "grad_reduce", 0, "layers.0.mlp.fc1.weight", 10, 1000, 1),
            (1, "grad_reduce", 1, "layers.0.mlp.fc1.weight", 30, 1000, 50),
            (1, "optimizer", 0, "layers.1.mlp.fc2.weight.master", 5, 500, 7),
            (3, "param_sync", 0, "head.weight", 2, 200, 200)]
    df = triage.load_divergences(_write_run(tmp_path / "r", rows, steps=4))
    assert list(df.columns) == list(triage.COLUMNS)
    assert_numeric_dtypes(df)
    assert list(df["layer"]) == ["layers.0", "layers.0", "layers.1", "head"]
    assert df.iloc[2]["param"] == "layers.1.mlp.fc2.weight" and df.iloc[2]["kind"] == "master"
    psp = triage.per_step_phase(df)
    assert len(psp) == 3 * 5  # steps 1..3, five phases each (zeros included)
    gr = psp[(psp["step"] == 1) & (psp["phase"] == "grad_reduce")].iloc[0]
    assert gr["n_tensors"] == 2 and gr["n_names"] == 1 and gr["n_diff"] == 40 and gr["numel"] == 2000
    assert gr["frac_diff"] == pytest.approx(0.02) and gr["max_ulp"] == 50
    assert gr["n_compared"] == 10 and gr["frac_tensors"] == pytest.approx(0.2)
    assert gr["median_ulp"] == 11 and not gr["median_exact"]  # from histograms: the 11-100 bucket
    dr = triage.drift(df)
    assert list(dr["step"]) == [1, 2, 3] and list(dr["n_tensors"]) == [3, 0, 1]
    assert "drift dies out" not in triage.drift_summary(df)[0]
    pl = triage.per_layer(df)
    assert list(pl["layer"]) == ["layers.0", "layers.1", "head"]
    pp = triage.per_param(df)
    assert pp.iloc[0]["param"] == "layers.0.mlp.fc1.weight" and pp.iloc[0]["n_tensors"] == 2


def test_what_triage_md_prints_of_a_run_without_snapshots(tmp_path, monkeypatch):
    """Without snapshots each row's median comes from its ULP histogram (the median bucket's lower
    bound, marked as an estimate); triage.md's per step and phase table prints each cell in its
    column; the files written and a skipped Parquet are named; a lone differing tensor is not
    called several; a run without divergences has a typed, empty growth column."""
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import fails: the CSV-only path
    rows = [(1, "grad_reduce", 0, "layers.0.mlp.fc1.weight", 10, 1000, 1),
            (1, "grad_reduce", 1, "layers.0.mlp.fc1.weight", 30, 1000, 50),
            (1, "optimizer", 0, "layers.1.mlp.fc2.weight.master", 5, 500, 7),
            (3, "param_sync", 0, "head.weight", 2, 200, 200)]
    df = triage.load_divergences(_write_run(tmp_path / "r", rows, steps=4))
    assert list(df["median_ulp"]) == [1, 11, 3, 101] and not df["median_exact"].any()
    res = triage.write_triage(df, tmp_path / "t")
    assert res["files"][-1] == "(no Parquet files: pyarrow is not importable)"
    md = Path(res["markdown"]).read_text()
    section = md.split("### Per step and phase\n\n")[1].split("\n\n")[0]
    table = [[c.strip() for c in r.strip("|").split("|")] for r in section.splitlines() if r.startswith("| ")]
    head, cells = table[0], {(r[0], r[1]): dict(zip(table[0], r)) for r in table[1:]}
    assert head == ["step", "phase", "n_tensors", "n_compared", "frac_tensors", "n_diff", "frac_diff",
                    "max_ulp", "median_ulp"]
    assert cells[("1", "grad_reduce")] == {"step": "1", "phase": "grad_reduce", "n_tensors": "2", "n_compared": "10",
                                           "frac_tensors": "20%", "n_diff": "40", "frac_diff": "2%",
                                           "max_ulp": "50", "median_ulp": "11 (est.)"}
    files = md.split("## Files\n\n")[1].split("\n\n")[0].splitlines()
    assert files == [f"- `{os.path.basename(f)}`" for f in res["files"][:-1]] and "- `divergences.csv`" in files
    one = triage.load_divergences(_write_run(tmp_path / "one", [(1, "grad_reduce", 0, QKV, 1, 100, 1)]))
    assert f"{QKV} / rank 0 (1 element, max 1 ULP): " in triage.diagnose(one)
    empty = triage.drift(triage.load_divergences(_write_run(tmp_path / "none", [])))
    assert empty.empty and str(empty["growth"].dtype) == "float64"


def test_a_scenarios_section_shows_its_own_breakdowns(tmp_path):
    """triage.md computes the breakdowns once for every scenario of the run; each scenario's
    section shows what triaging that scenario alone shows."""
    a = _write_run(tmp_path / "a", [(1, "grad_reduce", 0, QKV, 3, 100, 2)], name="s1")
    b = _write_run(tmp_path / "b", [(2, "optimizer", 1, QKV + ".master", 5, 100, 9),
                                    (3, "forward", 0, "loss", 1, 1, 4)], name="s2", steps=5)
    both = tmp_path / "both"
    both.mkdir()
    rep = json.loads((a / "report.json").read_text())
    rep["scenarios"] += json.loads((b / "report.json").read_text())["scenarios"]
    (both / "report.json").write_text(json.dumps(rep))
    md = triage.render_markdown(triage.load_divergences(both))
    for name, d in (("s1", a), ("s2", b)):
        alone = triage.render_markdown(triage.load_divergences(d))
        section = alone.split(f"## {name}\n")[1].split("## Plots")[0]
        assert "### Per layer" in section and section in md, name


def test_the_drift_section_of_the_markdown(tmp_path):
    """The drift over the steps that follow the first divergence, in words, as a table with each
    step's growth over the step before, and with typed columns (the construction-time check,
    step -1, is not a training step: the words count from step 0)."""
    rows = [(-1, "init", 0, QKV + ".master", 2, 100, 1),
            (0, "forward", 0, "loss", 1, 1, 1), (0, "optimizer", 0, QKV + ".master", 3, 100, 2),
            (1, "forward", 0, "loss", 1, 1, 3), (1, "optimizer", 0, QKV + ".master", 9, 100, 4),
            (1, "optimizer", 1, QKV + ".master", 9, 100, 4), (1, "param_sync", 0, "head.weight", 1, 50, 1),
            (2, "forward", 1, "loss", 1, 1, 40)]
    df = triage.load_divergences(_write_run(tmp_path / "r", rows, steps=3))
    dr = triage.drift(df)
    assert list(dr["step"]) == [-1, 0, 1, 2] and list(dr["n_tensors"]) == [1, 2, 4, 1]
    assert [None if g != g else g for g in dr["growth"]] == [None, 2.0, 2.0, 0.25]
    assert str(dr["max_ulp"].dtype) == "Int64" and str(dr["n_tensors"].dtype) == "int64"
    (line,) = triage.drift_summary(df)
    assert line.endswith("(differing tensor comparisons per step: step 0: 2, step 1: 4, step 2: 1)"), line
    # as many at the last step as at the first: it persists, it does not spread
    level = triage.load_divergences(_write_run(tmp_path / "level", rows[1:5] + [(2, "forward", 1, "loss", 1, 1, 1),
                                                                                (2, "param_sync", 0, "b", 1, 8, 1)], steps=3))
    assert triage.drift_summary(level)[0].startswith("s: drift persists without growing: 2 at step 0, 2 at step 2")
    md = triage.render_markdown(df)
    section = md.split("### Drift per step\n\n")[1].split("### Per step and phase")[0]
    assert section.startswith("- drift persists without growing: 2 at step 0, 1 at step 2 ")
    table = [[c.strip() for c in r.strip("|").split("|")] for r in section.splitlines() if r.startswith("| ")]
    assert table[0][:8] == ["step", "n_tensors", "n_names", "n_diff", "frac_diff", "max_ulp", "median_ulp", "growth"]
    cells = {r[0]: r for r in table[1:]}
    assert cells["-1"][7] == "-" and cells["0"][7] == "x2" and cells["2"][7] == "x0.25"
    assert cells["1"][5] == "4" and cells["1"][6] != "-"  # max and median ULP printed


def _snapshot_run(d: Path, keys, steps: int = 1) -> Path:
    """A ``--snapshot all`` run of scenario ``s`` whose every step holds ``keys`` on both sides."""
    from parity.harness.snapshot import snapshot_filename, write_snapshot

    _write_run(d, [], steps=steps)
    rep = json.loads((d / "report.json").read_text())
    rep["argv"] = ["parity", "run", "--snapshot", "all"]
    (d / "report.json").write_text(json.dumps(rep))
    for step in range(steps):
        write_snapshot(d / "snapshots" / "s" / snapshot_filename(step, 0),
                       {f"{side}/{k}": torch.ones(4) for side in "AB" for k in keys})
    return d


def test_a_tensor_only_one_run_holds_is_a_row_of_its_own(tmp_path):
    """Against another run: a tensor one run's snapshot holds and the other's does not is a row
    (``missing``: only in the reference; ``extra``: only in the run), not skipped; runs of
    different lengths are compared over the steps they share, and the notes say so."""
    run = _snapshot_run(tmp_path / "run", ("forward/loss", "optimizer/w.master", "optimizer/extra.master"), steps=2)
    ref = _snapshot_run(tmp_path / "ref", ("forward/loss", "optimizer/w.master", "optimizer/gone.master"))
    df = triage.compare_runs(run, ref)
    assert sorted(zip(df["tensor"], df["reason"])) == [("extra.master", "extra"), ("gone.master", "missing")]
    assert_numeric_dtypes(df)  # rows without element statistics
    meta = df.attrs["parity"]["scenarios"]["s"]
    assert meta["n_compared"] == {(0, "forward"): 1, (0, "optimizer"): 3}
    assert meta["notes"] == ["1 (step, rank) snapshots exist in one run only, first: step 1 rank 0",
                             "the runs have 2 and 1 steps; compared the 1 in common"]


def test_a_snapshot_that_does_not_hold_what_the_run_compared_is_named(tmp_path):
    """The report says 5 elements differ by up to 3 ULP; the snapshot's two sides differ in 2
    elements by 1: the snapshot was taken after the tensor changed. The report's numbers stand,
    and the notes say which tensor's snapshot is stale. A tensor whose snapshot agrees gets the
    exact distances."""
    from parity.harness.snapshot import snapshot_filename, write_snapshot

    d = _write_run(tmp_path / "r", [(0, "optimizer", 0, "w.master", 5, 8, 3),
                                    (0, "optimizer", 0, "v.master", 2, 8, 1)], steps=1)
    a = torch.arange(1, 9, dtype=torch.float32)
    b = a.clone()
    b.view(torch.int32)[:2] += 1  # 2 elements, 1 ULP: for w, not what the run compared
    write_snapshot(d / "snapshots" / "s" / snapshot_filename(0, 0),
                   {"A/optimizer/w.master": a, "B/optimizer/w.master": b,
                    "A/optimizer/v.master": a, "B/optimizer/v.master": b})
    df = triage.load_divergences(d).set_index("tensor")
    assert (df.loc["w.master", "n_diff"], df.loc["w.master", "max_ulp"], df.loc["w.master", "source"]) == (5, 3, "report")
    assert df.loc["v.master", "source"] == "report+snapshot" and df.loc["v.master", "median_exact"]
    (note,) = [n for n in df.attrs["parity"]["scenarios"]["s"]["notes"] if "do not match" in n]
    assert note.startswith("1 snapshot tensor(s) do not match what the run compared") and \
        "first: step 0/optimizer/w.master/rank 0" in note
    assert f"\n- note: {note}\n" in triage.render_markdown(df.reset_index())  # and triage.md says so


def test_names():
    assert triage.param_of("layers.0.attn_norm.weight[0:128].exp_avg_sq") == "layers.0.attn_norm.weight"
    assert triage.param_of(FP8_BYTE) == QKV
    assert triage.layer_of("layers.12.mlp.experts.3.fc1.weight") == "layers.12"
    assert triage.layer_of("embed.weight") == "embed" and triage.layer_of("loss") == "(model)"
    kinds = [triage.kind_of(t, ph) for t, ph in (
        (FP8_BYTE, "param_sync"), (QKV + ".master", "optimizer"), (QKV + ".exp_avg", "optimizer"), (QKV, "grad_reduce"),
        ("loss", "forward"), ("layers.0.attn_norm.weight", "param_sync"), ("ape", "optimizer"))]
    assert kinds == ["fp8:rowwise_data", "master", "exp_avg", "grad", "loss", "param", "tensor"]


@pytest.mark.slow
def test_a_truncated_table_is_recovered_from_the_snapshots(runs, tmp_path):
    """A report keeps at most 5000 divergence rows; with every step's snapshot the rest come back,
    and the table is then no longer flagged as partial."""
    import shutil

    run = tmp_path / "grad"
    shutil.copytree(runs["grad"], run)
    rep = json.loads((run / "report.json").read_text())
    entry = rep["scenarios"][0]
    full = len(entry["divergence_table"])
    assert entry["n_divergences"] == full > 1
    entry["divergence_table"] = entry["divergence_table"][:1]
    (run / "report.json").write_text(json.dumps(rep))
    df = triage.load_divergences(run)
    meta = df.attrs["parity"]["scenarios"]["triage-w2"]
    assert len(df) == full and not meta["truncated"]
    assert f"the report's divergence table holds 1 of {full} divergences; {full} recovered from the snapshots" \
        in meta["notes"]


def test_a_median_is_exact_only_where_every_differing_elements_distance_is_kept():
    import numpy as np

    def row(n_diff):
        return triage._row("s", 0, "forward", 0, "x", n_diff=n_diff, numel=100, ulps=np.array([1, 2, 9]))

    assert [row(n)["median_exact"] for n in (3, None, 10)] == [True, True, False]  # 10: 7 distances not kept
    assert row(3)["median_ulp"] == 2 and row(3)["max_ulp"] == 9
    # the kept distances are a prefix when the run found more: its own max stands, not theirs
    truncated = triage._row("s", 0, "forward", 0, "x", n_diff=10, numel=100, max_ulp=50, ulps=np.array([1, 2, 9]))
    assert truncated["max_ulp"] == 50


def test_ulp_distances_as_the_tables_print_them():
    assert [triage._fmt_ulp(u) for u in (None, float("nan"), 3.0, 7, ULP_NAN, ULP_SATURATED)] == [
        "n/a", "n/a", "3", "7", "NaN", ">=2^63-2"]


def test_failed_checks_without_divergence_exit_1(tmp_path, capsys):
    run = _write_run(tmp_path / "r", [], failed_checks=[{"step": 2, "check": "replicas/dp", "ok": False, "rank": 0,
                                                         "message": "step 2: 1 tensors differ across dp replicas"}])
    assert main(["triage", str(run)]) == 1
    assert "no tensor divergence in" in capsys.readouterr().out
    md = (run / "triage" / "triage.md").read_text()
    assert "- 1 check(s) failed; first ones:\n  - step 2 replicas/dp (rank 0): step 2: 1 tensors differ" in md
    assert "- phases in dataflow order: init -> forward -> grad_local -> grad_reduce -> optimizer -> param_sync" in md


def test_failed_run_exit_1(tmp_path, capsys):
    run = _write_run(tmp_path / "r", [], error="rank 1 failed at step 3 (exited with code 17)")
    assert main(["triage", str(run)]) == 1
    assert "the run failed, nothing was compared: rank 1 failed at step 3" in capsys.readouterr().out


def test_truncated_table_is_flagged(tmp_path):
    run = _write_run(tmp_path / "r", [(1, "grad_reduce", 0, QKV, 1, 100, 1)], n_divergences=9000)
    df = triage.load_divergences(run)
    assert df.attrs["parity"]["scenarios"]["s"]["truncated"]
    assert "lower bounds" in triage.render_markdown(df)


@pytest.mark.parametrize("case", ["missing", "no-report", "bad-json", "not-a-report"])
def test_bad_input_exit_2(tmp_path, case, capsys):
    d = tmp_path / "r"
    if case != "missing":
        d.mkdir()
    if case == "bad-json":
        (d / "report.json").write_text("{ not json")
    if case == "not-a-report":
        (d / "report.json").write_text("[1, 2]")
    assert main(["triage", str(d)]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("parity: ") and "Traceback" not in err
    with pytest.raises(UsageError):
        triage.load_divergences(d)


def test_plots_skipped_without_matplotlib(tmp_path, monkeypatch):
    from parity.harness import plots

    monkeypatch.setattr(plots, "plots_available", lambda: (False, "matplotlib is not importable (test)"))
    run = _write_run(tmp_path / "r", [(1, "grad_reduce", 0, QKV, 1, 100, 1)])
    assert main(["triage", str(run)]) == 1
    md = (run / "triage" / "triage.md").read_text()
    assert "Plots skipped: matplotlib is not importable (test)" in md
    assert not list((run / "triage").glob("*.png"))


def test_plots_written(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [(s, ph, r, t, s * 3 + 1, 100, 2 ** s) for s in range(1, 5) for ph, t in
            (("grad_reduce", QKV), ("optimizer", QKV + ".master"), ("param_sync", FP8_BYTE)) for r in (0, 1)]
    run = _write_run(tmp_path / "r", rows, steps=5)
    assert main(["triage", str(run)]) == 1
    tdir = run / "triage"
    for f in ("drift.png", "heatmap.png"):
        assert (tdir / f).stat().st_size > 1000 and (tdir / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tdir / "triage.md").read_text()
    assert "![drift per step by phase](drift.png)" in md and "Plots skipped" not in md


def test_snapshot_views_match_the_copies(tmp_path):
    """Triage reads snapshots as views of the mapped file: the same dtypes and bits as copies
    (the dtypes safetensors lacks included), after the file is closed, and the same error on a
    truncated file."""
    import gc

    import torch

    from parity.harness.errors import SnapshotError
    from parity.harness.snapshot import read_snapshot, write_snapshot

    g = torch.Generator().manual_seed(3)
    caps = {"A/param_sync/w.fp8.rowwise_data": torch.randint(0, 255, (4, 8), dtype=torch.uint8, generator=g),
            "A/param_sync/w.fp8.scale": torch.randn(4, generator=g).to(torch.float8_e4m3fn),
            "B/grad_reduce/w": torch.randn(4, 8, generator=g).to(torch.bfloat16)}
    if hasattr(torch, "float8_e8m0fnu"):
        caps["A/param_sync/w.fp8.e8m0"] = torch.randint(0, 254, (4,), dtype=torch.uint8).view(torch.float8_e8m0fnu)
    p = write_snapshot(tmp_path / "step_00000_rank_000.safetensors", caps, {"step": "0"})
    fast, (slow, _) = triage._load_snapshot(p), read_snapshot(p)
    gc.collect()  # the reader's file handle is gone; the views keep the mapping
    assert set(fast) == set(slow) == set(caps)
    for k in slow:
        assert fast[k].dtype == slow[k].dtype and torch.equal(fast[k].view(torch.uint8), slow[k].view(torch.uint8))
    write_snapshot(p, {k: torch.zeros_like(t) for k, t in caps.items()}, {"step": "0"})
    for k in slow:  # a snapshot written again replaces the file; the views keep the old one
        assert torch.equal(fast[k].view(torch.uint8), slow[k].view(torch.uint8))
    assert not read_snapshot(p)[0]["B/grad_reduce/w"].any()
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(p.read_bytes()[:-10])
    with pytest.raises(SnapshotError):
        triage._load_snapshot(bad)
