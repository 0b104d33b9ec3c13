"""``parity diff A B``: compare two snapshot files, or two directories of them, tensor by tensor.

Two files: every tensor name of either file gets one line, ``equal`` or how it differs
(differing elements, max ULP, ULP histogram, first differing element), via
:func:`parity.harness.compare.compare_tensors` (bit for bit). Two directories: their
``*.safetensors`` files are paired by name (e.g. ``snapshots/<scenario>/`` of two runs, or of
two platforms) and each pair is compared the same way; a file present on one side only is a
difference.

Exit status: 0 all equal, 1 something differs (bits, dtype, shape, a tensor or file on one side
only), 2 bad input (missing path, not a safetensors file, truncated file, a file against a
directory, a directory without snapshots), raised as :class:`~parity.harness.errors.ParityError`.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from parity.harness.compare import TensorDiff, compare_tensors
from parity.harness.errors import SnapshotError, UsageError
from parity.harness.snapshot import SNAPSHOT_SUFFIX, read_snapshot
from parity.vocab import STEP_PHASES

__all__ = ["DiffResult", "diff_files", "diff_dirs", "diff_paths", "diff_command"]

_PHASE_IDX = {p: i for i, p in enumerate(("init",) + tuple(STEP_PHASES))}


@dataclass
class DiffResult:
    """What :func:`diff_paths` found."""

    diffs: list[TensorDiff] = field(default_factory=list)
    """One per tensor present on both sides, in file then phase order."""
    only_a: list[str] = field(default_factory=list)
    """Tensors (``file:name`` in directory mode) or files present only in A."""
    only_b: list[str] = field(default_factory=list)
    files: int = 0
    """File pairs compared."""

    @property
    def n_differ(self) -> int:
        return sum(not d.equal for d in self.diffs)

    @property
    def ok(self) -> bool:
        return not self.n_differ and not self.only_a and not self.only_b

    def summary(self) -> str:
        parts = [f"{len(self.diffs)} tensors compared" + (f" in {self.files} file pairs" if self.files > 1 else ""),
                 f"{len(self.diffs) - self.n_differ} equal", f"{self.n_differ} differ"]
        if self.only_a:
            parts.append(f"{len(self.only_a)} only in A")
        if self.only_b:
            parts.append(f"{len(self.only_b)} only in B")
        return ("EQUAL: " if self.ok else "DIFFER: ") + ", ".join(parts)


def _sort_key(name: str) -> tuple:
    """Side (A/, B/ or none), then phase in dataflow order, then the name."""
    side, rest = ("", name)
    if len(name) > 2 and name[1] == "/" and name[0] in "AB":
        side, rest = name[0], name[2:]
    phase = rest.split("/", 1)[0]
    return (side, _PHASE_IDX.get(phase, len(_PHASE_IDX)), rest)


def _check_file(p: Path, label: str) -> None:
    if not p.exists():
        raise SnapshotError(f"{label} {p} not found")
    if not p.is_file():
        raise SnapshotError(f"{label} {p} is not a regular file")


def diff_files(a: str | os.PathLike[str], b: str | os.PathLike[str], *, prefix: str = "",
               out: TextIO | None = None, result: DiffResult | None = None) -> DiffResult:
    """Compare two snapshot files tensor by tensor (A is the reference), one line each to ``out``.

    Raises:
        SnapshotError: a file is missing, not safetensors, or truncated (exit code 2).
    """
    a, b = Path(a), Path(b)
    _check_file(a, "A:")
    _check_file(b, "B:")
    res = result if result is not None else DiffResult()
    ta, _ = read_snapshot(a, copy=False)  # only looked at: views of the mapped files
    tb, _ = read_snapshot(b, copy=False)
    res.files += 1
    for k in sorted(set(ta) | set(tb), key=_sort_key):
        path = f"{prefix}{k}"
        if k not in tb:
            res.only_a.append(path)
            line = f"{path}: only in A ({ta[k].dtype}, shape {tuple(ta[k].shape)})"
        elif k not in ta:
            res.only_b.append(path)
            line = f"{path}: only in B ({tb[k].dtype}, shape {tuple(tb[k].shape)})"
        else:
            d = compare_tensors(ta[k], tb[k], path)
            res.diffs.append(d)
            line = d.message()
        if out is not None:
            print(line, file=out)
    return res


def _snapshot_files(d: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(d.iterdir()) if p.is_file() and p.name.endswith(SNAPSHOT_SUFFIX)}


def diff_dirs(a: str | os.PathLike[str], b: str | os.PathLike[str], *, out: TextIO | None = None) -> DiffResult:
    """Pair the ``*.safetensors`` files of two directories by name and diff each pair.

    Raises:
        UsageError: neither directory holds a snapshot file (exit code 2).
        SnapshotError: a file is unreadable (exit code 2).
    """
    a, b = Path(a), Path(b)
    fa, fb = _snapshot_files(a), _snapshot_files(b)
    if not fa and not fb:
        raise UsageError(f"neither {a} nor {b} holds a {SNAPSHOT_SUFFIX} file: give two snapshot files or "
                         "two directories of them (e.g. OUT/snapshots/<scenario>)")
    for side, files, d in (("A", fa, a), ("B", fb, b)):
        if not files:
            raise UsageError(f"{side}: {d} holds no {SNAPSHOT_SUFFIX} file")
    res = DiffResult()
    for name in sorted(set(fa) | set(fb)):
        if name not in fb:
            res.only_a.append(name)
            if out is not None:
                print(f"{name}: file only in A", file=out)
            continue
        if name not in fa:
            res.only_b.append(name)
            if out is not None:
                print(f"{name}: file only in B", file=out)
            continue
        diff_files(fa[name], fb[name], prefix=f"{name}:", out=out, result=res)
    return res


def diff_paths(a: str | os.PathLike[str], b: str | os.PathLike[str], *, out: TextIO | None = None) -> DiffResult:
    """Two files or two directories (see the module docstring)."""
    pa, pb = Path(a), Path(b)
    for label, p in (("A:", pa), ("B:", pb)):
        if not p.exists():
            raise SnapshotError(f"{label} {p} not found")
    if pa.is_dir() and pb.is_dir():
        return diff_dirs(pa, pb, out=out)
    if pa.is_dir() != pb.is_dir():
        raise UsageError(f"cannot compare a {'directory' if pa.is_dir() else 'file'} ({pa}) with a "
                         f"{'directory' if pb.is_dir() else 'file'} ({pb}): give two files or two directories")
    return diff_files(pa, pb, out=out)


def diff_command(a: str, b: str) -> int:
    """``parity diff A B``: one line per tensor, then a summary; 0 equal, 1 differ, 2 bad input."""
    res = diff_paths(a, b, out=sys.stdout)
    print(res.summary())
    return 0 if res.ok else 1
