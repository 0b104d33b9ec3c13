"""Golden records: what a scenario's tested side produced on one platform, for later runs to match.

A golden lives in ``<root>/<scenario>/<platform_id>/`` (platform ids: :mod:`parity.harness.platform`)::

    manifest.json                      the record
    tensors_step_00000.safetensors     rank 0's tensors at each stored step (default: first, last)

The record holds the scenario's name and config (without name, step count and stored steps, so
a shorter run checks a prefix of the golden), the platform fingerprint, the step count, and per
rank: the loss bits of every step and, per tensor ``phase/name``, its dtype, shape and a 64-bit
digest (the first 16 hex digits of the sha256 of its bytes) for every step. Tensor files are
listed with size and sha256, so a damaged golden is an error, never a silent pass.

A run makes the same record: :func:`capture_phase` in every rank, :func:`record_from_results`
in the parent. :func:`compare` checks a run's record against a golden in one of two tiers:

* ``exact`` (a golden of this platform): every digest of every step both hold must match; the
  first differing (step, phase, tensor, rank) is named;
* ``approx`` (a golden of another platform): the loss of every step both hold must agree within
  :data:`APPROX_LOSS_RTOL`; bit differences are reported, not judged.

Both report the drift at the stored steps both hold (rank 0): per tensor, the differing
elements, max ULP and ULP histogram. :func:`find` picks the golden for a scenario and raises a
typed error (:class:`GoldenMissing`, :class:`GoldenStale`, :class:`GoldenFormatError`, or
:class:`GoldenError` for a damaged one). :func:`write` replaces a record atomically
(:mod:`parity.atomic`): an interrupted writer leaves the previous golden readable.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from parity import atomic
from parity.harness.compare import TensorDiff, bit_view, compare_tensors, ulp_distance
from parity.harness.errors import (
    GoldenError,
    GoldenExistsError,
    GoldenFormatError,
    GoldenMissing,
    GoldenStale,
    SnapshotError,
)
from parity.harness.platform import fingerprint_diff, platform_id
from parity.harness.snapshot import file_sha256, read_snapshot, tensor_sha256, to_cpu_contiguous, write_snapshot
from parity.vocab import STEP_PHASES, Phase

GOLDEN_FORMAT = "parity-golden"
GOLDEN_FORMAT_VERSION = 2
MANIFEST_NAME = "manifest.json"
DIGEST_HEX = 16
APPROX_LOSS_RTOL = 0.05
"""Approximate tier: the largest relative loss difference from another platform's golden."""
_EXCLUDED = ("name", "steps", "golden_tensor_steps")  # not part of a golden's identity
_PHASE_IDX = {p: i for i, p in enumerate(STEP_PHASES)}
_LOSS_RE = re.compile(r"^0x[0-9a-f]{8}$")
"""A loss entry of a rank record: its float32 bits as :func:`loss_hex` writes them ("-": no loss)."""
_DIGESTS_RE = re.compile(rf"^(?:[0-9a-f]{{{DIGEST_HEX}}}|-)(?: (?:[0-9a-f]{{{DIGEST_HEX}}}|-))*$")


# ---------------------------------------------------------------------------------------------
# Scenario identity and the rank side
# ---------------------------------------------------------------------------------------------


def base_name(name: str) -> str:
    """The scenario a name refers to: the CLI names an overridden scenario ``base[key=value+...]``."""
    return name.split("[", 1)[0]


def scenario_config(scenario) -> dict[str, Any]:
    """The scenario's settings that identify its golden: those not at their default, without the
    name, the step count and the stored steps (so a new field at its default changes nothing)."""
    defaults = _defaults(scenario)
    d = {**scenario.to_dict(), **scenario.schedule_pin()}  # a schedule's length, set or implied
    return {k: v for k, v in d.items() if k not in _EXCLUDED and v != defaults.get(k)}


def _defaults(scenario) -> dict[str, Any]:
    return {f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            for f in dataclasses.fields(scenario)}


def _n_steps(n: int) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def fingerprint(config: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(dict(config), sort_keys=True).encode()).hexdigest()[:16]


def tensor_steps(spec, steps: int) -> list[int]:
    """Resolve stored steps (Python indices: -1 is the last step) against a step count."""
    return sorted({s % steps for s in spec if -steps <= s < steps}) if steps > 0 else []


def capture_phase(out: dict, scenario, rank: int, step: int, phase: str, live: Mapping[str, torch.Tensor]) -> None:
    """Add one phase of the tested side to a rank's record ``out``: a digest per tensor, the loss
    bits, and on rank 0, at the scenario's stored steps, a CPU copy of every tensor."""
    keep = rank == 0 and step in tensor_steps(scenario.golden_tensor_steps, scenario.steps)
    digests = out.setdefault("digests", {}).setdefault(step, {})
    meta = out.setdefault("meta", {})
    kept = out.setdefault("tensors", {}).setdefault(step, {}) if keep else None
    for name, t in live.items():
        key = f"{phase}/{name}"
        digests[key] = tensor_sha256(t)[:DIGEST_HEX]
        meta[key] = (_dtype_name(t.dtype), tuple(t.shape))
        if kept is not None:
            kept[key] = to_cpu_contiguous(t)
    if phase == Phase.FORWARD:
        out.setdefault("loss", {})[step] = loss_hex(live["loss"])


def loss_hex(t: torch.Tensor) -> str:
    """The bits of a one-element float32 loss, ``0x3f800000`` style."""
    bits = int(bit_view(t.detach().reshape(-1)[:1].float()).item()) & 0xFFFFFFFF
    return f"0x{bits:08x}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


@dataclass
class RankRecord:
    """One rank's digests: ``keys[key] = (dtype, shape)``, ``digests[key][step]``, ``loss[step]``
    (None where the step did not produce it)."""

    keys: dict[str, tuple[str, tuple[int, ...]]]
    digests: dict[str, list[str | None]]
    loss: list[str | None]


@dataclass
class Record:
    """A golden, or a run's record in the same form (``path`` None until written)."""

    scenario: str
    config: dict[str, Any]
    platform: dict[str, str]
    steps: int
    ranks: dict[int, RankRecord]
    tensor_steps: list[int]
    info: dict[str, str] = field(default_factory=dict)
    path: Path | None = None
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory: dict[int, dict[str, torch.Tensor]] | None = field(default=None, repr=False)
    last_read: tuple[int, dict[str, torch.Tensor]] | None = field(default=None, repr=False, compare=False)
    """The stored step last read from ``path`` and checked against its digests, with its tensors:
    triage asks for a step once per differing tensor there, in step order, and a step file holds
    every tensor of the step. One step only, so a large model's record holds no more than one."""

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.config)

    @property
    def platform_id(self) -> str:
        return platform_id(self.platform)

    def tensors(self, step: int) -> dict[str, torch.Tensor]:
        """Rank 0's tensors at a stored step, checked against the recorded digests."""
        if self.memory is not None:
            return self.memory[step]
        if self.last_read is not None and self.last_read[0] == step:
            return self.last_read[1]
        if step not in self.tensor_steps or self.path is None:
            raise GoldenError(f"record {self.path} stores no tensors for step {step}")
        try:
            tensors, _ = read_snapshot(self.path / _tensor_file(step))
        except SnapshotError as e:
            raise GoldenError(f"golden {self.path} is damaged: {e}") from None
        rank0 = self.ranks[0]
        for k, t in tensors.items():
            if k not in rank0.keys or tensor_sha256(t)[:DIGEST_HEX] != rank0.digests[k][step]:
                raise GoldenError(f"golden {self.path}: stored tensor {k!r} of step {step} does not match its "
                                  "digest; the golden was modified after recording, regenerate it")
        self.last_read = (step, tensors)
        return tensors


def _tensor_file(step: int) -> str:
    return f"tensors_step_{step:05d}.safetensors"


def record_from_results(scenario, results: list[dict], platform: Mapping[str, str],
                        info: Mapping[str, str] | None = None) -> Record:
    """The record of a run from its ranks' results (each with ``result["golden"]``)."""
    steps = 1 + max((s for r in results for s in r["golden"].get("digests", {})), default=-1)
    ranks = {}
    for r in results:
        g = r["golden"]
        keys = {k: (d, tuple(s)) for k, (d, s) in g.get("meta", {}).items()}
        by_step = g.get("digests", {})
        ranks[r["rank"]] = RankRecord(
            keys=keys,
            digests={k: [by_step.get(s, {}).get(k) for s in range(steps)] for k in keys},
            loss=[g.get("loss", {}).get(s) for s in range(steps)],
        )
    memory = next((r["golden"].get("tensors") for r in results if r["rank"] == 0), None) or {}
    memory = {s: t for s, t in memory.items() if t}
    return Record(base_name(scenario.name), scenario_config(scenario), dict(platform), steps, ranks,
                  sorted(memory), dict(info or {}), memory=memory)


# ---------------------------------------------------------------------------------------------
# Manifest
# ---------------------------------------------------------------------------------------------


def manifest(rec: Record, files: Mapping[str, Any]) -> dict[str, Any]:
    """The manifest of a record as a JSON-ready dict (``files``: its tensor files)."""
    def joined(xs):
        return " ".join(x or "-" for x in xs)

    return {
        "format": GOLDEN_FORMAT, "format_version": GOLDEN_FORMAT_VERSION,
        "scenario": rec.scenario, "fingerprint": rec.fingerprint, "config": rec.config,
        "platform_id": rec.platform_id, "platform": rec.platform, "info": rec.info,
        "steps": rec.steps, "tensor_steps": rec.tensor_steps, "files": dict(files),
        "ranks": {str(r): {"loss": joined(rr.loss),
                           "tensors": {k: {"dtype": d, "shape": list(s), "digests": joined(rr.digests[k])}
                                       for k, (d, s) in rr.keys.items()}}
                  for r, rr in sorted(rec.ranks.items())},
    }


def manifest_changes(old: Mapping[str, Any], new: Mapping[str, Any], prefix: str = "") -> list[str]:
    """The fields where two manifests differ, as dotted paths (``info.note``, ``platform.python``),
    nested objects compared key by key: what changed in a golden whose records are bit-identical."""
    out = []
    for key in sorted(old.keys() | new.keys()):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            out += manifest_changes(a, b, f"{prefix}{key}.")
        elif a != b or (key in old) != (key in new):
            out.append(f"{prefix}{key}")
    return out


def _parse(path: Path, m: Any) -> Record:
    def need(cond, what):
        if not cond:
            raise GoldenError(f"golden manifest {path / MANIFEST_NAME} is malformed: {what}; regenerate the golden")

    def split(text, what):
        need(isinstance(text, str) and _DIGESTS_RE.match(text) or text == "", f"{what}: bad digest list")
        xs = [None if x == "-" else x for x in text.split(" ")] if text else []
        need(len(xs) == steps, f"{what}: {len(xs)} entries for {steps} steps")
        return xs

    need(isinstance(m, dict), "top level is not an object")
    need(m.get("format") == GOLDEN_FORMAT, f"'format' is not {GOLDEN_FORMAT!r}")
    version = m.get("format_version")
    need(isinstance(version, int), "'format_version' is not an int")
    if version != GOLDEN_FORMAT_VERSION:
        newer = version > GOLDEN_FORMAT_VERSION
        raise GoldenFormatError(
            f"golden {path} is in golden format {version}; this parity reads format {GOLDEN_FORMAT_VERSION}: "
            + ("upgrade parity" if newer else f"regenerate it on its platform (`parity golden regen {m.get('scenario')}`)"))
    steps = m.get("steps")
    need(isinstance(steps, int) and steps > 0, "'steps' is not a positive int")
    need(isinstance(m.get("scenario"), str) and isinstance(m.get("config"), dict), "'scenario' or 'config' missing")
    need(isinstance(m.get("platform"), dict) and all(isinstance(v, str) for v in m["platform"].values()),
         "'platform' must map str to str")
    need(m.get("fingerprint") == fingerprint(m["config"]), "'fingerprint' does not match 'config'")
    need(isinstance(m.get("tensor_steps"), list) and all(isinstance(s, int) and 0 <= s < steps
                                                          for s in m["tensor_steps"]), "bad 'tensor_steps'")
    files = m.get("files")
    need(isinstance(files, dict) and set(files) == {_tensor_file(s) for s in m["tensor_steps"]},
         "'files' does not list one tensor file per stored step (not listed)")
    for f in files.values():
        need(isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("sha256"), str),
             "file entries need bytes and sha256")
    need(isinstance(m.get("ranks"), dict) and m["ranks"], "'ranks' missing or empty")
    ranks = {}
    for r, rr in m["ranks"].items():
        need(r.isdigit() and isinstance(rr, dict) and isinstance(rr.get("tensors"), dict) and rr["tensors"],
             f"rank {r!r}: not a rank entry with tensors")
        keys, digests = {}, {}
        for k, e in rr["tensors"].items():
            need(isinstance(e, dict) and isinstance(e.get("dtype"), str) and isinstance(e.get("shape"), list)
                 and all(isinstance(x, int) and x >= 0 for x in e["shape"]), f"rank {r} {k!r}: needs dtype and shape")
            keys[k] = (e["dtype"], tuple(e["shape"]))
            digests[k] = split(e.get("digests"), f"rank {r} {k!r}")
        loss = [None if x == "-" else x for x in rr.get("loss", "").split(" ")] if rr.get("loss") else []
        need(len(loss) == steps, f"rank {r}: 'loss' has {len(loss)} entries for {steps} steps")
        need(all(x is None or _LOSS_RE.match(x) for x in loss),
             f"rank {r}: a 'loss' entry is not float32 bits ('0x' and 8 hex digits) or '-'")
        ranks[int(r)] = RankRecord(keys, digests, loss)
    return Record(m["scenario"], m["config"], dict(m["platform"]), steps, ranks, sorted(m["tensor_steps"]),
                  dict(m.get("info") or {}), path, dict(files))


def _manifest_json(gdir: Path) -> Any:
    """The JSON of a record directory's manifest, unvalidated."""
    try:
        text = (gdir / MANIFEST_NAME).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise GoldenError(f"golden {gdir} has no {MANIFEST_NAME}; it is incomplete, regenerate it") from None
    except (OSError, UnicodeDecodeError) as e:
        raise GoldenError(f"cannot read golden manifest {gdir / MANIFEST_NAME}: {e}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GoldenError(f"golden manifest {gdir / MANIFEST_NAME} is not valid JSON (line {e.lineno}: {e.msg}); "
                          "regenerate the golden") from None


def load(path: str | os.PathLike[str], *, verify_files: bool = True) -> Record:
    """Load and validate a record directory (a golden, or a run's record)."""
    gdir = Path(path)
    return _validated(gdir, _manifest_json(gdir), verify_files)


def _validated(gdir: Path, m: Any, verify_files: bool) -> Record:
    """The record of manifest JSON ``m`` read from ``gdir``, once it and its tensor files check out."""
    rec = _parse(gdir, m)
    _check_files(gdir, rec, verify_files)
    return rec


def _check_files(gdir: Path, rec: Record, verify_files: bool) -> None:
    """Raise GoldenError unless every tensor file of ``rec`` is there at its size (and, with
    ``verify_files``, has its digest)."""
    for name, f in rec.files.items():
        p = gdir / name
        if not p.is_file():
            raise GoldenError(f"golden {gdir} is incomplete: tensor file {name} is missing; regenerate it")
        if p.stat().st_size != f["bytes"]:
            raise GoldenError(f"golden {gdir}: tensor file {name} has {p.stat().st_size} bytes, the manifest "
                              f"says {f['bytes']} (truncated or replaced); regenerate it")
        if verify_files and file_sha256(p) != f["sha256"]:
            raise GoldenError(f"golden {gdir}: tensor file {name} does not match its digest (modified or "
                              "corrupt); regenerate it")


# ---------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------


def golden_dir(root: str | os.PathLike[str], rec: Record) -> Path:
    return Path(root) / rec.scenario / rec.platform_id


def write(rec: Record, dest: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write ``rec`` (with its in-memory tensors) to the directory ``dest``, atomically.

    Raises:
        GoldenExistsError: ``dest`` holds a record and ``overwrite`` is False.
        GoldenError: the filesystem refused (permissions, disk full).
    """
    target = Path(dest)
    files: dict[str, dict[str, Any]] = {}

    def fill(staging: Path) -> None:
        for step in rec.tensor_steps:
            p = staging / _tensor_file(step)
            write_snapshot(p, rec.tensors(step), {"parity.golden.scenario": rec.scenario, "parity.golden.step": str(step)})
            files[p.name] = {"bytes": p.stat().st_size, "sha256": file_sha256(p)}
        text = json.dumps(manifest(rec, files), indent=1, allow_nan=False) + "\n"
        atomic.replace_file(staging / MANIFEST_NAME, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))

    try:
        atomic.replace_dir(target, fill, overwrite=overwrite, marker=MANIFEST_NAME)
    except FileExistsError:
        raise GoldenExistsError(f"golden {target} already exists; regenerate it explicitly (parity golden regen)") from None
    except (OSError, SnapshotError) as e:
        raise GoldenError(f"cannot write golden {target}: {getattr(e, 'strerror', None) or e}") from None
    rec.path, rec.files = target, files
    return target


# ---------------------------------------------------------------------------------------------
# Finding a scenario's golden
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, order=True)
class GoldenRef:
    scenario: str
    platform_id: str
    path: Path


def list_goldens(root: str | os.PathLike[str]) -> list[GoldenRef]:
    """Every golden directory under ``root``, sorted (a golden caught mid-swap included)."""
    root = Path(root)
    out = []
    for sdir in sorted(root.iterdir()) if root.is_dir() else []:
        if not sdir.is_dir() or sdir.name.startswith("."):
            continue
        ids = {p.name for p in sdir.iterdir() if p.is_dir() and not p.name.startswith(".")}
        ids |= {n for p in sdir.iterdir() if (n := atomic.backup_name(p))}
        out += [GoldenRef(sdir.name, i, d) for i in sorted(ids) if (d := atomic.resolve(sdir / i, MANIFEST_NAME))]
    return out


def _exact(rec: Record, platform: Mapping[str, str]) -> Record:
    diff = fingerprint_diff(rec.platform, dict(platform))
    if diff:
        what = ", ".join(f"{k}: golden {a!r} vs here {b!r}" for k, (a, b) in diff.items())
        raise GoldenError(f"golden {rec.path} was recorded on another platform ({what}); record one here")
    return rec


def _same_configuration(root, fp: str, *, prefer: str, kind: str, skip: Path | None = None) -> list[GoldenRef]:
    """The goldens of configuration ``fp``, best first: on the platforms of device kind ``kind``
    first (then by platform), scenario ``prefer``'s first, then the one with the most steps (then
    by name). An overridden scenario (``parity run --recipe blockwise --ep 8``) often runs exactly
    what a shipped scenario runs; the golden identity leaves out the name and the step count, so
    that scenario's golden is this run's. Tensor files are not hashed here (the one chosen is, when
    it is loaded); a golden that cannot be read is passed over (its own scenario's run reports it).
    Only the manifests whose stored fingerprint is ``fp`` are validated: the others' digest lists
    were most of the search's time (0.11 of 0.14 s over 73 manifests). ``skip``: a golden already
    found to be of another configuration, or unreadable."""
    found = []
    for ref in list_goldens(root):
        rec = None if ref.path == skip else _of_configuration(ref.path, fp)
        if rec is not None:
            found.append(((not ref.platform_id.startswith(kind), ref.platform_id, ref.scenario != prefer,
                           -rec.steps, ref.scenario), ref))
    return [ref for _, ref in sorted(found, key=lambda f: f[0])]


def _of_configuration(path: Path, fp: str) -> Record | None:
    """The record at ``path`` (tensor files not hashed) if it is a readable golden of configuration
    ``fp``, else None."""
    try:
        stored = _manifest_json(path)
        if not isinstance(stored, dict) or stored.get("fingerprint") != fp:
            return None  # another configuration, or not a manifest at all
        return _validated(path, stored, verify_files=False)  # its config must give that fingerprint
    except GoldenError:
        return None


def find(root: str | os.PathLike[str], scenario, platform: Mapping[str, str], *,
         allow_other_platform: bool = False) -> tuple[Record, str]:
    """The golden for ``scenario`` on ``platform`` and the tier to check it in.

    ``exact`` for this platform's golden; ``approx`` for another platform's, taken only with
    ``allow_other_platform`` and only when this platform has none. An overridden scenario takes a
    golden of its configuration under any scenario's name, in either tier.

    Raises:
        GoldenMissing: none for this platform (or for this configuration of an overridden scenario,
            under any scenario's name).
        GoldenStale: the scenario's config changed since its golden was recorded.
        GoldenFormatError / GoldenError: written in another format, or damaged.
    """
    name, pid = base_name(scenario.name), platform_id(dict(platform))
    config = scenario_config(scenario)
    kind = platform.get("device_kind", "")
    if scenario.name != name:  # overridden on the command line
        # The scenario's own golden for this platform comes first among those of its configuration
        # (_same_configuration's order), so a prefix run (the suite's `[steps=8]`) need not search.
        # Otherwise the search passes it over without reading it again.
        own = atomic.resolve(Path(root) / name / pid, MANIFEST_NAME)
        rec = None if own is None else _of_configuration(own, fingerprint(config))
        if rec is not None:
            _check_files(own, rec, verify_files=True)  # as load() does for the golden it returns
            return _exact(rec, platform), "exact"
        same = _same_configuration(root, fingerprint(config), prefer=name, kind=kind, skip=own)
        mine = [r for r in same if r.platform_id == pid]
        if mine:
            return _exact(load(mine[0].path), platform), "exact"
        if allow_other_platform and same:
            return load(same[0].path), "approx"
        if same:
            others = tuple(sorted({r.platform_id for r in same}))
            raise GoldenMissing(f"no golden for {pid} of this configuration of {name!r}; goldens of it exist for: "
                                f"{', '.join(others)} (--allow-other-platform compares with one of them)",
                                platform_id=pid, others=others)
    have = [r for r in list_goldens(root) if r.scenario == name]
    mine = [r for r in have if r.platform_id == pid]
    if mine:
        rec, tier = _exact(load(mine[0].path), platform), "exact"
    elif allow_other_platform and have:
        ref = min(have, key=lambda r: (not r.platform_id.startswith(kind), r.platform_id))
        rec, tier = load(ref.path), "approx"
    else:
        others = tuple(r.platform_id for r in have)
        hint = (f" (goldens exist for: {', '.join(others)}; --allow-other-platform compares with one of them)"
                if others else "")
        raise GoldenMissing(f"no golden for {pid}: scenario {name!r} has none under {root}{hint}; record one with "
                            f"`parity golden regen {name}`", platform_id=pid, others=others)
    if fingerprint(config) != rec.fingerprint:
        keys = sorted(k for k in set(config) | set(rec.config) if config.get(k) != rec.config.get(k))
        default = _defaults(scenario)  # a setting at its default is left out of a config
        changed = ", ".join(f"{k}: {rec.config.get(k, default.get(k))!r} in the golden, "
                            f"{config.get(k, default.get(k))!r} here" for k in keys)
        if scenario.name != name:
            raise GoldenMissing(f"no golden for {pid} of this configuration of {name!r} ({changed})",
                                platform_id=pid)
        raise GoldenStale(f"golden {rec.path} is stale: scenario {name!r} changed since it was recorded ({changed}); "
                          f"regenerate it with `parity golden regen {name}`")
    return rec, tier


# ---------------------------------------------------------------------------------------------
# Comparing a run with its golden
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Difference:
    """One tensor of one step and rank whose record differs from the golden's.

    ``reason``: ``digest`` (same dtype and shape, other bits), ``dtype``, ``shape``, ``missing``
    (only in the golden) or ``extra`` (only in the run)."""

    step: int
    phase: str
    tensor: str
    rank: int
    reason: str

    def where(self) -> str:
        return f"step {self.step} / {self.phase} / {self.tensor} / rank {self.rank}"


@dataclass
class Comparison:
    """The result of :func:`compare`; ``status`` is ``pass`` or ``fail``."""

    tier: str
    golden: Record
    run: Record
    steps: int
    """Steps compared: the golden's first ``steps``."""
    differences: list[Difference]
    drift: list[tuple[int, str, TensorDiff]]
    """(step, phase/tensor, diff) of the differing tensors at the stored steps both hold (rank 0)."""
    drift_steps: list[int]
    n_compared: dict[tuple[int, str], int]
    """Tensor records compared per (step, phase), all ranks."""
    drift_compared: dict[tuple[int, str], int]
    """Rank 0 tensors compared element by element per (stored step, phase)."""
    loss: list[tuple[int, int, str, str]]
    """(step, rank, golden bits, run bits) of every differing loss."""
    notes: list[str]
    status: str

    def first(self) -> Difference | None:
        return self.differences[0] if self.differences else None

    def first_drift(self) -> TensorDiff | None:
        d = self.first()
        if d is None or d.rank != 0:
            return None
        return next((t for s, k, t in self.drift if s == d.step and k == f"{d.phase}/{d.tensor}"), None)

    def summary(self) -> str:
        g = f"{self.golden.scenario}/{self.golden.platform_id}"
        if self.tier == "approx":
            verdict = ("loss within" if self.status == "pass" else "loss NOT within") + f" {APPROX_LOSS_RTOL:g} relative"
            if not self.differences:  # another platform, and yet the same bits
                verdict = f"every tensor record bit-identical ({verdict})"
            head = f"approximate tier against {g}: {verdict} over {_n_steps(self.steps)}"
        elif self.status == "pass":
            head = f"bit-identical to {g} over {_n_steps(self.steps)}"
        else:
            head = f"differs from {g}"
        d = self.first()
        if d is not None:
            n_steps = len({x.step for x in self.differences})
            head += (f"; first difference at {d.where()} ({d.reason}"
                     + (f", {t.n_diff} of {t.numel} elements, max {t.max_ulp} ULP" if (t := self.first_drift()) else "")
                     + f"); {len(self.differences)} tensor records differ over {_n_steps(n_steps)}")
        return head

    def messages(self, limit: int = 20) -> list[str]:
        out = [self.summary()] + [f"note: {n}" for n in self.notes]
        for step, rank, g, r in self.loss[:3]:
            out.append(f"step {step} / forward / loss / rank {rank}: {_f32(r)!r} ({r}) vs golden {_f32(g)!r} ({g}), "
                       f"{int(ulp_distance(_t32(r), _t32(g))[0])} ULP")
        out += [f"{d.where()}: {d.reason}" for d in self.differences[:5]]
        out += drift_lines(self)
        return out[:limit]

    def to_dict(self) -> dict[str, Any]:
        d = self.first()
        return {"status": self.status, "tier": self.tier, "golden": str(self.golden.path), "steps": self.steps,
                "summary": self.summary(), "notes": self.notes, "n_differences": len(self.differences),
                "first": dataclasses.asdict(d) if d else None,
                "drift": [{"step": s, "tensor": k, "n_diff": t.n_diff, "numel": t.numel, "max_ulp": t.max_ulp,
                           "ulp_hist": t.ulp_hist, "reason": t.reason} for s, k, t in self.drift[:200]]}


def _t32(hexbits: str) -> torch.Tensor:
    return torch.tensor([int(hexbits, 16)], dtype=torch.int64).to(torch.int32).view(torch.float32)


def _f32(hexbits: str) -> float:
    return float(_t32(hexbits)[0])


def _in_capture_order(*records_keys):
    """Sort key for ``phase/tensor`` keys: phases in dataflow order, and within a phase the order
    the first of ``records_keys`` that holds the key recorded it in, which is the order the stack
    produced its tensors (the run's first divergence names the first of them too)."""
    pos = {}
    for keys in records_keys:
        for k in keys:
            pos.setdefault(k, len(pos))
    return lambda key: (_PHASE_IDX.get(key.split("/", 1)[0], 99), pos[key])


def compare(golden: Record, run: Record, tier: str = "exact") -> Comparison:
    """Compare a run's record with a golden over the steps both hold (see the module docstring)."""
    steps = min(golden.steps, run.steps)
    notes = []
    if run.steps < golden.steps:
        notes.append(f"checked the golden's first {run.steps} of {golden.steps} steps")
    elif run.steps > golden.steps:
        notes.append(f"steps {golden.steps}..{run.steps - 1} of this run are beyond the golden's {golden.steps}: "
                     "not checked")
    diffs, counts, losses = [], {}, []
    for rank in sorted(set(golden.ranks) - set(run.ranks)):
        notes.append(f"rank {rank} is in the golden, not in this run")
    both = sorted(set(golden.ranks) & set(run.ranks))
    keys = {rank: sorted(set(golden.ranks[rank].keys) | set(run.ranks[rank].keys),
                         key=_in_capture_order(run.ranks[rank].keys, golden.ranks[rank].keys)) for rank in both}
    for step in range(steps):
        for rank in both:
            g, r = golden.ranks[rank], run.ranks[rank]
            for key in keys[rank]:
                gd = g.digests[key][step] if key in g.keys else None
                rd = r.digests[key][step] if key in r.keys else None
                if gd is None and rd is None:
                    continue
                phase, name = key.split("/", 1)
                counts[(step, phase)] = counts.get((step, phase), 0) + 1
                reason = ("extra" if gd is None else "missing" if rd is None
                          else "dtype" if g.keys[key][0] != r.keys[key][0]
                          else "shape" if g.keys[key][1] != r.keys[key][1]
                          else "digest" if gd != rd else None)
                if reason:
                    diffs.append(Difference(step, phase, name, rank, reason))
            if g.loss[step] and r.loss[step] and g.loss[step] != r.loss[step]:
                losses.append((step, rank, g.loss[step], r.loss[step]))
    diffs.sort(key=lambda d: (d.step, _PHASE_IDX.get(d.phase, 99), d.rank))  # stable: capture order within
    drift, drift_steps = [], sorted(set(golden.tensor_steps) & set(run.tensor_steps) & set(range(steps)))
    drift_counts: dict[tuple[int, str], int] = {}
    in_order = _in_capture_order(run.ranks[0].keys, golden.ranks[0].keys) if drift_steps else None
    for step in drift_steps:
        gt, rt = golden.tensors(step), run.tensors(step)
        for key in sorted(set(gt) & set(rt), key=in_order):
            phase = key.split("/", 1)[0]
            drift_counts[(step, phase)] = drift_counts.get((step, phase), 0) + 1
            t = compare_tensors(gt[key], rt[key], f"step {step}/{key}/rank 0")
            if not t.equal:
                drift.append((step, key, t))
    if tier == "exact":
        ok = not diffs
    else:
        structural = [d for d in diffs if d.reason != "digest"]
        ok = not structural and all(_loss_close(g, r) for _, _, g, r in losses)
    return Comparison(tier, golden, run, steps, diffs, drift, drift_steps, counts, drift_counts, losses, notes,
                      "pass" if ok else "fail")


def _loss_close(g: str, r: str) -> bool:
    a, b = _f32(g), _f32(r)
    return abs(a - b) <= APPROX_LOSS_RTOL * abs(a)  # False for NaN


def drift_lines(c: Comparison, limit: int = 12) -> list[str]:
    """The drift at the stored steps as text: per step and phase, then the largest by max ULP."""
    if not c.drift and (c.tier == "exact" or not c.differences):
        return []
    if not c.drift_steps:
        return ["no element-wise drift: the golden stores no tensors of the steps compared (only digests)"]
    out = [f"drift vs the golden at stored steps {c.drift_steps} (rank 0):"]
    for step in c.drift_steps:
        for phase in STEP_PHASES:
            rows = [t for s, k, t in c.drift if s == step and k.split("/", 1)[0] == phase]
            n = c.drift_compared.get((step, phase), 0)
            if n:
                worst = max((t.max_ulp or 0 for t in rows), default=0)
                out.append(f"  step {step} {phase:<12} {len(rows):>4} of {n:<4} tensors differ"
                           + (f", max {worst} ULP" if rows else ""))
    top = sorted(c.drift, key=lambda x: -(x[2].max_ulp or 0))[:limit]
    out += [f"  step {s} {k}: {t.n_diff} of {t.numel} elements, max {t.max_ulp} ULP, hist "
            + ", ".join(f"{b}: {n}" for b, n in (t.ulp_hist or {}).items() if n) for s, k, t in top]
    return out


def describe(rec: Record) -> list[str]:
    """Lines for ``parity golden show``."""
    n = max((len(r.keys) for r in rec.ranks.values()), default=0)
    size = sum(f["bytes"] for f in rec.files.values())
    lines = [f"{rec.scenario}/{rec.platform_id} at {rec.path}",
             f"  {rec.steps} steps, ranks {sorted(rec.ranks)}, up to {n} tensors per step and rank; "
             f"tensors of rank 0 stored at steps {rec.tensor_steps} ({size / 1e6:.1f} MB)",
             "  config: " + (", ".join(f"{k}={v}" for k, v in rec.config.items()) or "(defaults)"),
             "  platform: " + ", ".join(f"{k}={v}" for k, v in rec.platform.items())]
    loss = rec.ranks[min(rec.ranks)].loss
    shown = [(s, x) for s, x in enumerate(loss) if x][:2] + [(s, x) for s, x in enumerate(loss) if x][-1:]
    lines.append("  loss (rank 0): " + ", ".join(f"step {s} {_f32(x):.6g} ({x})" for s, x in shown))
    return lines
