"""Triage of a parity run: where a divergence starts, in which phase, and how it grows.

``parity triage RUN [--against OTHER_RUN|golden] [--out DIR]`` reads a run directory
(``report.json`` plus, where present, ``snapshots/<scenario>/step_XXXXX_rank_XXX.safetensors``)
and writes to ``DIR`` (default ``RUN/triage/``):

* ``triage.md``: the first divergence, the phase it originates in (dataflow order
  ``init -> forward -> grad_local -> grad_reduce -> optimizer -> param_sync``) with a one-line
  diagnosis, the drift per step, per step and phase, per layer and per param. Within a step,
  phase and rank the first tensor is the first the stack produced, as ``parity run`` and the
  golden comparison name it (a run's table, a golden record and a snapshot file keep that order);
* CSV tables (and Parquet where pyarrow is importable): ``divergences``, ``per_step_phase``,
  ``drift``, ``per_layer``, ``per_param``;
* PNG plots when matplotlib is importable (optional extra ``plots``); otherwise the markdown
  says that they were skipped and why.

Three sources of divergences, one table schema (see :data:`COLUMNS`):

* a single run (:func:`load_divergences`): side A (under test) vs side B (reference) as the
  run compared them, from ``report.json``'s divergence table, made exact from the snapshots
  where they hold the tensors (median ULP, ULP of raw FP8 bytes as code distance);
* two runs (:func:`compare_runs`, ``--against OTHER_RUN``): side A of RUN vs side A of
  OTHER_RUN (the reference), from both runs' ``--snapshot all`` snapshots, step by step,
  tensor by tensor (e.g. two commits, or two platforms);
* a golden record (:func:`compare_golden`, ``--against golden``): the tested side of RUN (its
  record, kept by ``parity run``) vs the golden of its scenario: per-tensor digests every step,
  element statistics at the golden's stored steps, the loss's ULP distance every step.

Programmatic use::

    from parity.harness import triage
    df = triage.load_divergences("out")          # one row per differing tensor, step, phase, rank
    triage.first_divergence(df)                  # {'step': 5, 'phase': 'grad_reduce', ...}
    triage.diagnose(df)                          # 'first divergence at step 5 / grad_reduce / ...'
    triage.per_step_phase(df); triage.drift(df); triage.per_param(df); triage.per_layer(df)

Run-level facts that the rows alone do not carry (steps run, comparisons made, failed checks)
travel in ``df.attrs["parity"]``; every function also takes them as ``meta=``.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from parity.harness.compare import (
    ULP_BUCKETS,
    bit_view,
    compare_tensors,
    fmt_ulp,
    is_ulp_dtype,
    ulp_distance,
)
from parity.harness.errors import ParityError, SnapshotError, UsageError
from parity.harness.snapshot import (
    read_snapshot,
    snapshot_filename,
)
from parity.vocab import STEP_PHASES

__all__ = [
    "COLUMNS",
    "DATAFLOW",
    "load_divergences",
    "compare_runs",
    "compare_golden",
    "per_step_phase",
    "drift",
    "per_param",
    "per_layer",
    "first_divergence",
    "origin",
    "diagnose",
    "drift_summary",
    "write_triage",
    "render_markdown",
    "breakdowns",
    "triage_command",
    "param_of",
    "layer_of",
]

DATAFLOW: tuple[str, ...] = ("init",) + tuple(STEP_PHASES)
"""Phases in dataflow order; ``init`` (step -1) is the construction-time master check."""
_PHASE_IDX = {p: i for i, p in enumerate(DATAFLOW)}

_HIST_COLS = ("h_0", "h_1", "h_2", "h_3_10", "h_11_100", "h_gt100")
_HIST_LOWER = (0, 1, 2, 3, 11, 101)  # smallest ULP of each bucket
COLUMNS: tuple[str, ...] = (
    "scenario", "step", "phase", "phase_idx", "rank", "tensor", "param", "layer", "kind",
    "reason", "dtype", "n_diff", "numel", "frac_diff", "max_ulp", "median_ulp", "median_exact",
    *_HIST_COLS, "source", "ulps",
)
"""The divergence table: one row per differing tensor of one step, phase and rank.

``reason``: ``values`` (same dtype and shape, bits differ), ``dtype``, ``shape``, ``missing``
(in the reference only), ``extra`` (in the tested side only) or ``digest`` (a digest differs,
no element statistics). ``max_ulp``/``median_ulp`` are over the differing elements
(``ULP_NAN`` = a NaN was involved); raw FP8 bytes get the code distance when snapshots hold
them. ``median_exact`` is False where the median is estimated from the ULP histogram (the
lower bound of the median bucket). ``ulps`` (a numpy array of the differing elements' ULP
distances, where the tensors were at hand; an even subsample beyond :data:`MAX_KEPT_ULPS`) is
kept for exact medians of groups and left out of the CSV/Parquet files. ``step``, ``phase_idx``
and ``rank`` are int64; the counts, ``max_ulp`` and the histogram columns nullable Int64 (absent
for a digest row); ``frac_diff`` and ``median_ulp`` float64 (NaN where absent).
"""

_TENSOR_RE = re.compile(r"^step -?\d+/[^/]+/(?P<tensor>.+)/rank \d+$")
_LAYER_RE = re.compile(r"^(layers\.\d+)\.")
_SLICE_RE = re.compile(r"\[\d+:\d+\]")
_STATE_SUFFIXES = (".master", ".momentum_buffer", ".exp_avg_sq", ".exp_avg")
MAX_KEPT_ULPS = 1 << 20
"""Per tensor, at most this many ULP distances are kept for medians (an even subsample beyond)."""


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def param_of(tensor: str) -> str:
    """The parameter a captured tensor belongs to: optimizer-state suffixes, FP8 parts and
    shard slices stripped (``layers.0.attn_norm.weight[0:128].exp_avg`` -> ``layers.0.attn_norm.weight``)."""
    t = tensor
    if ".fp8." in t:
        t = t.split(".fp8.", 1)[0]
    for s in _STATE_SUFFIXES:
        if t.endswith(s):
            t = t[: -len(s)]
            break
    return _SLICE_RE.sub("", t)


def kind_of(tensor: str, phase: str) -> str:
    """What a tensor is: grad, master, momentum_buffer, exp_avg, fp8:<part>, param, loss, output."""
    if ".fp8." in tensor:
        return "fp8:" + tensor.split(".fp8.", 1)[1]
    for s in _STATE_SUFFIXES:
        if tensor.endswith(s):
            return s[1:]
    if phase in ("grad_local", "grad_reduce"):
        return "grad"
    if phase == "forward":
        return tensor
    if phase == "param_sync":
        return "param"
    return "tensor"


def layer_of(tensor: str) -> str:
    """The ``layers.N`` prefix of a tensor; the top-level module otherwise (``embed``, ``head``,
    ``ape``), and ``(model)`` for the forward's loss and output."""
    m = _LAYER_RE.match(tensor)
    if m:
        return m.group(1)
    if tensor in ("loss", "output", "*"):
        return "(model)"
    return param_of(tensor).split(".", 1)[0]


def _tensor_from_path(path: str) -> str:
    m = _TENSOR_RE.match(path)
    if m:
        return m.group("tensor")
    return path.split("/", 2)[-1].rsplit("/rank", 1)[0]


def _is_raw_fp8(name: str, dtype: torch.dtype) -> bool:
    return dtype == torch.uint8 and ".fp8." in name and name.endswith("data")


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


def _row(scenario: str, step: int, phase: str, rank: int, tensor: str, *, reason: str = "values",
         dtype: str | None = None, n_diff: int | None = None, numel: int | None = None,
         max_ulp: int | None = None, hist: Mapping[str, int] | None = None,
         ulps: np.ndarray | None = None, source: str = "report") -> dict[str, Any]:
    row: dict[str, Any] = {
        "scenario": scenario, "step": int(step), "phase": phase, "phase_idx": _PHASE_IDX.get(phase, 99),
        "rank": int(rank), "tensor": tensor, "param": param_of(tensor), "layer": layer_of(tensor),
        "kind": kind_of(tensor, phase), "reason": reason, "dtype": dtype, "n_diff": n_diff, "numel": numel,
        "frac_diff": (n_diff / numel) if (n_diff is not None and numel) else None,
        "max_ulp": max_ulp, "median_ulp": None, "median_exact": False, "source": source,
        "ulps": ulps if ulps is not None and len(ulps) else None,
    }
    for col, bucket in zip(_HIST_COLS, ULP_BUCKETS):
        row[col] = None if hist is None else int(hist.get(bucket, 0))
    if row["ulps"] is not None:
        row["median_ulp"] = _median_of(ulps)
        row["median_exact"] = n_diff is None or len(ulps) == n_diff
        row["max_ulp"] = int(ulps.max()) if max_ulp is None or len(ulps) == n_diff else max_ulp
    elif hist is not None:
        row["median_ulp"] = _median_from_hist([hist.get(b, 0) for b in ULP_BUCKETS])
    return row


def _median_of(ulps: Any, *, scratch: bool = False) -> float | None:
    """Median of an array of ULP distances (mean of the two middle values if even). ``scratch``:
    the array is the caller's temporary, reordered in place rather than copied first."""
    if ulps is None or len(ulps) == 0:
        return None
    return float(np.median(ulps, overwrite_input=scratch))


def _median_from_hist(hist: list[int]) -> float | None:
    """Estimated median of the differing elements (buckets 1..): the median bucket's lower bound."""
    nz = list(hist[1:])
    total = sum(nz)
    if total == 0:
        return None
    half = (total - 1) // 2
    seen = 0
    for lower, c in zip(_HIST_LOWER[1:], nz):
        seen += c
        if seen > half:
            return float(lower)
    return None


def _exact_stats(a: torch.Tensor, b: torch.Tensor, name: str) -> np.ndarray | None:
    """The ULP distances of the differing elements of two same-shaped tensors (int64 numpy
    array; at most :data:`MAX_KEPT_ULPS`, an even subsample beyond), or None without a ULP notion."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return None
    if _is_raw_fp8(name, a.dtype):
        # Raw FP8 bytes: the ULP is the code distance on the sign-magnitude line, which is the
        # same for E4M3 and E5M2 (only their NaN/Inf codes differ).
        a, b = a.view(torch.float8_e4m3fn), b.view(torch.float8_e4m3fn)
    if not is_ulp_dtype(a.dtype):
        return None
    fa, fb = a.reshape(-1), b.reshape(-1)
    ne = bit_view(fa) != bit_view(fb)
    fa, fb = fa[ne], fb[ne]
    if fa.numel() > MAX_KEPT_ULPS:
        stride = -(-fa.numel() // MAX_KEPT_ULPS)
        fa, fb = fa[::stride], fb[::stride]
    try:
        return ulp_distance(fa, fb).numpy()
    except ParityError:
        return None


def _row_from_diff(scenario: str, step: int, phase: str, rank: int, tensor: str, diff, a, b,
                   source: str) -> dict[str, Any]:
    """A row from a compare_tensors result, made exact (median, raw FP8 bytes) from the tensors."""
    ulps = _exact_stats(a, b, tensor) if diff.reason == "values" else None
    return _row(scenario, step, phase, rank, tensor, reason=diff.reason, dtype=diff.dtype_a,
                n_diff=diff.n_diff, numel=diff.numel, max_ulp=diff.max_ulp, hist=diff.ulp_hist,
                ulps=ulps, source=source)


def _frame(rows: list[dict[str, Any]], meta: dict[str, Any]) -> pd.DataFrame:
    df = pd.DataFrame(rows, columns=list(COLUMNS))
    if len(df):
        # stable: within a step, phase and rank, the rows keep the order they were read in, the
        # order the run compared its tensors (the report's table, a golden record)
        df = df.sort_values(["scenario", "step", "phase_idx", "rank"], kind="stable")
        df = df.reset_index(drop=True)
    for c in ("step", "phase_idx", "rank"):
        df[c] = df[c].astype("int64")
    for c in ("n_diff", "numel", "max_ulp", *_HIST_COLS):
        df[c] = pd.array([None if v is None or (isinstance(v, float) and math.isnan(v)) else int(v)
                          for v in df[c]], dtype="Int64")
    for c in ("frac_diff", "median_ulp"):
        df[c] = pd.to_numeric(df[c], errors="coerce").astype("float64")
    df["median_exact"] = df["median_exact"].astype(bool)
    df["ulps"] = df["ulps"].astype(object)
    df.attrs["parity"] = meta
    return df


# --------------------------------------------------------------------------------------------
# Reading runs
# --------------------------------------------------------------------------------------------


def _run_dir(run_dir: str | os.PathLike[str]) -> Path:
    p = Path(run_dir)
    if p.is_file() and p.name == "report.json":
        p = p.parent
    if not p.exists():
        raise UsageError(f"run directory {str(run_dir)!r} not found")
    if not p.is_dir():
        raise UsageError(f"{str(run_dir)!r} is not a run directory (give the --out directory of `parity run`)")
    return p


def _read_report(run: Path) -> dict[str, Any]:
    path = run / "report.json"
    if not path.is_file():
        raise UsageError(f"{run} has no report.json: give the --out directory of a `parity run`")
    try:
        with open(path) as f:
            rep = json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is not readable JSON ({e}); re-run `parity run`") from None
    if not isinstance(rep, dict) or not isinstance(rep.get("scenarios"), list):
        raise UsageError(f"{path} is not a parity report (no 'scenarios' list)")
    for e in rep["scenarios"]:
        if not isinstance(e, dict) or "name" not in e or "status" not in e:
            raise UsageError(f"{path} is malformed: a scenario entry lacks 'name'/'status'")
    return rep


def _snapshot_mode(rep: Mapping[str, Any]) -> str:
    argv = [str(a) for a in rep.get("argv") or []]
    for i, a in enumerate(argv):
        if a == "--snapshot" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--snapshot="):
            return a.split("=", 1)[1]
    return "divergent"


def _snap_dir(run: Path, scenario: str) -> Path:
    return run / "snapshots" / scenario


def _snap_keys(path: Path) -> list[str]:
    """The tensor names of a snapshot file, without loading the tensors."""
    import safetensors

    if not path.is_file():
        raise SnapshotError(f"snapshot {path} not found")
    try:
        with safetensors.safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    except (safetensors.SafetensorError, OSError) as e:
        raise SnapshotError(f"snapshot {path} is truncated or corrupt ({e}); re-create it") from None


def _scenario_meta(e: Mapping[str, Any], rep: Mapping[str, Any], mode: str) -> dict[str, Any]:
    sc = e.get("scenario") or {}
    by_phase = dict(e.get("compared_by_phase") or {})
    steps = int(e.get("steps") or 0)
    n_compared: dict[tuple[int, str], float] = {}
    if by_phase.get("init"):
        n_compared[(-1, "init")] = float(by_phase["init"])
    for ph in STEP_PHASES:
        if steps and by_phase.get(ph):
            n_compared.update({(s, ph): by_phase[ph] / steps for s in range(steps)})
    return {
        "status": e.get("status"),
        "steps": steps,
        "compared": int(e.get("compared") or 0),
        "compared_by_phase": by_phase,
        "n_compared": n_compared,
        "numel_compared": None,
        "has_grad_local": bool(by_phase.get("grad_local")) and not sc.get("overlap", False),
        "overlap": bool(sc.get("overlap", False)),
        "failed_checks": list(e.get("failed_checks") or []),
        "n_failed_checks": int(e.get("n_failed_checks") or len(e.get("failed_checks") or [])),
        "error": e.get("error"),
        "n_divergences": int(e.get("n_divergences") or 0),
        "truncated": False,
        "snapshot_mode": mode,
        "loss": list(e.get("loss") or []),
        "notes": [],
    }


def load_divergences(run_dir: str | os.PathLike[str], *, snapshots: bool = True) -> pd.DataFrame:
    """The divergences of one run (side A vs side B), one row per tensor, step, phase and rank.

    Args:
        run_dir: the ``--out`` directory of ``parity run`` (or its ``report.json``).
        snapshots: make rows exact from the snapshots where they hold both sides (exact
            median ULP, raw FP8 bytes' code distance) and recover rows that the report's
            table left out (it keeps at most 5000).

    Returns:
        A DataFrame with :data:`COLUMNS`; ``df.attrs["parity"]`` holds per-scenario facts
        (``steps``, ``compared``, ``failed_checks``, ...) under ``"scenarios"``.

    Raises:
        UsageError: not a run directory, or its report.json is missing or malformed (exit 2).
    """
    run = _run_dir(run_dir)
    rep = _read_report(run)
    mode = _snapshot_mode(rep)
    rows: list[dict[str, Any]] = []
    metas: dict[str, dict[str, Any]] = {}
    for e in rep["scenarios"]:
        name = e["name"]
        meta = _scenario_meta(e, rep, mode)
        metas[name] = meta
        srows = []
        for d in e.get("divergence_table") or []:
            try:
                srows.append(_row(name, int(d["step"]), str(d["phase"]), int(d["rank"]),
                                  _tensor_from_path(str(d["path"])), n_diff=d.get("n_diff"),
                                  numel=d.get("numel"), max_ulp=d.get("max_ulp"), hist=d.get("ulp_hist"),
                                  reason="values" if d.get("n_diff") is not None else "dtype"))
            except (KeyError, TypeError, ValueError):
                raise UsageError(f"{run / 'report.json'}: malformed divergence_table row {d!r}") from None
        meta["truncated"] = meta["n_divergences"] > len(srows)
        if snapshots and mode != "none":
            srows = _enrich_from_snapshots(run, name, srows, meta)
        rows += srows
    return _frame(rows, {"mode": "run", "run": str(run), "against": None, "scenarios": metas,
                         "platform": rep.get("platform")})


def _enrich_from_snapshots(run: Path, scenario: str, rows: list[dict[str, Any]],
                           meta: dict[str, Any]) -> list[dict[str, Any]]:
    """Exact statistics from the snapshots; rows the report's table dropped are recovered."""
    d = _snap_dir(run, scenario)
    if not d.is_dir():
        return rows
    by_file: dict[tuple[int, int], list[int]] = {}
    for i, r in enumerate(rows):
        if r["step"] >= 0:
            by_file.setdefault((r["step"], r["rank"]), []).append(i)
    files = sorted(p for p in d.glob("step_*_rank_*.safetensors"))
    wanted: set[tuple[int, int]] = set(by_file)
    if meta["truncated"]:  # the report kept 5000 rows: walk every snapshot for the rest
        for p in files:
            m = re.match(r"step_(\d+)_rank_(\d+)\.safetensors$", p.name)
            if m:
                wanted.add((int(m.group(1)), int(m.group(2))))
    out = list(rows)
    have = {(r["step"], r["phase"], r["rank"], r["tensor"]) for r in rows}
    stale: list[str] = []
    for step, rank in sorted(wanted):
        path = d / snapshot_filename(step, rank)
        if not path.is_file():
            continue
        try:
            keys = set(_snap_keys(path))
            idx = by_file.get((step, rank), [])
            need = []
            for i in idx:
                r = out[i]
                ka, kb = f"A/{r['phase']}/{r['tensor']}", f"B/{r['phase']}/{r['tensor']}"
                if ka in keys and kb in keys:
                    need += [ka, kb]
            if meta["truncated"]:
                need = sorted(keys)
            if not need:
                continue
            tensors = _load_snapshot(path)
        except SnapshotError as e:
            meta["notes"].append(f"snapshot unreadable, report statistics used: {e}")
            continue
        for i in by_file.get((step, rank), []):
            r = out[i]
            a, b = tensors.get(f"B/{r['phase']}/{r['tensor']}"), tensors.get(f"A/{r['phase']}/{r['tensor']}")
            if a is None or b is None:
                continue
            ulps = _exact_stats(a, b, r["tensor"])
            if ulps is not None and len(ulps) and r["n_diff"] is not None and (
                    (len(ulps) < MAX_KEPT_ULPS and len(ulps) != r["n_diff"])
                    or (r["max_ulp"] is not None and len(ulps) == r["n_diff"] and int(ulps.max()) != r["max_ulp"])):
                # The snapshot does not hold what the run compared (e.g. a live tensor that was
                # updated in place before it was saved): the report's statistics stand.
                stale.append(f"step {step}/{r['phase']}/{r['tensor']}/rank {rank}")
                continue
            if ulps is not None and len(ulps):
                exact = r["n_diff"] is None or len(ulps) == r["n_diff"]
                r["ulps"] = ulps
                if r["max_ulp"] is None or exact:
                    r["max_ulp"] = int(ulps.max())
                r["median_ulp"] = _median_of(ulps)
                r["median_exact"] = exact
                r["source"] = "report+snapshot"
        if meta["truncated"]:
            for ka in sorted(k for k in tensors if k.startswith("A/")):
                phase, tname = ka[2:].split("/", 1)
                kb = "B/" + ka[2:]
                if kb not in tensors or (step, phase, rank, tname) in have:
                    continue
                diff = compare_tensors(tensors[kb], tensors[ka], f"step {step}/{phase}/{tname}/rank {rank}")
                if not diff.equal:
                    out.append(_row_from_diff(scenario, step, phase, rank, tname, diff, tensors[kb],
                                              tensors[ka], "snapshot"))
                    have.add((step, phase, rank, tname))
    if stale:
        meta["notes"].append(
            f"{len(stale)} snapshot tensor(s) do not match what the run compared (report statistics kept; "
            f"their medians are estimated), first: {stale[0]}; a snapshot of a live tensor taken after a "
            "later phase updated it in place would do this")
    if meta["truncated"]:
        recovered = len(out)
        meta["notes"].append(f"the report's divergence table holds {len(rows)} of {meta['n_divergences']} "
                             f"divergences; {recovered} recovered from the snapshots")
        meta["truncated"] = recovered < meta["n_divergences"]
    return out


# --------------------------------------------------------------------------------------------
# Two runs: side A of RUN vs side A of OTHER (the reference)
# --------------------------------------------------------------------------------------------


def _pair_scenarios(rep_a: Mapping[str, Any], rep_b: Mapping[str, Any], a: Path, b: Path) -> list[tuple[dict, dict]]:
    ea = [e for e in rep_a["scenarios"]]
    eb = {e["name"]: e for e in rep_b["scenarios"]}
    if len(ea) == 1 and len(eb) == 1:
        return [(ea[0], next(iter(eb.values())))]
    pairs = [(e, eb[e["name"]]) for e in ea if e["name"] in eb]
    if not pairs:
        raise UsageError(f"{a} and {b} have no scenario in common (names: {[e['name'] for e in ea]} vs "
                         f"{sorted(eb)})")
    return pairs


def _all_snapshots(run: Path, entry: Mapping[str, Any], mode: str) -> dict[tuple[int, int], Path]:
    """(step, rank) -> file for every step of a ``--snapshot all`` run; a clean error otherwise."""
    d = _snap_dir(run, entry["name"])
    if entry.get("status") == "error":
        raise UsageError(f"{run}: scenario {entry['name']} failed to run ({entry.get('error')}); nothing to compare")
    files: dict[tuple[int, int], Path] = {}
    if d.is_dir():
        for p in d.iterdir():
            m = re.match(r"^step_(\d+)_rank_(\d+)\.safetensors$", p.name)
            if m:
                files[(int(m.group(1)), int(m.group(2)))] = p
    steps = int(entry.get("steps") or 0)
    have_steps = {s for s, _ in files}
    missing = [s for s in range(steps) if s not in have_steps]
    if mode != "all" or not files or missing:
        what = (f"no snapshots for steps {missing[:5]}{'...' if len(missing) > 5 else ''}" if files
                else "no snapshots")
        raise UsageError(f"{run}: scenario {entry['name']} has {what} (snapshot mode {mode!r}); "
                         "--against needs both runs made with `parity run --snapshot all`")
    return files


def _side(tensors: Mapping[str, torch.Tensor], side: str = "A") -> dict[str, torch.Tensor]:
    pre = side + "/"
    return {k[len(pre):]: v for k, v in tensors.items() if k.startswith(pre)}


def _load_snapshot(path: Path) -> dict[str, torch.Tensor]:
    """All tensors of a snapshot, as views of the memory-mapped file (triage only reads them)."""
    return read_snapshot(path, copy=False)[0]


def _read_side(path: Path, side: str = "A") -> dict[str, torch.Tensor]:
    """One side's tensors of a snapshot, keyed ``phase/name``."""
    out = _side(_load_snapshot(path), side)
    if not out:
        raise SnapshotError(f"snapshot {path} holds no side-{side} tensors")
    return out


def compare_runs(run_dir: str | os.PathLike[str], other_dir: str | os.PathLike[str]) -> pd.DataFrame:
    """Side A of ``run_dir`` vs side A of ``other_dir`` (the reference), bit for bit.

    Both runs must have been made with ``--snapshot all`` (every step's tensors). Steps and
    ranks are paired by number; scenarios by name (or the single one of each run). A tensor
    present on one side only is a row with reason ``missing`` (only in OTHER) or ``extra``.

    Returns:
        The divergence table (:data:`COLUMNS`), with exact comparison counts per step and
        phase in ``df.attrs["parity"]["scenarios"][name]["n_compared"]``.

    Raises:
        UsageError / SnapshotError: not run directories, no ``all`` snapshots, unreadable files.
    """
    run, other = _run_dir(run_dir), _run_dir(other_dir)
    rep_a, rep_b = _read_report(run), _read_report(other)
    mode_a, mode_b = _snapshot_mode(rep_a), _snapshot_mode(rep_b)
    rows: list[dict[str, Any]] = []
    metas: dict[str, dict[str, Any]] = {}
    for ea, eb in _pair_scenarios(rep_a, rep_b, run, other):
        name = ea["name"]
        fa, fb = _all_snapshots(run, ea, mode_a), _all_snapshots(other, eb, mode_b)
        meta = _scenario_meta(ea, rep_a, mode_a)
        meta.update(n_compared={}, numel_compared={}, failed_checks=[], n_failed_checks=0, n_divergences=0,
                    status="compared", compared=0, compared_by_phase={}, has_grad_local=False)
        if ea["name"] != eb["name"]:
            meta["notes"].append(f"scenario names differ: {ea['name']} vs {eb['name']} (paired as the only ones)")
        common = sorted(set(fa) & set(fb))
        only = sorted(set(fa) ^ set(fb))
        if only:
            meta["notes"].append(f"{len(only)} (step, rank) snapshots exist in one run only, first: "
                                 f"step {only[0][0]} rank {only[0][1]}")
        steps = sorted({s for s, _ in common})
        meta["steps"] = len(steps)
        if ea.get("steps") != eb.get("steps"):
            meta["notes"].append(f"the runs have {ea.get('steps')} and {eb.get('steps')} steps; "
                                 f"compared the {len(steps)} in common")
        for step, rank in common:
            a, b = _read_side(fa[(step, rank)]), _read_side(fb[(step, rank)])
            written = {k: i for i, k in enumerate([*a, *(k for k in b if k not in a)])}  # the stack's order
            for k in sorted(written, key=lambda k: (_PHASE_IDX.get(k.split("/", 1)[0], 99), written[k])):
                phase, tname = k.split("/", 1)
                key = (step, phase)
                meta["n_compared"][key] = meta["n_compared"].get(key, 0) + 1
                meta["compared"] += 1
                meta["compared_by_phase"][phase] = meta["compared_by_phase"].get(phase, 0) + 1
                if k not in a or k not in b:
                    rows.append(_row(name, step, phase, rank, tname, reason="missing" if k in b else "extra",
                                     source="against"))
                    continue
                meta["numel_compared"][key] = meta["numel_compared"].get(key, 0) + b[k].numel()
                diff = compare_tensors(b[k], a[k], f"step {step}/{k}/rank {rank}")
                if not diff.equal:
                    rows.append(_row_from_diff(name, step, phase, rank, tname, diff, b[k], a[k], "against"))
        meta["has_grad_local"] = bool(meta["compared_by_phase"].get("grad_local"))
        meta["n_divergences"] = sum(1 for r in rows if r["scenario"] == name)
        metas[name] = meta
    return _frame(rows, {"mode": "against", "run": str(run), "against": str(other), "scenarios": metas,
                         "platform": rep_a.get("platform"), "platform_against": rep_b.get("platform")})


# --------------------------------------------------------------------------------------------
# A run vs its golden record
# --------------------------------------------------------------------------------------------


def compare_golden(run_dir: str | os.PathLike[str], root: str | os.PathLike[str] | None = None, *,
                   allow_other_platform: bool = False) -> pd.DataFrame:
    """The tested side of ``run_dir`` vs the golden of each of its scenarios.

    Reads the run's record (``RUN/golden/<scenario>/``, written by ``parity run`` with golden
    checking on) and compares it through :func:`parity.harness.golden.compare`: one row per
    tensor record whose digest differs (every step, every rank), with element statistics (ULP
    histogram, exact medians) where both hold the tensors (rank 0 at the stored steps) and the
    loss's ULP distance at every step.

    Raises:
        GoldenError: no usable golden for a scenario (exit 2).
        UsageError: the run holds no record for a scenario.
    """
    from parity.harness import golden
    from parity.harness.goldens_cli import default_root
    from parity.harness.scenario import make_scenario

    run = _run_dir(run_dir)
    rep = _read_report(run)
    groot = Path(root) if root else default_root()
    rows: list[dict[str, Any]] = []
    metas: dict[str, dict[str, Any]] = {}
    for e in rep["scenarios"]:
        name = e["name"]
        rdir = run / "golden" / name
        if not (rdir / golden.MANIFEST_NAME).is_file():
            raise UsageError(f"{run}: scenario {name} has no golden record in {rdir} (it ran with `--golden off`, "
                             "or failed): run it with golden checking on, then triage")
        rec = golden.load(rdir)
        scenario = make_scenario({k: v for k, v in (e.get("scenario") or {}).items()}, source=str(run))
        g, tier = golden.find(groot, scenario, rec.platform, allow_other_platform=allow_other_platform)
        more, metas[name] = golden_rows(name, golden.compare(g, rec, tier), e, rep)
        rows += more
    return _frame(rows, {"mode": "golden", "run": str(run), "against": str(groot), "scenarios": metas,
                         "platform": rep.get("platform")})


def golden_rows(name: str, c, entry: Mapping[str, Any], rep: Mapping[str, Any]) -> tuple[list[dict[str, Any]], dict]:
    """Triage rows and scenario meta of a golden comparison (:func:`parity.harness.golden.compare`):
    element statistics where both records hold the tensors, the loss's ULP distance everywhere."""
    g, rec = c.golden, c.run
    drift = {(s, k): t for s, k, t in c.drift}
    rows = []
    for d in c.differences:
        key = f"{d.phase}/{d.tensor}"
        t = drift.get((d.step, key)) if d.rank == 0 else None
        if t is not None:
            rows.append(_row_from_diff(name, d.step, d.phase, 0, d.tensor, t, g.tensors(d.step)[key],
                                       rec.tensors(d.step)[key], "golden"))
            continue
        gl, rl = g.ranks[d.rank].loss[d.step], rec.ranks[d.rank].loss[d.step]
        if key == "forward/loss" and d.reason == "digest" and gl and rl:
            u = int(ulp_distance(_bits32(gl), _bits32(rl))[0])
            rows.append(_row(name, d.step, d.phase, d.rank, d.tensor, dtype="float32", n_diff=1, numel=1,
                             max_ulp=u, ulps=np.array([u], dtype=np.int64), source="golden"))
            continue
        rows.append(_row(name, d.step, d.phase, d.rank, d.tensor, reason=d.reason, source="golden",
                         dtype=(rec.ranks[d.rank].keys.get(key) or g.ranks[d.rank].keys.get(key) or (None,))[0]))
    meta = _scenario_meta(entry, rep, "golden")
    by_phase: dict[str, int] = {}
    for (_, phase), n in c.n_compared.items():
        by_phase[phase] = by_phase.get(phase, 0) + n
    meta.update(n_compared=dict(c.n_compared), numel_compared=None, failed_checks=[], n_failed_checks=0,
                status=f"golden {c.status} ({c.tier} tier)", compared=sum(by_phase.values()),
                compared_by_phase=by_phase, steps=c.steps, notes=[c.summary()] + c.notes, golden=str(g.path),
                has_grad_local=bool(by_phase.get("grad_local")), n_divergences=len(rows))
    return rows, meta


def golden_frame(name: str, c, entry: Mapping[str, Any], rep: Mapping[str, Any], against: str) -> pd.DataFrame:
    """The divergence table of one golden comparison, ready for :func:`write_triage`."""
    rows, meta = golden_rows(name, c, entry, rep)
    return _frame(rows, {"mode": "golden", "run": str(rep.get("run", "")), "against": against,
                         "scenarios": {name: meta}, "platform": rep.get("platform")})


def _bits32(hexbits: str) -> torch.Tensor:
    return torch.tensor([int(hexbits, 16)], dtype=torch.int64).to(torch.int32).view(torch.float32)


# --------------------------------------------------------------------------------------------
# Aggregations
# --------------------------------------------------------------------------------------------


def _meta(df: pd.DataFrame, meta: Mapping[str, Any] | None) -> dict[str, Any]:
    if meta is not None:
        return dict(meta)
    return dict(df.attrs.get("parity") or {})


def _merge_ulps(g: pd.DataFrame) -> np.ndarray | None:
    """All rows' ULP arrays concatenated, or None unless every row with elements has an exact one."""
    parts = []
    for u, n, ex in zip(g["ulps"], g["n_diff"], g["median_exact"]):
        if n is pd.NA:
            continue
        if not isinstance(u, np.ndarray) or not ex:
            return None
        parts.append(u)
    return np.concatenate(parts) if parts else None  # a fresh array, even of one part


def _group_stats(g: pd.DataFrame) -> dict[str, Any]:
    n_diff = g["n_diff"].dropna()
    numel = g.loc[g["n_diff"].notna(), "numel"].dropna()
    ulps = g["max_ulp"].dropna()
    merged = _merge_ulps(g)
    if merged is not None and len(merged):
        median, exact = _median_of(merged, scratch=True), True
    else:
        hist = [int(g[c].dropna().sum()) for c in _HIST_COLS]
        median, exact = _median_from_hist(hist), False
    n_el = int(n_diff.sum()) if len(n_diff) else 0
    n_numel = int(numel.sum()) if len(numel) else 0
    return {
        "n_tensors": int(len(g)),
        "n_names": int(g["tensor"].nunique()),
        "n_diff": n_el,
        "numel": n_numel,
        "frac_diff": (n_el / n_numel) if n_numel else float("nan"),
        "max_ulp": int(ulps.max()) if len(ulps) else pd.NA,
        "median_ulp": median if median is not None else float("nan"),
        "median_exact": exact,
    }


_STAT_COLS = ("n_tensors", "n_names", "n_diff", "numel", "frac_diff", "max_ulp", "median_ulp", "median_exact")


def _typed(out: pd.DataFrame) -> pd.DataFrame:
    for c in ("n_tensors", "n_names", "n_diff", "numel"):
        if c in out:
            out[c] = out[c].astype("int64")
    if "max_ulp" in out:
        out["max_ulp"] = pd.array(list(out["max_ulp"]), dtype="Int64")
    for c in ("frac_diff", "median_ulp"):
        if c in out:
            out[c] = out[c].astype("float64")
    return out


def per_step_phase(df: pd.DataFrame, steps: int | None = None, *, meta: Mapping[str, Any] | None = None,
                   fill: bool = True) -> pd.DataFrame:
    """Per scenario, step and phase: differing tensors, elements, max and median ULP.

    Columns: scenario, step, phase, n_tensors (differing tensor comparisons, tensor x rank),
    n_names (distinct tensor names), n_compared (comparisons made, where known), n_diff
    (differing elements), numel (elements of the differing tensors), frac_diff (n_diff /
    numel), frac_tensors (n_tensors / n_compared), max_ulp, median_ulp (over differing
    elements), median_exact.

    With ``fill`` (and the step count known from ``steps`` or the frame's meta), every phase of
    every step from the first divergent one to the last is listed, equal ones with zeros.
    """
    m = _meta(df, meta)
    scen_meta = m.get("scenarios") or {}
    recs: list[dict[str, Any]] = []
    for (scen, step, pidx, phase), g in df.groupby(["scenario", "step", "phase_idx", "phase"], sort=True):
        recs.append({"scenario": scen, "step": int(step), "phase_idx": int(pidx), "phase": phase, **_group_stats(g)})
    if fill:
        names = list(scen_meta) or sorted(df["scenario"].unique())
        have = {(r["scenario"], r["step"], r["phase"]) for r in recs}
        for scen in names:
            sm = scen_meta.get(scen, {})
            n = steps if steps is not None else sm.get("steps")
            sub = df[df["scenario"] == scen]
            if not n or sub.empty:
                continue
            first = int(sub["step"].min())
            phases = [p for p in STEP_PHASES if not (p == "grad_local" and not sm.get("has_grad_local", True))]
            for s in range(max(first, 0), int(n)):
                for p in phases:
                    if (scen, s, p) not in have:
                        recs.append({"scenario": scen, "step": s, "phase_idx": _PHASE_IDX[p], "phase": p,
                                     "n_tensors": 0, "n_names": 0, "n_diff": 0, "numel": 0,
                                     "frac_diff": 0.0, "max_ulp": 0, "median_ulp": float("nan"),
                                     "median_exact": True})
    out = pd.DataFrame(recs, columns=["scenario", "step", "phase_idx", "phase", *_STAT_COLS])
    if out.empty:
        out["n_compared"] = pd.Series(dtype="float64")
        out["frac_tensors"] = pd.Series(dtype="float64")
        return _typed(out)
    out = out.sort_values(["scenario", "step", "phase_idx"]).reset_index(drop=True)
    ncmp = []
    for r in out.itertuples():
        nc = (scen_meta.get(r.scenario, {}).get("n_compared") or {}).get((r.step, r.phase))
        ncmp.append(float(nc) if nc is not None else float("nan"))
    out["n_compared"] = ncmp
    out["frac_tensors"] = out["n_tensors"] / out["n_compared"]
    out = out[["scenario", "step", "phase_idx", "phase", "n_tensors", "n_names", "n_compared", "frac_tensors",
               "n_diff", "numel", "frac_diff", "max_ulp", "median_ulp", "median_exact"]]
    return _typed(out)


def drift(df: pd.DataFrame, steps: int | None = None, *, meta: Mapping[str, Any] | None = None) -> pd.DataFrame:
    """Per scenario and step (all phases): differing tensors and elements, max ULP, and the
    growth over the previous step (``growth`` = n_tensors / previous n_tensors).

    Lists every step from the first divergent one to the last run (equal steps with zeros)."""
    m = _meta(df, meta)
    scen_meta = m.get("scenarios") or {}
    recs = []
    for scen, sub in df.groupby("scenario", sort=True):
        n = steps if steps is not None else (scen_meta.get(scen, {}).get("steps") or 0)
        first = int(sub["step"].min())
        last = max(int(sub["step"].max()), int(n) - 1)
        for s in range(first, last + 1):
            g = sub[sub["step"] == s]
            if g.empty:
                st = {"n_tensors": 0, "n_names": 0, "n_diff": 0, "numel": 0, "frac_diff": 0.0, "max_ulp": 0,
                      "median_ulp": float("nan"), "median_exact": True}
                phases = ""
            else:
                st = _group_stats(g)
                phases = ",".join(p for p in DATAFLOW if p in set(g["phase"]))
            recs.append({"scenario": scen, "step": s, **st, "phases": phases})
    out = pd.DataFrame(recs, columns=["scenario", "step", *_STAT_COLS, "phases"])
    if out.empty:
        out["growth"] = pd.Series(dtype="float64")
        return _typed(out)
    prev = out.groupby("scenario")["n_tensors"].shift(1)
    out["growth"] = [(float(n) / float(p)) if (p == p and p) else float("nan")
                     for n, p in zip(out["n_tensors"], prev)]
    return _typed(out)


def _breakdown(df: pd.DataFrame, keys: list[str]) -> pd.DataFrame:
    recs = []
    for key, g in df.groupby(["scenario", *keys], sort=True):
        g = g.sort_values(["step", "phase_idx", "rank"], kind="stable")
        first = g.iloc[0]
        recs.append({**dict(zip(["scenario", *keys], key)), "first_step": int(first["step"]),
                     "first_phase": first["phase"], "first_tensor": first["tensor"],
                     "n_steps": int(g["step"].nunique()), **_group_stats(g)})
    cols = ["scenario", *keys, "first_step", "first_phase", "first_tensor", "n_steps", *_STAT_COLS]
    out = pd.DataFrame(recs, columns=cols)
    if out.empty:
        return _typed(out)
    ph = out["first_phase"].map(_PHASE_IDX)
    out = out.assign(_p=ph).sort_values(["scenario", "first_step", "_p", *keys]).drop(columns="_p")
    return _typed(out.reset_index(drop=True))


def per_param(df: pd.DataFrame) -> pd.DataFrame:
    """Per scenario, layer and param: where it first differs, over how many steps, how much."""
    return _breakdown(df, ["layer", "param"])


def per_layer(df: pd.DataFrame) -> pd.DataFrame:
    """Per scenario and layer (``layers.N``, or the top-level module): the same as :func:`per_param`."""
    return _breakdown(df, ["layer"])


# --------------------------------------------------------------------------------------------
# Diagnosis
# --------------------------------------------------------------------------------------------


def first_divergence(df: pd.DataFrame) -> dict[str, Any] | None:
    """The earliest divergence in dataflow order: (step, phase, rank) smallest, and of those the
    first tensor the run compared (the table's order); None if none.

    Returns a dict with scenario, step, phase, tensor, rank, param, layer, n_diff, numel,
    max_ulp, reason, and n_tensors (differing tensor comparisons at that step and phase)."""
    if df.empty:
        return None
    d = df.sort_values(["step", "phase_idx", "rank"], kind="stable")
    r = d.iloc[0]
    same = df[(df["scenario"] == r["scenario"]) & (df["step"] == r["step"]) & (df["phase"] == r["phase"])]

    def val(v):
        return None if v is pd.NA or (isinstance(v, float) and math.isnan(v)) else (int(v) if not isinstance(v, float) else v)

    return {"scenario": r["scenario"], "step": int(r["step"]), "phase": r["phase"], "tensor": r["tensor"],
            "rank": int(r["rank"]), "param": r["param"], "layer": r["layer"], "reason": r["reason"],
            "n_diff": val(r["n_diff"]), "numel": val(r["numel"]), "max_ulp": val(r["max_ulp"]),
            "n_tensors": int(len(same)), "n_names": int(same["tensor"].nunique())}


def origin(df: pd.DataFrame) -> dict[str, Any] | None:
    """Where the divergence originates: the first divergent step of the first scenario that has
    one, its phases in dataflow order, and the first one."""
    fd = first_divergence(df)
    if fd is None:
        return None
    sub = df[(df["scenario"] == fd["scenario"]) & (df["step"] == fd["step"])]
    chain = [p for p in DATAFLOW if p in set(sub["phase"])]
    return {"scenario": fd["scenario"], "step": fd["step"], "phase": fd["phase"], "chain": chain}


def _fmt_ulp(u: Any) -> str:
    if u is None or u is pd.NA or (isinstance(u, float) and math.isnan(u)):
        return "n/a"
    return fmt_ulp(int(u))


def _why(phase: str, step: int, rows: pd.DataFrame, smeta: Mapping[str, Any], mode: str) -> str:
    """The diagnosis in words for the phase a divergence originates in."""
    names = list(rows["tensor"])
    if phase == "init":
        return "masters differ before any update: master seeding changed"
    if phase == "forward":
        ctx = (" (at step 0, from the initial weights)" if step == 0 else
               f" (params synced equal after step {step - 1})")
        if mode == "golden" and set(names) <= {"*", "loss"}:
            return "forward (loss or outputs) differs first" + ctx + ": the forward (weights or GEMM) changed"
        return "forward output differs first" + ctx + ": the forward (weights or GEMM) changed"
    if phase == "grad_local":
        return "forward equal, local grads differ: the backward changed"
    if phase == "grad_reduce":
        if smeta.get("has_grad_local", True):
            return "local grads equal, reduced grads differ: the reduction changed"
        return ("forward equal, reduced grads differ (no local-grad capture with overlap on): "
                "the backward or the reduction changed")
    if phase == "optimizer":
        kinds = sorted({kind_of(n, phase) for n in names})
        if kinds == ["master"]:
            return "reduced grads equal, masters differ after the update: the optimizer step changed"
        if "master" not in kinds and kinds != ["tensor"]:
            return (f"reduced grads equal, optimizer state differs ({', '.join(kinds)}) while masters are "
                    "equal: the optimizer step (its state update) changed")
        return "reduced grads equal, optimizer output differs: the optimizer step changed"
    if phase == "param_sync":
        if names and all(".fp8." in n for n in names):
            parts = sorted({n.split(".fp8.", 1)[1] for n in names})
            return (f"masters equal, synced FP8 params differ ({', '.join(parts)}): the FP8 cast/quantization "
                    "or the param gather changed")
        return "masters equal, synced params differ: the param cast or the param gather changed"
    return f"{phase} differs first"


def _diagnose_one(df: pd.DataFrame, name: str, smeta: Mapping[str, Any], mode: str) -> str:
    sub = df[df["scenario"] == name]
    if sub.empty:
        if smeta.get("status") == "error":
            return f"the run failed, nothing was compared: {smeta.get('error')}"
        n, s = smeta.get("compared", 0), smeta.get("steps", 0)
        if smeta.get("n_failed_checks"):
            c = (smeta.get("failed_checks") or [{}])[0]
            return (f"no tensor divergence in {n} comparisons over {s} steps, but {smeta['n_failed_checks']} "
                    f"check(s) failed, first: {c.get('check')}: {c.get('message')}")
        if n == 0:
            return "nothing was compared: the run holds no comparisons (a vacuous pass proves nothing)"
        return f"no divergence: all {n} comparisons over {s} steps equal"
    fd = first_divergence(sub)
    rows = sub[(sub["step"] == fd["step"]) & (sub["phase"] == fd["phase"])]
    how = []
    if fd["reason"] in ("values",) and fd["n_diff"] is not None:
        how.append(f"{fd['n_diff']} element{'s' if fd['n_diff'] != 1 else ''}")
        how.append(f"max {_fmt_ulp(fd['max_ulp'])} ULP")
    elif fd["reason"] == "digest":
        how.append("digest differs")
    else:
        how.append(fd["reason"])
    if fd["n_tensors"] > 1:
        how.append(f"{fd['n_tensors']} tensor comparisons differ in that phase")
    where = f"step {fd['step']} / {fd['phase']} / {fd['tensor']} / rank {fd['rank']}"
    return f"first divergence at {where} ({', '.join(how)}): {_why(fd['phase'], fd['step'], rows, smeta, mode)}"


def diagnose(df: pd.DataFrame, *, meta: Mapping[str, Any] | None = None) -> str:
    """One line per scenario (joined with "; " when several): where the divergence starts and
    what that says, e.g. ``local grads equal, reduced grads differ: the reduction changed``;
    for a clean run ``no divergence: all N comparisons over S steps equal``."""
    m = _meta(df, meta)
    scen = m.get("scenarios") or {}
    mode = m.get("mode", "run")
    names = list(scen) or sorted(df["scenario"].unique())
    if not names:
        return "no divergence: nothing in the table"
    lines = [_diagnose_one(df, n, scen.get(n, {}), mode) for n in names]
    if len(lines) == 1:
        return lines[0]
    return "; ".join(f"{n}: {line}" for n, line in zip(names, lines))


def drift_summary(df: pd.DataFrame, *, meta: Mapping[str, Any] | None = None) -> list[str]:
    """Per scenario with a divergence, one line on how the drift evolves after the first step."""
    return _drift_lines(drift(df, meta=meta))


def _drift_lines(dr: pd.DataFrame) -> list[str]:
    """:func:`drift_summary` from the :func:`drift` table ``dr``."""
    out = []
    for scen, g in dr.groupby("scenario", sort=True):
        g = g[g["step"] >= 0]
        if g.empty:
            continue
        first, last = g.iloc[0], g.iloc[-1]
        counts = ", ".join(f"step {int(r.step)}: {int(r.n_tensors)}" for r in g.itertuples())
        if len(g) == 1:
            word = f"diverges at the last step run ({int(first.n_tensors)} tensor comparisons); no later steps"
        elif last.n_tensors > first.n_tensors:
            word = (f"drift spreads: {int(first.n_tensors)} differing tensor comparisons at step {int(first.step)} "
                    f"-> {int(last.n_tensors)} at step {int(last.step)}; max ULP {_fmt_ulp(first.max_ulp)} -> "
                    f"{_fmt_ulp(last.max_ulp)}")
        elif (g["n_tensors"].iloc[1:] == 0).all():
            word = (f"drift absorbed: differences at step {int(first.step)} only, steps {int(first.step) + 1}-"
                    f"{int(last.step)} equal")
        elif last.n_tensors == 0:
            nz = g[g["n_tensors"] > 0]
            word = f"drift dies out: the last differing step is {int(nz['step'].max())}"
        else:
            word = (f"drift persists without growing: {int(first.n_tensors)} at step {int(first.step)}, "
                    f"{int(last.n_tensors)} at step {int(last.step)}")
        out.append(f"{scen}: {word} (differing tensor comparisons per step: {counts})")
    return out


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _md_table(df: pd.DataFrame, cols: list[str], max_rows: int | None = None) -> str:
    if df.empty:
        return "_(none)_\n"
    shown = df if max_rows is None else df.head(max_rows)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in shown.itertuples(index=False):
        d = r._asdict()
        cells = []
        for c in cols:
            v = d.get(c)
            if c in ("max_ulp",):
                cells.append(_fmt_ulp(v))
            elif c in ("frac_diff", "frac_tensors"):
                cells.append("-" if v is None or v is pd.NA or (isinstance(v, float) and math.isnan(v))
                             else f"{100 * float(v):.3g}%")
            elif c == "median_ulp":
                if v is None or (isinstance(v, float) and math.isnan(v)):
                    cells.append("-")
                else:
                    cells.append(f"{v:g}" + ("" if d.get("median_exact", True) else " (est.)"))
            elif c == "growth":
                cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"x{v:.3g}")
            elif c == "n_compared":
                cells.append("-" if v is None or (isinstance(v, float) and math.isnan(v)) else
                             (f"{v:.0f}" if float(v).is_integer() else f"~{v:.1f}"))
            else:
                cells.append("-" if v is None or v is pd.NA else str(v).replace("|", "\\|"))
        lines.append("| " + " | ".join(cells) + " |")
    more = "" if max_rows is None or len(df) <= max_rows else f"\n_({len(df) - max_rows} more rows in the CSV)_\n"
    return "\n".join(lines) + "\n" + more


def breakdowns(df: pd.DataFrame, *, meta: Mapping[str, Any] | None = None) -> dict[str, pd.DataFrame]:
    """The tables ``triage.md`` and the CSV files show, each computed once: ``per_step_phase``,
    ``drift``, ``per_layer``, ``per_param`` (every scenario; each has a ``scenario`` column)."""
    m = _meta(df, meta)
    return {"per_step_phase": per_step_phase(df, meta=m), "drift": drift(df, meta=m),
            "per_layer": per_layer(df), "per_param": per_param(df)}


def _of(table: pd.DataFrame, scenario: str) -> pd.DataFrame:
    return table[table["scenario"] == scenario].reset_index(drop=True)


def render_markdown(df: pd.DataFrame, *, meta: Mapping[str, Any] | None = None,
                    plots: Mapping[str, Any] | None = None, files: Iterable[str] = (),
                    tables: Mapping[str, pd.DataFrame] | None = None) -> str:
    """The ``triage.md`` text (``tables``: :func:`breakdowns` of ``df``, where the caller has them;
    each breakdown groups by scenario first, so a scenario's rows of it are its own breakdown)."""
    m = _meta(df, meta)
    tables = tables if tables is not None else breakdowns(df, meta=m)
    mode = m.get("mode", "run")
    scen = m.get("scenarios") or {}
    head = ["# parity triage", "", f"- run: `{m.get('run')}`"]
    if mode == "against":
        head.append(f"- against run: `{m.get('against')}` (reference: its side A; tested: this run's side A)")
        pa, pb = m.get("platform") or {}, m.get("platform_against") or {}
        dif = {k: (pb.get(k), pa.get(k)) for k in sorted(set(pa) | set(pb)) if pa.get(k) != pb.get(k)}
        if dif:
            head.append("- platforms differ: " + ", ".join(f"{k}: {b} vs {a}" for k, (b, a) in dif.items()))
    elif mode == "golden":
        head.append(f"- against golden records under `{m.get('against')}` (reference: the golden; tested: side A)")
    else:
        head.append("- compared: side A (knob ON, under test) vs side B (knob OFF, reference), as the run did")
    head.append(f"- phases in dataflow order: {' -> '.join(DATAFLOW)} (init = step -1, masters at construction)")
    out = head + [""]
    for name in (list(scen) or sorted(df["scenario"].unique())):
        sm = scen.get(name, {})
        sub = df[df["scenario"] == name]
        out += [f"## {name}", "", f"status: {sm.get('status')}; {sm.get('steps')} steps; "
                f"{sm.get('compared')} comparisons; {len(sub)} differing", ""]
        out += [f"**Diagnosis:** {_diagnose_one(df, name, sm, mode)}", ""]
        for note in sm.get("notes") or []:
            out.append(f"- note: {note}")
        if sm.get("truncated"):
            out.append(f"- note: the report lists only part of the {sm.get('n_divergences')} divergences and no "
                       "snapshots hold the rest: counts below are lower bounds")
        if sm.get("n_failed_checks"):
            out.append(f"- {sm['n_failed_checks']} check(s) failed; first ones:")
            for c in (sm.get("failed_checks") or [])[:5]:
                out.append(f"  - step {c.get('step')} {c.get('check')} (rank {c.get('rank')}): {c.get('message')}")
        if sub.empty:
            out.append("")
            continue
        fd = first_divergence(sub)
        org = origin(sub)
        out += ["", "### First divergence", "",
                "| step | phase | tensor | rank | elements differ | max ULP | tensor comparisons differing in that phase |",
                "|---|---|---|---|---|---|---|",
                f"| {fd['step']} | {fd['phase']} | {fd['tensor']} | {fd['rank']} | "
                f"{fd['n_diff'] if fd['n_diff'] is not None else '-'} of {fd['numel'] if fd['numel'] is not None else '-'} | "
                f"{_fmt_ulp(fd['max_ulp'])} | {fd['n_tensors']} |", "",
                f"Origin: at step {org['step']} the phases that differ are {' -> '.join(org['chain'])}; "
                f"the divergence originates in **{org['phase']}**.", ""]
        out += ["### Drift per step", ""]
        dr = _of(tables["drift"], name)
        out += [f"- {line.split(': ', 1)[1]}" for line in _drift_lines(dr)] + [""]
        out.append(_md_table(dr, ["step", "n_tensors", "n_names", "n_diff", "frac_diff", "max_ulp", "median_ulp",
                                  "growth", "phases"]))
        out += ["n_tensors: differing tensor comparisons (tensor x rank); n_names: distinct tensor names; "
                "n_diff: differing elements; frac_diff: n_diff over the elements of the differing tensors; "
                "ULP over differing elements (est. = from the ULP histogram: the median bucket's lower bound).", ""]
        out += ["### Per step and phase", ""]
        psp = _of(tables["per_step_phase"], name)
        out.append(_md_table(psp, ["step", "phase", "n_tensors", "n_compared", "frac_tensors", "n_diff", "frac_diff",
                                   "max_ulp", "median_ulp"], max_rows=200))
        out += ["### Per layer", ""]
        out.append(_md_table(_of(tables["per_layer"], name),
                             ["layer", "first_step", "first_phase", "first_tensor", "n_steps", "n_tensors", "n_diff",
                              "max_ulp", "median_ulp"]))
        out += ["### Per param (first 40 by first divergence)", ""]
        out.append(_md_table(_of(tables["per_param"], name),
                             ["param", "layer", "first_step", "first_phase", "first_tensor", "n_steps", "n_tensors",
                              "n_diff", "max_ulp", "median_ulp"], max_rows=40))
    out += ["## Plots", ""]
    plots = plots or {}
    if plots.get("skipped"):
        out.append(f"Plots skipped: {plots['skipped']}")
    else:
        for label, path in (plots.get("files") or {}).items():
            out.append(f"![{label}]({os.path.basename(path)})")
    out += ["", "## Files", ""] + [f"- `{os.path.basename(f)}`" for f in files]
    return "\n".join(out).rstrip() + "\n"


def _write_table(df: pd.DataFrame, out: Path, stem: str, written: list[str], parquet: bool) -> None:
    flat = df.drop(columns=[c for c in ("ulps",) if c in df.columns])
    flat.attrs = {}
    p = out / f"{stem}.csv"
    flat.to_csv(p, index=False)
    written.append(str(p))
    if parquet:
        q = out / f"{stem}.parquet"
        try:
            flat.to_parquet(q, index=False)
            written.append(str(q))
        except Exception as e:  # noqa: BLE001 - an optional format must not fail the triage
            written.append(f"{q.name} not written: {e}")


def write_triage(df: pd.DataFrame, out_dir: str | os.PathLike[str], *, meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Write the tables (CSV, Parquet where pyarrow is importable), the plots (where matplotlib
    is importable) and ``triage.md`` to ``out_dir``. Returns {"markdown": path, "files": [...],
    "plots": {...}, "tables": :func:`breakdowns` of ``df``}."""
    from parity.harness import plots as plots_mod

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot create triage output directory {out}: {e.strerror or e}") from None
    m = _meta(df, meta)
    try:
        import pyarrow  # noqa: F401
        parquet = True
    except ImportError:
        parquet = False
    written: list[str] = []
    tables = breakdowns(df, meta=m)
    for stem, t in {"divergences": df, **tables}.items():
        _write_table(t, out, stem, written, parquet)
    plot_info = plots_mod.write_plots(df, tables["per_step_phase"], out)
    written += list((plot_info.get("files") or {}).values())
    if not parquet:
        written.append("(no Parquet files: pyarrow is not importable)")
    md = render_markdown(df, meta=m, plots=plot_info, files=[w for w in written if not w.startswith("(")],
                         tables=tables)
    if not parquet:
        md = md.rstrip() + "\n\nParquet skipped: pyarrow is not importable (CSV written instead).\n"
    mpath = out / "triage.md"
    mpath.write_text(md)
    return {"markdown": str(mpath), "files": written, "plots": plot_info, "tables": tables}


def triage_command(args) -> int:
    """``parity triage RUN [--against RUN|golden] [--out DIR]``: 0 no divergence, 1 divergence
    (or failed checks, or a failed run), 2 bad input (raised as ParityError)."""
    run = _run_dir(args.run)
    against = getattr(args, "against", None)
    if against == "golden":
        df = compare_golden(run, getattr(args, "goldens", None),
                            allow_other_platform=getattr(args, "allow_other_platform", False))
    elif against:
        df = compare_runs(run, against)
    else:
        df = load_divergences(run)
    out = Path(args.out) if getattr(args, "out", None) else run / "triage"
    res = write_triage(df, out)
    m = df.attrs.get("parity") or {}
    scen = m.get("scenarios") or {}
    print(f"[triage] {diagnose(df)}")
    for line in _drift_lines(res["tables"]["drift"]):
        print(f"[triage] {line}")
    psp = res["tables"]["per_step_phase"]
    if not psp.empty:
        per_step = psp.groupby(["scenario", "step"])["n_tensors"].sum()
        for (scen_name, step), n in per_step.items():
            phases = psp[(psp["scenario"] == scen_name) & (psp["step"] == step) & (psp["n_tensors"] > 0)]
            detail = ", ".join(f"{r.phase} {r.n_tensors}" for r in phases.itertuples())
            print(f"[triage]   step {step}: {n} differing tensor comparison{'' if n == 1 else 's'}"
                  + (f" ({detail})" if detail else ""))
    plots = res["plots"]
    if plots.get("skipped"):
        print(f"[triage] plots skipped: {plots['skipped']}")
    print(f"[triage] report: {res['markdown']}")
    bad = (not df.empty) or any(s.get("n_failed_checks") or s.get("status") == "error" for s in scen.values())
    return 1 if bad else 0
