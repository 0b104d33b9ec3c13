"""Golden records: what a scenario produced on one platform, for later runs to match.

Layout::

    <root>/<scenario>/<platform_id>/
        manifest.json                        always
        step_00001_rank_000.safetensors      only when recorded with store_tensors=True
        ...

``manifest.json`` holds: the format version, the scenario name and the
caller's scenario fingerprint (a string that changes when the scenario config
does), the platform fingerprint (see :mod:`parity.harness.platform`), the steps
and ranks, and per step and rank: the loss as exact bits (hex) plus its repr,
and for every capture key the dtype, shape and sha256 of the raw bytes. When
tensors are stored, the manifest also lists every tensor file with its size
and sha256, so a modified, truncated or missing file is detected on load.

Writing is atomic (:meth:`GoldenRecorder.write`): everything is built in a
hidden staging directory beside the target and fsynced, then swapped in with
one ``renameat2(RENAME_EXCHANGE)`` where Linux offers it, or with two renames
otherwise. An interruption at any point (SIGINT, SIGKILL, power loss) leaves
the previous golden intact and readable: in the two-rename fallback, a reader
that finds the target gone reads the moved-aside copy, and the next writer
puts it back. Leftover staging directories of dead writers are removed by the
next write. An existing golden is replaced only with ``overwrite=True``.

Checking (:func:`check_against_golden`, :class:`GoldenChecker`) has two tiers:

* ``exact`` compares digests (and loss bits). With stored tensors, a digest
  mismatch is expanded into an element-level :class:`~parity.harness.compare.TensorDiff`
  (count, first index, ULP histogram).
* ``approx`` needs stored tensors and BOTH ``rtol`` and ``atol`` (as
  ``torch.testing.assert_close`` does: setting one alone is an error). Float
  tensors pass where ``|actual - golden| <= atol + rtol * |golden|`` (NaN never
  passes); integer and bool tensors (e.g. raw fp8 bytes) must still match exactly.

Every problem is reported, not just the first: missing and extra keys, steps
or ranks the golden lacks, and (:meth:`GoldenChecker.unused`) golden steps no
run checked. Problems with the golden itself (missing, malformed, corrupt,
other platform, stale scenario) raise :class:`~parity.harness.errors.GoldenError`
(exit code 2).

Regeneration follows pytest-regressions: :func:`regen_golden` writes the new
record and still reports ``"fail"`` unless ``accept=True`` (or nothing
changed), with a summary of what changed for review.
"""

from __future__ import annotations

import ctypes
import errno
import json
import math
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity.harness.compare import (
    ULP_BUCKETS,
    TensorDiff,
    _check_tensor,
    bit_view,
    compare_tensors,
)
from parity.harness.errors import (
    GoldenError,
    GoldenExistsError,
    SnapshotError,
    UsageError,
)
from parity.harness.platform import EXACT_MATCH_KEYS, fingerprint_diff
from parity.harness.platform import platform_id as make_platform_id
from parity.harness.snapshot import (
    file_sha256,
    fsync_dir,
    read_snapshot,
    snapshot_filename,
    tensor_sha256,
    to_cpu_contiguous,
    write_snapshot,
)

__all__ = [
    "GOLDEN_FORMAT",
    "GOLDEN_FORMAT_VERSION",
    "MANIFEST_NAME",
    "LOSS_KEY",
    "KeyRecord",
    "LossRecord",
    "GoldenRecorder",
    "Golden",
    "GoldenRef",
    "GoldenMismatch",
    "GoldenChecker",
    "GoldenInventory",
    "RegenResult",
    "load_golden",
    "check_against_golden",
    "list_goldens",
    "golden_inventory",
    "describe_golden",
    "diff_goldens",
    "regen_golden",
]

GOLDEN_FORMAT = "parity-golden"
GOLDEN_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
LOSS_KEY = "forward/loss"
TIERS = ("exact", "approx")

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


# --------------------------------------------------------------------------------------------
# Records
# --------------------------------------------------------------------------------------------


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True, slots=True)
class KeyRecord:
    """What the golden knows about one captured tensor."""

    dtype: str
    shape: tuple[int, ...]
    sha256: str

    @staticmethod
    def from_tensor(t: torch.Tensor) -> KeyRecord:
        """The record of a tensor (its bytes are hashed on the CPU)."""
        return KeyRecord(_dtype_name(t.dtype), tuple(t.shape), tensor_sha256(t))

    def to_json(self) -> dict[str, Any]:
        return {"dtype": self.dtype, "shape": list(self.shape), "sha256": self.sha256}


@dataclass(frozen=True, slots=True)
class LossRecord:
    """A loss value as exact bits: ``hex`` is the bit pattern in its own dtype."""

    dtype: str
    hex: str
    repr: str

    @property
    def value(self) -> float:
        return float(self.repr)

    @staticmethod
    def from_tensor(t: torch.Tensor) -> LossRecord | None:
        """A record for a one-element float tensor, else None."""
        if not isinstance(t, torch.Tensor) or t.numel() != 1 or not t.is_floating_point():
            return None
        bits = int(bit_view(t.detach().reshape(())).item()) & ((1 << (8 * t.element_size())) - 1)
        return LossRecord(
            dtype=_dtype_name(t.dtype),
            hex=f"0x{bits:0{2 * t.element_size()}x}",
            repr=repr(float(t.detach().to(torch.float64).item())),
        )

    def to_json(self) -> dict[str, str]:
        return {"dtype": self.dtype, "hex": self.hex, "repr": self.repr}


def _check_name(kind: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise UsageError(f"{kind} name {name!r} must match {_NAME_RE.pattern} (it becomes a directory name)")


# --------------------------------------------------------------------------------------------
# Recording and atomic writing
# --------------------------------------------------------------------------------------------


class GoldenRecorder:
    """Collects captures of a run and writes them as one golden record.

    Args:
        scenario: the scenario name (a directory name).
        scenario_fingerprint: a string that identifies the scenario config
            (e.g. a hash of it); a golden is stale when it changes.
        platform: the platform fingerprint (:func:`~parity.harness.platform.platform_fingerprint`).
        store_tensors: keep full tensors and write them as safetensors files
            (for small scenarios: the tensors are held in CPU memory until
            :meth:`write`). Without it only digests are recorded.
        loss_key: the capture key holding the loss.
        info: free-form ``{str: str}`` stored in the manifest (git SHA, CLI).
    """

    def __init__(
        self,
        scenario: str,
        scenario_fingerprint: str,
        platform: Mapping[str, str],
        *,
        store_tensors: bool = False,
        loss_key: str = LOSS_KEY,
        info: Mapping[str, str] | None = None,
    ) -> None:
        _check_name("scenario", scenario)
        if not isinstance(scenario_fingerprint, str) or not scenario_fingerprint:
            raise UsageError("scenario_fingerprint must be a non-empty string")
        missing = [k for k in EXACT_MATCH_KEYS if k not in platform]
        if missing:
            raise UsageError(f"platform fingerprint lacks {', '.join(missing)}; build it with platform_fingerprint()")
        self.scenario = scenario
        self.scenario_fingerprint = scenario_fingerprint
        self.platform = {str(k): str(v) for k, v in platform.items()}
        self.platform_id = make_platform_id(self.platform)
        self.store_tensors = store_tensors
        self.loss_key = loss_key
        self.info = {str(k): str(v) for k, v in (info or {}).items()}
        self._keys: dict[tuple[int, int], dict[str, KeyRecord]] = {}
        self._loss: dict[tuple[int, int], LossRecord | None] = {}
        self._tensors: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @property
    def steps(self) -> list[int]:
        return sorted({s for s, _ in self._keys})

    @property
    def ranks(self) -> list[int]:
        return sorted({r for _, r in self._keys})

    def add(self, step: int, rank: int, capture: Mapping[str, torch.Tensor]) -> None:
        """Record the capture of one step on one rank (digests are computed now)."""
        if not isinstance(step, int) or not isinstance(rank, int) or step < 0 or rank < 0:
            raise UsageError(f"golden add: step and rank must be non-negative ints, got {step!r}, {rank!r}")
        if (step, rank) in self._keys:
            raise UsageError(f"golden add: step {step} rank {rank} recorded twice")
        if not capture:
            raise UsageError(f"golden add: step {step} rank {rank}: empty capture, nothing to record")
        keys: dict[str, KeyRecord] = {}
        kept: dict[str, torch.Tensor] = {}
        for k, t in capture.items():
            if not isinstance(k, str) or not k:
                raise UsageError(f"golden add: capture keys must be non-empty strings, got {k!r}")
            _check_tensor(t, f"step {step}/{k}/rank {rank}", "capture")
            cpu = to_cpu_contiguous(t)
            keys[k] = KeyRecord(_dtype_name(cpu.dtype), tuple(cpu.shape), tensor_sha256(cpu))
            if self.store_tensors:
                kept[k] = cpu
        self._keys[(step, rank)] = keys
        self._loss[(step, rank)] = LossRecord.from_tensor(capture[self.loss_key]) if self.loss_key in capture else None
        if self.store_tensors:
            self._tensors[(step, rank)] = kept

    def add_digests(
        self, step: int, rank: int, records: Mapping[str, KeyRecord], *, loss: LossRecord | None = None
    ) -> None:
        """Record one step and rank from precomputed :class:`KeyRecord` s (e.g. sent by a rank).

        Build them with :meth:`KeyRecord.from_tensor` and :meth:`LossRecord.from_tensor`
        where the tensors live. Not possible with ``store_tensors``.
        """
        if self.store_tensors:
            raise UsageError("golden add_digests: this recorder stores tensors, use add() with the capture")
        if not isinstance(step, int) or not isinstance(rank, int) or step < 0 or rank < 0:
            raise UsageError(f"golden add: step and rank must be non-negative ints, got {step!r}, {rank!r}")
        if (step, rank) in self._keys:
            raise UsageError(f"golden add: step {step} rank {rank} recorded twice")
        if not records:
            raise UsageError(f"golden add: step {step} rank {rank}: no records, nothing to record")
        for k, rec in records.items():
            if not isinstance(rec, KeyRecord) or not re.fullmatch(r"[0-9a-f]{64}", rec.sha256):
                raise UsageError(f"golden add: {k!r} needs a KeyRecord with a full sha256 (KeyRecord.from_tensor)")
        self._keys[(step, rank)] = dict(records)
        self._loss[(step, rank)] = loss

    def to_golden(self) -> Golden:
        """The recorded data as an in-memory :class:`Golden` (not written anywhere)."""
        m = self.manifest()
        return Golden(
            path=Path("<memory>") / self.scenario / self.platform_id,
            manifest=m,
            scenario=self.scenario,
            scenario_fingerprint=self.scenario_fingerprint,
            platform_id=self.platform_id,
            platform=dict(self.platform),
            steps=self.steps,
            ranks=self.ranks,
            store_tensors=self.store_tensors,
            loss_key=self.loss_key,
            _keys={k: dict(v) for k, v in self._keys.items()},
            _loss=dict(self._loss),
            _memory=self._tensors if self.store_tensors else None,
        )

    def manifest(self, files: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The manifest as a JSON-ready dict (``files`` as written by :meth:`write`)."""
        records: dict[str, Any] = {}
        for step in self.steps:
            ranks = sorted(r for s, r in self._keys if s == step)
            first_loss = next((self._loss[(step, r)] for r in ranks if self._loss[(step, r)]), None)
            records[str(step)] = {
                "loss": first_loss.to_json() if first_loss else None,
                "ranks": {
                    str(r): {
                        "loss": self._loss[(step, r)].to_json() if self._loss[(step, r)] else None,
                        "file": snapshot_filename(step, r) if self.store_tensors else None,
                        "tensors": {k: rec.to_json() for k, rec in self._keys[(step, r)].items()},
                    }
                    for r in ranks
                },
            }
        return {
            "format": GOLDEN_FORMAT,
            "format_version": GOLDEN_FORMAT_VERSION,
            "scenario": self.scenario,
            "scenario_fingerprint": self.scenario_fingerprint,
            "platform_id": self.platform_id,
            "platform": dict(self.platform),
            "info": dict(self.info),
            "loss_key": self.loss_key,
            "store_tensors": self.store_tensors,
            "steps": self.steps,
            "ranks": self.ranks,
            "records": records,
            "files": {name: dict(v) for name, v in (files or {}).items()},
        }

    def _write_staging(self, staging: Path) -> None:
        files: dict[str, dict[str, Any]] = {}
        if self.store_tensors:
            for (step, rank), tensors in sorted(self._tensors.items()):
                name = snapshot_filename(step, rank)
                write_snapshot(
                    staging / name,
                    tensors,
                    {
                        "parity.golden.scenario": self.scenario,
                        "parity.golden.platform_id": self.platform_id,
                        "parity.golden.step": str(step),
                        "parity.golden.rank": str(rank),
                    },
                )
                files[name] = {"bytes": (staging / name).stat().st_size, "sha256": file_sha256(staging / name)}
        text = json.dumps(self.manifest(files), indent=1, allow_nan=False) + "\n"
        with open(staging / MANIFEST_NAME, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(staging)

    def write(self, root: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
        """Write the golden to ``<root>/<scenario>/<platform_id>/`` atomically.

        Args:
            root: the goldens root directory.
            overwrite: replace an existing golden (otherwise that is an error).

        Returns:
            The golden directory.

        Raises:
            GoldenExistsError: a golden exists and ``overwrite`` is False.
            UsageError: nothing was recorded.
            GoldenError: the filesystem refused (permissions, disk full).
        """
        if not self._keys:
            raise UsageError(f"golden {self.scenario}: nothing recorded, refusing to write an empty golden")
        parent = Path(root) / self.scenario
        target = parent / self.platform_id
        if not overwrite and _resolve_dir(parent, self.platform_id) is not None:
            raise GoldenExistsError(
                f"golden {target} already exists; regenerate it explicitly (overwrite=True / parity golden regen)"
            )
        try:
            parent.mkdir(parents=True, exist_ok=True)
            _cleanup_stale(parent, self.platform_id)
            staging = Path(tempfile.mkdtemp(prefix=f".{self.platform_id}.tmp-{os.getpid()}-", dir=parent))
            os.chmod(staging, 0o755)  # mkdtemp makes it private; goldens are shared files
        except OSError as e:
            raise GoldenError(f"cannot create golden under {parent}: {e.strerror or e}") from None
        try:
            self._write_staging(staging)
            _swap_into_place(staging, target)
        except BaseException as e:
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(e, OSError):
                raise GoldenError(f"cannot write golden {target}: {e.strerror or e}") from None
            if isinstance(e, SnapshotError):
                raise GoldenError(f"cannot write golden {target}: {e}") from None
            raise
        return target


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(staging: Path, target: Path) -> None:
    """Make ``staging`` the golden at ``target``; the old one stays readable throughout."""
    parent = target.parent
    if not target.exists():
        os.rename(staging, target)
        fsync_dir(parent)
        return
    if _rename_exchange(staging, target):
        fsync_dir(parent)
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old golden
        return
    # Fallback: move the old golden aside, then move the new one in. Between
    # the two renames readers find the old one under its backup name.
    backup = parent / f".{target.name}.old-{os.getpid()}-{os.urandom(4).hex()}"
    os.rename(target, backup)
    fsync_dir(parent)
    _between_renames()
    os.rename(staging, target)
    fsync_dir(parent)
    shutil.rmtree(backup, ignore_errors=True)


def _between_renames() -> None:
    """Test hook: the window of the two-rename fallback."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_LEFTOVER_RE = re.compile(r"^\.(?P<pid_id>.+)\.(?P<kind>tmp|old)-(?P<writer>\d+)-")


def _leftovers(parent: Path, pid_id: str) -> list[tuple[str, int, Path]]:
    out = []
    if not parent.is_dir():
        return out
    for p in parent.iterdir():
        m = _LEFTOVER_RE.match(p.name)
        if m and m.group("pid_id") == pid_id and p.is_dir():
            out.append((m.group("kind"), int(m.group("writer")), p))
    return out


def _cleanup_stale(parent: Path, pid_id: str) -> None:
    """Remove staging dirs of dead writers; restore a moved-aside golden if the swap was cut short."""
    target = parent / pid_id
    for kind, writer, path in sorted(_leftovers(parent, pid_id), key=lambda t: t[0]):
        if _pid_alive(writer) and writer != os.getpid():
            continue
        if kind == "old" and not target.exists() and (path / MANIFEST_NAME).is_file():
            os.rename(path, target)
            fsync_dir(parent)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _resolve_dir(parent: Path, pid_id: str) -> Path | None:
    """The directory holding the golden: the target, or a moved-aside copy mid-swap."""
    target = parent / pid_id
    if target.is_dir():
        return target
    backups = [p for kind, _, p in _leftovers(parent, pid_id) if kind == "old" and (p / MANIFEST_NAME).is_file()]
    if backups:
        return max(backups, key=lambda p: p.stat().st_mtime)
    return None


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


@dataclass
class Golden:
    """A loaded golden record (see :func:`load_golden`)."""

    path: Path
    manifest: dict[str, Any]
    scenario: str
    scenario_fingerprint: str
    platform_id: str
    platform: dict[str, str]
    steps: list[int]
    ranks: list[int]
    store_tensors: bool
    loss_key: str
    _keys: dict[tuple[int, int], dict[str, KeyRecord]] = field(repr=False, default_factory=dict)
    _loss: dict[tuple[int, int], LossRecord | None] = field(repr=False, default_factory=dict)
    _files: dict[tuple[int, int], str] = field(repr=False, default_factory=dict)
    _memory: dict[tuple[int, int], dict[str, torch.Tensor]] | None = field(repr=False, default=None)

    def has(self, step: int, rank: int) -> bool:
        return (step, rank) in self._keys

    def entries(self) -> list[tuple[int, int]]:
        """All recorded (step, rank) pairs, sorted."""
        return sorted(self._keys)

    def ranks_of(self, step: int) -> list[int]:
        return sorted(r for s, r in self._keys if s == step)

    def record(self, step: int, rank: int) -> dict[str, KeyRecord]:
        """``{key: KeyRecord}`` for one step and rank."""
        try:
            return self._keys[(step, rank)]
        except KeyError:
            raise UsageError(f"golden {self.path} has no step {step} rank {rank}") from None

    def loss(self, step: int, rank: int | None = None) -> LossRecord | None:
        """The loss of ``step`` on ``rank`` (default: the lowest rank that has one)."""
        if rank is not None:
            return self._loss.get((step, rank))
        return next((self._loss[(step, r)] for r in self.ranks_of(step) if self._loss.get((step, r))), None)

    def load_tensors(self, step: int, rank: int, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The stored tensors of one step and rank, verified against the manifest digests.

        Raises:
            GoldenError: no tensors stored, or the file is unreadable or does
                not match the manifest (the golden was modified after recording).
        """
        if not self.store_tensors:
            raise GoldenError(f"golden {self.path} stores digests only; re-record it with store_tensors to get tensors")
        record = self.record(step, rank)
        if self._memory is not None:
            tensors = dict(self._memory[(step, rank)])
            return tensors if str(device) == "cpu" else {k: v.to(device) for k, v in tensors.items()}
        path = self.path / self._files[(step, rank)]
        try:
            tensors, _ = read_snapshot(path)
        except SnapshotError as e:
            raise GoldenError(f"golden {self.path} is damaged: {e}") from None
        if set(tensors) != set(record):
            raise GoldenError(
                f"golden {path}: tensor names differ from the manifest; the golden was modified after recording"
            )
        for k, t in tensors.items():
            rec = record[k]
            if _dtype_name(t.dtype) != rec.dtype or tuple(t.shape) != rec.shape or tensor_sha256(t) != rec.sha256:
                raise GoldenError(
                    f"golden {path}: tensor {k!r} does not match its manifest digest; "
                    "the golden was modified after recording, regenerate it"
                )
        if str(device) != "cpu":
            tensors = {k: v.to(device) for k, v in tensors.items()}
        return tensors


def _malformed(path: Path, what: str) -> GoldenError:
    return GoldenError(f"golden manifest {path} is malformed: {what}; regenerate the golden")


def _parse_manifest(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GoldenError(f"golden {path.parent} has no {MANIFEST_NAME}; it is incomplete, regenerate it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GoldenError(f"cannot read golden manifest {path}: {e}") from None
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise GoldenError(
            f"golden manifest {path} is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); "
            "regenerate the golden"
        ) from None
    if not isinstance(m, dict):
        raise _malformed(path, "top level is not an object")
    return m


def _need(cond: bool, path: Path, what: str) -> None:
    if not cond:
        raise _malformed(path, what)


def _is_str_map(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) and isinstance(x, str) for k, x in v.items())


def _parse_loss(v: Any, path: Path, where: str) -> LossRecord | None:
    if v is None:
        return None
    _need(
        isinstance(v, dict) and all(isinstance(v.get(k), str) for k in ("dtype", "hex", "repr")),
        path,
        f"{where}: loss must have string dtype/hex/repr",
    )
    return LossRecord(v["dtype"], v["hex"], v["repr"])


def _build_golden(gdir: Path, m: dict[str, Any]) -> Golden:
    mpath = gdir / MANIFEST_NAME
    _need(m.get("format") == GOLDEN_FORMAT, mpath, f"'format' is not {GOLDEN_FORMAT!r}")
    version = m.get("format_version")
    _need(isinstance(version, int), mpath, "'format_version' is not an int")
    if version > GOLDEN_FORMAT_VERSION:
        raise GoldenError(
            f"golden {gdir} has format version {version}, newer than this parity supports "
            f"({GOLDEN_FORMAT_VERSION}); upgrade parity"
        )
    for k in ("scenario", "scenario_fingerprint", "platform_id", "loss_key"):
        _need(isinstance(m.get(k), str) and m[k], mpath, f"'{k}' is missing or not a string")
    _need(_is_str_map(m.get("platform")), mpath, "'platform' must map str to str")
    _need(isinstance(m.get("store_tensors"), bool), mpath, "'store_tensors' is not a bool")
    _need(isinstance(m.get("records"), dict) and m["records"], mpath, "'records' is missing or empty")
    files = m.get("files", {})
    _need(isinstance(files, dict), mpath, "'files' is not an object")

    keys: dict[tuple[int, int], dict[str, KeyRecord]] = {}
    losses: dict[tuple[int, int], LossRecord | None] = {}
    step_files: dict[tuple[int, int], str] = {}
    for s_key, srec in m["records"].items():
        _need(s_key.isdigit() and isinstance(srec, dict), mpath, f"record {s_key!r} is not a step entry")
        ranks = srec.get("ranks")
        _need(isinstance(ranks, dict) and ranks, mpath, f"step {s_key}: 'ranks' missing or empty")
        for r_key, rrec in ranks.items():
            where = f"step {s_key} rank {r_key}"
            _need(r_key.isdigit() and isinstance(rrec, dict), mpath, f"{where}: not a rank entry")
            tensors = rrec.get("tensors")
            _need(isinstance(tensors, dict) and tensors, mpath, f"{where}: 'tensors' missing or empty")
            recs: dict[str, KeyRecord] = {}
            for k, tr in tensors.items():
                ok = (
                    isinstance(tr, dict)
                    and isinstance(tr.get("dtype"), str)
                    and isinstance(tr.get("shape"), list)
                    and all(isinstance(x, int) and x >= 0 for x in tr["shape"])
                    and isinstance(tr.get("sha256"), str)
                    and re.fullmatch(r"[0-9a-f]{64}", tr["sha256"]) is not None
                )
                _need(ok, mpath, f"{where}: entry for {k!r} needs dtype, shape and a sha256 hex digest")
                recs[k] = KeyRecord(tr["dtype"], tuple(tr["shape"]), tr["sha256"])
            sr = (int(s_key), int(r_key))
            keys[sr] = recs
            losses[sr] = _parse_loss(rrec.get("loss"), mpath, where)
            if m["store_tensors"]:
                fname = rrec.get("file")
                _need(isinstance(fname, str) and fname in files, mpath, f"{where}: 'file' not listed in 'files'")
                step_files[sr] = fname
    for fname, frec in files.items():
        _need(
            isinstance(fname, str)
            and "/" not in fname
            and not fname.startswith(".")
            and isinstance(frec, dict)
            and isinstance(frec.get("sha256"), str)
            and isinstance(frec.get("bytes"), int),
            mpath,
            f"file entry {fname!r} needs bytes and sha256",
        )
    return Golden(
        path=gdir,
        manifest=m,
        scenario=m["scenario"],
        scenario_fingerprint=m["scenario_fingerprint"],
        platform_id=m["platform_id"],
        platform=dict(m["platform"]),
        steps=sorted({s for s, _ in keys}),
        ranks=sorted({r for _, r in keys}),
        store_tensors=m["store_tensors"],
        loss_key=m["loss_key"],
        _keys=keys,
        _loss=losses,
        _files=step_files,
    )


def _verify_files(g: Golden, *, digests: bool) -> None:
    for fname, frec in g.manifest.get("files", {}).items():
        p = g.path / fname
        if not p.is_file():
            raise GoldenError(f"golden {g.path} is incomplete: tensor file {fname} is missing; regenerate it")
        size = p.stat().st_size
        if size != frec["bytes"]:
            raise GoldenError(
                f"golden {g.path}: tensor file {fname} has {size} bytes, manifest says {frec['bytes']} "
                "(truncated or replaced); regenerate it"
            )
        if digests and file_sha256(p) != frec["sha256"]:
            raise GoldenError(
                f"golden {g.path}: tensor file {fname} does not match its manifest digest "
                "(modified or corrupt); regenerate it"
            )


def load_golden(
    root: str | os.PathLike[str],
    scenario: str,
    platform_id: str,
    *,
    platform: Mapping[str, str] | None = None,
    scenario_fingerprint: str | None = None,
    allow_other_platform: bool = False,
    verify_files: bool = True,
) -> Golden:
    """Load and validate ``<root>/<scenario>/<platform_id>/``.

    Args:
        root: the goldens root directory.
        scenario: the scenario name.
        platform_id: which platform's golden to load.
        platform: the current platform fingerprint. When given, the golden
            must have been recorded on a matching platform
            (:func:`~parity.harness.platform.fingerprint_diff` empty) unless
            ``allow_other_platform``.
        scenario_fingerprint: when given, must equal the recorded one (else
            the golden is stale).
        allow_other_platform: accept a golden from another platform (useful
            with the approx tier).
        verify_files: check every tensor file's sha256 now (sizes are always checked).

    Raises:
        GoldenError: missing, malformed, incomplete, tampered, stale, or from
            another platform (exit code 2).
    """
    _check_name("scenario", scenario)
    _check_name("platform id", platform_id)
    parent = Path(root) / scenario
    gdir = _resolve_dir(parent, platform_id)
    if gdir is None:
        others = sorted({r.platform_id for r in list_goldens(root) if r.scenario == scenario})
        hint = f" (goldens exist for: {', '.join(others)})" if others else ""
        raise GoldenError(
            f"no golden for scenario {scenario!r} on platform {platform_id} under {root}{hint}; "
            "record one with `parity golden regen`"
        )
    m = _parse_manifest(gdir / MANIFEST_NAME)
    g = _build_golden(gdir, m)
    if g.scenario != scenario or g.platform_id != platform_id:
        raise _malformed(
            gdir / MANIFEST_NAME,
            f"it names scenario {g.scenario!r} / platform {g.platform_id!r} but lives in {scenario}/{platform_id}",
        )
    if platform is not None and not allow_other_platform:
        diff = fingerprint_diff(g.platform, dict(platform))
        if diff or make_platform_id(dict(platform)) != platform_id:
            what = ", ".join(f"{k}: golden {a!r} vs here {b!r}" for k, a, b in ((k, *v) for k, v in diff.items()))
            raise GoldenError(
                f"golden {gdir} was recorded on another platform ({what or 'platform id ' + platform_id}); "
                "exact goldens only apply on the same platform: record one here, or allow other platforms"
            )
    if scenario_fingerprint is not None and scenario_fingerprint != g.scenario_fingerprint:
        raise GoldenError(
            f"golden {gdir} is stale: scenario fingerprint {g.scenario_fingerprint!r} != current "
            f"{scenario_fingerprint!r} (the scenario config changed); regenerate it"
        )
    _verify_files(g, digests=verify_files)
    return g


# --------------------------------------------------------------------------------------------
# Checking
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GoldenMismatch:
    """One way a run disagrees with its golden.

    ``kind`` is one of: ``step_not_in_golden``, ``rank_not_in_golden``,
    ``missing_key`` (the golden has it, the capture does not), ``extra_key``
    (the reverse), ``dtype``, ``shape``, ``digest`` (exact tier, no stored
    tensors), ``values`` (element-level, with ``diff`` in the exact tier),
    ``loss``, ``unused`` (a golden step/rank no run checked).
    """

    kind: str
    path: str
    message: str
    diff: TensorDiff | None = None

    def __str__(self) -> str:
        return self.message


def _path(step: int, key: str | None, rank: int) -> str:
    return f"step {step}/{key}/rank {rank}" if key else f"step {step}/rank {rank}"


def _validate_tier(tier: str, rtol: float | None, atol: float | None) -> None:
    if tier not in TIERS:
        raise UsageError(f"unknown tier {tier!r}; use one of {', '.join(TIERS)}")
    if tier == "exact":
        if rtol is not None or atol is not None:
            raise UsageError("the exact tier takes no tolerances; use tier='approx' with both rtol and atol")
        return
    if (rtol is None) != (atol is None):
        given, other = ("rtol", "atol") if rtol is not None else ("atol", "rtol")
        raise UsageError(
            f"tier 'approx' got {given} but not {other}: set both (an unset one could silently loosen the check)"
        )
    if rtol is None or atol is None:
        raise UsageError("tier 'approx' needs both rtol and atol")
    for name, v in (("rtol", rtol), ("atol", atol)):
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise UsageError(f"{name} must be a finite number >= 0, got {v!r}")


def _approx_compare(expected: torch.Tensor, actual: torch.Tensor, path: str, rtol: float, atol: float) -> str | None:
    """None if close, else a one-line message (floats by tolerance, others bit-exact)."""
    if not expected.is_floating_point():
        d = compare_tensors(expected, actual, path)
        return None if d.equal else d.message()
    e = expected.to(actual.device, torch.float64)
    a = actual.detach().to(torch.float64)
    close = torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=False)
    if bool(close.all()):
        return None
    bad = ~close
    n_bad = int(bad.sum().item())
    absdiff = torch.where(bad, (a - e).abs().nan_to_num(nan=math.inf), torch.zeros_like(a))
    flat = int(torch.argmax(absdiff.reshape(-1)).item())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), tuple(a.shape))) if a.dim() else ()
    first = int(torch.argmax(bad.reshape(-1).to(torch.uint8)).item())
    fidx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(a.shape))) if a.dim() else ()
    n = a.numel()
    return (
        f"{path}: {n_bad} of {n} elements outside rtol={rtol:g}, atol={atol:g} "
        f"({100.0 * n_bad / n:.3g}%), greatest abs diff {float(absdiff.reshape(-1)[flat]):.6g} at {idx}, "
        f"first at {fidx}: {float(a.reshape(-1)[first])!r} vs golden {float(e.reshape(-1)[first])!r}"
    )


class GoldenChecker:
    """Checks the captures of a run against one golden and tracks which golden entries were used.

    Args:
        golden: the loaded golden.
        tier: ``"exact"`` or ``"approx"``.
        rtol: relative tolerance (approx only; needs ``atol`` too).
        atol: absolute tolerance (approx only; needs ``rtol`` too).
    """

    def __init__(
        self, golden: Golden, *, tier: str = "exact", rtol: float | None = None, atol: float | None = None
    ) -> None:
        _validate_tier(tier, rtol, atol)
        if tier == "approx" and not golden.store_tensors:
            raise GoldenError(
                f"golden {golden.path} stores digests only, the approx tier needs stored tensors; "
                "re-record it with store_tensors"
            )
        self.golden = golden
        self.tier = tier
        self.rtol = rtol
        self.atol = atol
        self.checked: set[tuple[int, int]] = set()
        self.mismatches: list[GoldenMismatch] = []

    def check(self, step: int, rank: int, capture: Mapping[str, torch.Tensor]) -> list[GoldenMismatch]:
        """Compare one capture with the golden; returns (and accumulates) the mismatches."""
        loss = LossRecord.from_tensor(capture[self.golden.loss_key]) if self.golden.loss_key in capture else None
        out = self._check(step, rank, capture, loss)
        self.mismatches.extend(out)
        return out

    def check_digests(
        self, step: int, rank: int, records: Mapping[str, KeyRecord], *, loss: LossRecord | None = None
    ) -> list[GoldenMismatch]:
        """Like :meth:`check`, from precomputed records (exact tier only; no element-level detail)."""
        if self.tier != "exact":
            raise UsageError("the approx tier needs the tensors themselves, not digests")
        out = self._check(step, rank, records, loss)
        self.mismatches.extend(out)
        return out

    def _check(
        self,
        step: int,
        rank: int,
        actual: Mapping[str, torch.Tensor | KeyRecord],
        act_loss: LossRecord | None,
    ) -> list[GoldenMismatch]:
        g = self.golden
        if step not in g.steps:
            span = f"{g.steps[0]}..{g.steps[-1]}" if g.steps else "none"
            return [
                GoldenMismatch(
                    "step_not_in_golden",
                    _path(step, None, rank),
                    f"{_path(step, None, rank)}: the golden has no step {step} (golden steps {span}); "
                    "the run is longer than the recording, regenerate the golden",
                )
            ]
        if not g.has(step, rank):
            return [
                GoldenMismatch(
                    "rank_not_in_golden",
                    _path(step, None, rank),
                    f"{_path(step, None, rank)}: the golden has no rank {rank} (golden ranks {g.ranks_of(step)}); "
                    "the world size differs from the recording",
                )
            ]
        self.checked.add((step, rank))
        record = g.record(step, rank)
        out: list[GoldenMismatch] = []

        exp_loss = g.loss(step, rank)
        loss_handled = exp_loss is not None and act_loss is not None
        if loss_handled:
            assert exp_loss is not None and act_loss is not None
            m = self._check_loss(step, rank, exp_loss, act_loss)
            if m:
                out.append(m)

        expected_tensors: dict[str, torch.Tensor] | None = None
        for k in _union(record, actual):
            p = _path(step, k, rank)
            if k not in actual:
                out.append(GoldenMismatch("missing_key", p, f"{p}: in the golden, missing from this run"))
                continue
            if k not in record:
                out.append(GoldenMismatch("extra_key", p, f"{p}: produced by this run, not in the golden"))
                continue
            if k == g.loss_key and loss_handled:
                continue
            rec, v = record[k], actual[k]
            if isinstance(v, KeyRecord):
                act = v
            else:
                _check_tensor(v, p, "capture")
                act = KeyRecord(_dtype_name(v.dtype), tuple(v.shape), "")
            if act.dtype != rec.dtype:
                out.append(GoldenMismatch("dtype", p, f"{p}: dtype differs: golden {rec.dtype} vs {act.dtype}"))
                continue
            if act.shape != rec.shape:
                out.append(GoldenMismatch("shape", p, f"{p}: shape differs: golden {rec.shape} vs {act.shape}"))
                continue
            if self.tier == "exact":
                digest = act.sha256 or tensor_sha256(v)  # type: ignore[arg-type]
                if digest == rec.sha256:
                    continue
                if not g.store_tensors or isinstance(v, KeyRecord):
                    why = "the golden stores no tensors" if not g.store_tensors else "only digests were given"
                    out.append(
                        GoldenMismatch(
                            "digest",
                            p,
                            f"{p}: sha256 differs from the golden ({digest[:12]}.. vs golden {rec.sha256[:12]}..); "
                            f"{why}, so no element-level detail",
                        )
                    )
                    continue
                if expected_tensors is None:
                    expected_tensors = g.load_tensors(step, rank)
                d = compare_tensors(expected_tensors[k], v, p)
                if d.equal:  # cannot happen with a verified golden; be loud if it does
                    raise GoldenError(f"golden {g.path}: stored tensor for {p} disagrees with its manifest digest")
                out.append(GoldenMismatch("values", p, d.message(), d))
            else:
                assert isinstance(v, torch.Tensor) and self.rtol is not None and self.atol is not None
                if expected_tensors is None:
                    expected_tensors = g.load_tensors(step, rank)
                msg = _approx_compare(expected_tensors[k], v, p, self.rtol, self.atol)
                if msg:
                    out.append(GoldenMismatch("values", p, msg))
        return out

    def _check_loss(self, step: int, rank: int, exp: LossRecord, act: LossRecord) -> GoldenMismatch | None:
        p = _path(step, self.golden.loss_key, rank)
        if self.tier == "exact":
            if exp.dtype == act.dtype and exp.hex == act.hex:
                return None
            return GoldenMismatch(
                "loss",
                p,
                f"{p}: loss {act.repr} ({act.hex}, {act.dtype}) vs golden {exp.repr} ({exp.hex}, {exp.dtype})",
            )
        assert self.rtol is not None and self.atol is not None
        a, e = act.value, exp.value
        if exp.dtype == act.dtype and abs(a - e) <= self.atol + self.rtol * abs(e):
            return None
        return GoldenMismatch(
            "loss",
            p,
            f"{p}: loss {act.repr} vs golden {exp.repr}: |diff| {abs(a - e):.6g} > "
            f"atol {self.atol:g} + rtol {self.rtol:g} * |golden|"
            if exp.dtype == act.dtype
            else f"{p}: loss dtype {act.dtype} vs golden {exp.dtype}",
        )

    def unused(self, *, steps: Iterable[int] | None = None) -> list[GoldenMismatch]:
        """Golden (step, rank) entries that no :meth:`check` call covered.

        Args:
            steps: limit the report to these steps (for partial runs, so that
                steps the run was not asked to produce are not reported).
        """
        wanted = set(steps) if steps is not None else None
        out = []
        for s, r in self.golden.entries():
            if (s, r) in self.checked or (wanted is not None and s not in wanted):
                continue
            p = _path(s, None, r)
            out.append(GoldenMismatch("unused", p, f"{p}: in the golden but not produced by this run"))
        return out


def _union(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    keys = dict.fromkeys(a)
    for k in b:
        keys.setdefault(k, None)
    return list(keys)


def check_against_golden(
    golden: Golden,
    step: int,
    rank: int,
    capture: Mapping[str, torch.Tensor],
    *,
    tier: str = "exact",
    rtol: float | None = None,
    atol: float | None = None,
) -> list[GoldenMismatch]:
    """Compare one capture with the golden (see :class:`GoldenChecker`); empty list = pass."""
    return GoldenChecker(golden, tier=tier, rtol=rtol, atol=atol).check(step, rank, capture)


# --------------------------------------------------------------------------------------------
# Inventory, show, regen
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class GoldenRef:
    """Where one golden lives."""

    scenario: str
    platform_id: str
    path: Path


def list_goldens(root: str | os.PathLike[str]) -> list[GoldenRef]:
    """Every golden directory under ``root`` (sorted; hidden staging dirs skipped)."""
    root = Path(root)
    out: list[GoldenRef] = []
    if not root.is_dir():
        return out
    for sdir in sorted(root.iterdir()):
        if not sdir.is_dir() or sdir.name.startswith(".") or not _NAME_RE.match(sdir.name):
            continue
        ids = {p.name for p in sdir.iterdir() if p.is_dir() and not p.name.startswith(".")}
        for p in sdir.iterdir():  # a golden caught mid-swap lives under its backup name
            m = _LEFTOVER_RE.match(p.name)
            if m and m.group("kind") == "old":
                ids.add(m.group("pid_id"))
        for pid_id in sorted(ids):
            gdir = _resolve_dir(sdir, pid_id)
            if gdir is not None:
                out.append(GoldenRef(sdir.name, pid_id, gdir))
    return out


@dataclass
class GoldenInventory:
    """Goldens missing for the selected scenarios and goldens no known scenario uses."""

    platform_id: str
    missing: list[str]
    """Selected scenarios without a golden for this platform."""
    other_platforms: dict[str, list[str]]
    """For each missing scenario, the platforms that do have one."""
    unused: list[GoldenRef]
    """Goldens (any platform) whose scenario is not among the known scenarios."""

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unused

    def messages(self) -> list[str]:
        out = []
        for s in self.missing:
            others = self.other_platforms.get(s)
            hint = f" (exists for {', '.join(others)})" if others else ""
            out.append(f"{s}: no golden for platform {self.platform_id}{hint}")
        out.extend(f"{r.scenario}/{r.platform_id}: unused golden (no such scenario) at {r.path}" for r in self.unused)
        return out


def golden_inventory(
    root: str | os.PathLike[str],
    platform_id: str,
    *,
    known_scenarios: Iterable[str],
    selected: Iterable[str] | None = None,
) -> GoldenInventory:
    """Report missing and unused goldens across scenarios.

    Args:
        root: the goldens root.
        platform_id: the current platform.
        known_scenarios: every scenario that exists (the full list, even when
            only some are run: "unused" is judged against it, so a partial run
            does not flag the goldens of scenarios it skipped).
        selected: the scenarios this run needs goldens for (default: all known).
    """
    known = list(known_scenarios)
    sel = list(selected) if selected is not None else known
    refs = list_goldens(root)
    have: dict[str, set[str]] = {}
    for r in refs:
        have.setdefault(r.scenario, set()).add(r.platform_id)
    missing = [s for s in sel if platform_id not in have.get(s, set())]
    return GoldenInventory(
        platform_id=platform_id,
        missing=missing,
        other_platforms={s: sorted(have[s]) for s in missing if have.get(s)},
        unused=[r for r in refs if r.scenario not in set(known)],
    )


def describe_golden(g: Golden) -> list[str]:
    """Human-readable lines for ``parity golden show``."""
    n_keys = len(g.record(*g.entries()[0])) if g.entries() else 0
    lines = [
        f"golden {g.scenario}/{g.platform_id} at {g.path}",
        f"  format version {g.manifest.get('format_version')}, scenario fingerprint {g.scenario_fingerprint}",
        "  platform: " + ", ".join(f"{k}={v}" for k, v in g.platform.items()),
        f"  steps {g.steps[0]}..{g.steps[-1]} ({len(g.steps)}), ranks {g.ranks}, {n_keys} tensors per step and rank, "
        + ("tensors stored" if g.store_tensors else "digests only"),
    ]
    info = g.manifest.get("info") or {}
    if info:
        lines.append("  info: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    losses = [(s, g.loss(s)) for s in g.steps]
    shown = [(s, l) for s, l in losses if l is not None]
    if shown:
        if len(shown) > 6:
            shown = shown[:3] + shown[-3:]
        lines.append("  loss: " + ", ".join(f"step {s} {l.repr} ({l.hex})" for s, l in shown))
    return lines


def diff_goldens(old: Golden, new: Golden) -> list[str]:
    """A review summary of what changed between two goldens of one scenario.

    Compares digests per (step, rank, key); when both store tensors, also
    aggregates the ULP histogram of the changed tensors.
    """
    lines: list[str] = []
    if old.scenario_fingerprint != new.scenario_fingerprint:
        lines.append(f"scenario fingerprint {old.scenario_fingerprint} -> {new.scenario_fingerprint}")
    pd = fingerprint_diff(old.platform, new.platform)
    if pd:
        lines.append("platform: " + ", ".join(f"{k} {a} -> {b}" for k, (a, b) in pd.items()))
    changed = added = removed = same = 0
    changed_steps: list[int] = []
    hist = dict.fromkeys(ULP_BUCKETS, 0)
    have_hist = False
    for sr in sorted(set(old.entries()) | set(new.entries())):
        o = old._keys.get(sr, {})
        n = new._keys.get(sr, {})
        step_changed = False
        ot = nt = None
        for k in _union(o, n):
            if k not in n:
                removed += 1
                step_changed = True
            elif k not in o:
                added += 1
                step_changed = True
            elif o[k] != n[k]:
                changed += 1
                step_changed = True
                if old.store_tensors and new.store_tensors and o[k].dtype == n[k].dtype and o[k].shape == n[k].shape:
                    if ot is None:
                        ot, nt = old.load_tensors(*sr), new.load_tensors(*sr)
                    assert nt is not None
                    d = compare_tensors(ot[k], nt[k], _path(sr[0], k, sr[1]))
                    if d.ulp_hist:
                        have_hist = True
                        for b, c in d.ulp_hist.items():
                            hist[b] += c
            else:
                same += 1
        if step_changed and sr[0] not in changed_steps:
            changed_steps.append(sr[0])
    total_steps = len(set(old.steps) | set(new.steps))
    if not changed_steps:
        lines.append(f"no tensor changed ({same} digests identical)")
    else:
        lines.append(
            f"{len(changed_steps)} of {total_steps} steps changed (first: step {changed_steps[0]}); "
            f"tensors changed {changed}, added {added}, removed {removed}, unchanged {same}"
        )
    if have_hist:
        lines.append("ULP histogram over changed tensors: " + ", ".join(f"{k}: {v}" for k, v in hist.items()))
    for s in sorted(set(old.steps) & set(new.steps)):
        lo, ln = old.loss(s), new.loss(s)
        if lo and ln and lo.hex != ln.hex:
            rel = abs(ln.value - lo.value) / abs(lo.value) if lo.value else math.inf
            lines.append(f"loss step {s}: {lo.repr} -> {ln.repr} (rel {rel:.3g})")
            break  # the first changed loss; the rest follow from it
    last = max(set(old.steps) & set(new.steps), default=None)
    if last is not None:
        lo, ln = old.loss(last), new.loss(last)
        if lo and ln and lo.hex != ln.hex:
            lines.append(f"loss at last step {last}: {lo.repr} -> {ln.repr}")
    return lines


@dataclass
class RegenResult:
    """Outcome of :func:`regen_golden`. ``status`` is ``"pass"`` or ``"fail"``."""

    path: Path
    status: str
    created: bool
    changed: bool
    summary: list[str]

    @property
    def exit_code(self) -> int:
        return 0 if self.status == "pass" else 1

    def message(self) -> str:
        if not self.changed:
            return f"{self.path}: golden unchanged"
        verb = "created" if self.created else "regenerated"
        tail = "" if self.status == "pass" else "; review it, then re-run with --accept (or check again) to pass"
        return f"{self.path}: golden {verb}{tail}"


def regen_golden(recorder: GoldenRecorder, root: str | os.PathLike[str], *, accept: bool = False) -> RegenResult:
    """Write the recorder's golden over the current one, reporting "fail" unless accepted.

    Following pytest-regressions: a regeneration that changes (or creates) a
    golden still fails, so it is never silent; ``accept=True`` makes it pass.
    If the new record is identical to the existing golden (same manifest),
    nothing is written and the result passes.
    """
    parent = Path(root) / recorder.scenario
    old: Golden | None = None
    if _resolve_dir(parent, recorder.platform_id) is not None:
        try:
            old = load_golden(root, recorder.scenario, recorder.platform_id)
        except GoldenError:
            old = None  # a damaged golden is simply replaced
    new = recorder.to_golden()
    if old is not None:
        new_manifest = recorder.manifest(old.manifest.get("files") if recorder.store_tensors else None)
        if new_manifest == old.manifest:
            return RegenResult(old.path, "pass", created=False, changed=False, summary=["no change"])
    # Summarise before writing: the old golden's files are gone afterwards.
    summary = diff_goldens(old, new) if old is not None else describe_golden(new)
    path = recorder.write(root, overwrite=True)
    return RegenResult(path, "pass" if accept else "fail", created=old is None, changed=True, summary=summary)
