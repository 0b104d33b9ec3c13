"""PNG plots for ``parity triage`` (optional: needs matplotlib, the ``plots`` extra).

* ``drift.png``: per step, by phase, the number of differing tensor comparisons and the max
  ULP, both on a log scale (the drift's growth reads as a slope);
* ``heatmap.png``: tensor (``phase/name``) x step, colour = max ULP over ranks (log scale).

Without matplotlib :func:`write_plots` writes nothing and says why; the triage's markdown
repeats it. Nothing here is imported by the rest of parity at module level.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pandas as pd

__all__ = ["plots_available", "write_plots", "plot_drift", "plot_heatmap", "MAX_HEATMAP_ROWS"]

MAX_HEATMAP_ROWS = 60
"""Tensors shown in the heatmap (the earliest to diverge first)."""

_PHASE_ORDER = ("init", "forward", "grad_local", "grad_reduce", "optimizer", "param_sync")


def plots_available() -> tuple[bool, str]:
    """(True, "") when matplotlib can be imported, else (False, why)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        return False, (f"matplotlib is not importable ({e}); install the optional extra "
                       "`pip install 'parity[plots]'` (or `pip install matplotlib`) to get PNG plots")
    return True, ""


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)  # files only, no display needed
    import matplotlib.pyplot as plt

    return plt


def _ulp_float(v: Any) -> float:
    if v is None or v is pd.NA:
        return math.nan
    try:
        f = float(v)
    except (TypeError, ValueError):
        return math.nan
    return f


def plot_drift(psp: pd.DataFrame, path: str | os.PathLike[str]) -> str:
    """Differing tensor comparisons and max ULP per step, one line per phase, log y axes.

    Args:
        psp: :func:`parity.harness.triage.per_step_phase` output (one scenario or several).
        path: the PNG to write.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    positive = [False, False]  # a log axis needs one positive value (digest-only rows have no ULP)
    try:
        scenarios = list(dict.fromkeys(psp["scenario"]))
        for scen in scenarios:
            sub = psp[psp["scenario"] == scen]
            for phase in [p for p in _PHASE_ORDER if p in set(sub["phase"])]:
                g = sub[sub["phase"] == phase].sort_values("step")
                label = phase if len(scenarios) == 1 else f"{scen}: {phase}"
                # zeros cannot sit on a log axis: they are left as gaps
                n = [float(x) if x else math.nan for x in g["n_tensors"]]
                u = [(_ulp_float(x) if _ulp_float(x) > 0 else math.nan) for x in g["max_ulp"]]
                axes[0].plot(g["step"], n, marker="o", label=label)
                axes[1].plot(g["step"], u, marker="o", label=label)
                positive[0] |= any(x > 0 for x in n)
                positive[1] |= any(x > 0 for x in u)
        for ax, pos in zip(axes, positive):
            if pos:
                ax.set_yscale("log")
            else:
                ax.text(0.5, 0.5, "no values (digests only)", transform=ax.transAxes, ha="center")
        axes[0].set_ylabel("differing tensors (tensor x rank)")
        axes[1].set_ylabel("max ULP")
        axes[1].set_xlabel("step")
        from matplotlib.ticker import MaxNLocator

        axes[1].xaxis.set_major_locator(MaxNLocator(integer=True))
        axes[0].set_title("drift per step by phase")
        for ax in axes:
            ax.grid(True, which="both", alpha=0.3)
        if len(psp):
            axes[0].legend(fontsize="small")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return str(path)


def plot_heatmap(df: pd.DataFrame, path: str | os.PathLike[str], max_rows: int = MAX_HEATMAP_ROWS) -> str:
    """Tensor (``phase/name``) x step heatmap of max ULP (over ranks), log colour scale.

    Args:
        df: the divergence table (:func:`parity.harness.triage.load_divergences` or the like).
        path: the PNG to write.
        max_rows: tensors shown, the earliest to diverge first.
    """
    import numpy as np
    from matplotlib.colors import LogNorm

    plt = _pyplot()
    d = df.copy()
    d["label"] = d["phase"] + "/" + d["tensor"]
    if d["scenario"].nunique() > 1:
        d["label"] = d["scenario"] + ": " + d["label"]
    # a tensor without a ULP notion (digest-only rows) shows as 1
    d["u"] = [max(_ulp_float(u), 1.0) if not math.isnan(_ulp_float(u)) else 1.0 for u in d["max_ulp"]]
    order = (d.sort_values(["step", "phase_idx", "tensor"]).drop_duplicates("label")["label"].tolist())[:max_rows]
    steps = list(range(int(d["step"].min()), int(d["step"].max()) + 1)) if len(d) else []
    grid = np.full((len(order), len(steps)), np.nan)
    pivot = d[d["label"].isin(order)].groupby(["label", "step"])["u"].max()
    row_of = {lab: i for i, lab in enumerate(order)}
    for (lab, step), u in pivot.items():
        grid[row_of[lab], steps.index(int(step))] = u
    h = max(3.0, 0.22 * len(order) + 1.5)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.5 * len(steps) + 4.5), h))
    try:
        if len(order):
            vmax = max(float(np.nanmax(grid)), 2.0)
            im = ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest",
                           norm=LogNorm(vmin=1.0, vmax=vmax), cmap="viridis")
            fig.colorbar(im, ax=ax, label="max ULP (log)")
            ax.set_yticks(range(len(order)))
            ax.set_yticklabels(order, fontsize=6)
            ax.set_xticks(range(len(steps)))
            ax.set_xticklabels([str(s) for s in steps], fontsize=7)
        ax.set_xlabel("step")
        shown = f" (first {len(order)} tensors)" if d["label"].nunique() > len(order) else ""
        ax.set_title("max ULP per tensor and step" + shown)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    finally:
        plt.close(fig)
    return str(path)


def write_plots(df: pd.DataFrame, psp: pd.DataFrame, out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Write ``drift.png`` and ``heatmap.png`` into ``out_dir`` where matplotlib is importable.

    Returns ``{"files": {label: path}}``, or ``{"skipped": why, "files": {}}``.
    """
    ok, why = plots_available()
    if not ok:
        return {"skipped": why, "files": {}}
    if df.empty:
        return {"skipped": "no divergence, nothing to plot", "files": {}}
    out = Path(out_dir)
    files = {"drift per step by phase": plot_drift(psp, out / "drift.png"),
             "max ULP per tensor and step": plot_heatmap(df, out / "heatmap.png")}
    return {"files": files}
