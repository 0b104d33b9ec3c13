"""Per-step tensor snapshots as safetensors files, written atomically.

One snapshot holds one capture (one step of one rank): ``{"phase/name":
tensor}`` plus ``str -> str`` metadata. The file format is plain safetensors,
so any safetensors reader can open it.

What :func:`write_snapshot` takes care of, because safetensors refuses or
mishandles it otherwise:

* Captured tensors are often views into bigger buffers (DDP flat grad
  buffers, fp8 storage): non-contiguous, sharing storage, on a GPU. Each one
  is copied into its own contiguous CPU tensor first.
* float8 tensors are stored with their own safetensors dtype (``F8_E4M3``,
  ``F8_E5M2``, ``F8_E8M0``, ...). Raw fp8 bytes captured as ``uint8`` stay
  ``uint8``: nothing is reinterpreted. If the installed safetensors lacks a
  dtype, the tensor is stored as a same-width integer view and the original
  dtype is recorded under the reserved metadata key
  ``parity.snapshot.dtypes``; :func:`read_snapshot` undoes it.
* safetensors stores a file's tensors sorted by name. The order they were handed over in (a
  run's: the order the stack produced them) is recorded under ``parity.snapshot.order``, and
  :func:`read_snapshot` returns them in it.
* The file appears atomically: it is written to a temporary file in the same
  directory, fsynced, then renamed over the target, and the directory is
  fsynced. A reader sees the old file or the new one, never half a file.

:func:`read_snapshot` reads through :func:`safetensors.safe_open` and turns
every failure (missing, truncated, corrupt file) into a
:class:`~parity.harness.errors.SnapshotError` (exit code 2) with a one-line
message. The tensors it returns are private copies, not views of the
memory-mapped file, so replacing the file later cannot change them.

Byte order: safetensors files are little-endian; parity assumes a
little-endian host (x86-64, aarch64), which is checked at import.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import json
import os
import re
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from parity import atomic
from parity.harness.errors import SnapshotError, UsageError

__all__ = [
    "SNAPSHOT_SUFFIX",
    "snapshot_filename",
    "parse_snapshot_filename",
    "write_snapshot",
    "read_snapshot",
    "read_snapshot_metadata",
    "to_cpu_contiguous",
    "tensor_sha256",
    "file_sha256",
]

if sys.byteorder != "little":  # pragma: no cover - no such hosts in use
    raise ImportError("parity snapshots assume a little-endian host")

SNAPSHOT_SUFFIX = ".safetensors"
_NAME_RE = re.compile(r"^step_(\d{5,})_rank_(\d{3,})\.safetensors$")

# Reserved metadata keys (prefix); user metadata may not use it.
_RESERVED_PREFIX = "parity.snapshot."
_DTYPES_KEY = _RESERVED_PREFIX + "dtypes"
_ORDER_KEY = _RESERVED_PREFIX + "order"
"""The tensors' names in the order they were handed to the writer (safetensors stores them sorted
by name): a run hands them over in the order the stack produced them."""

_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def snapshot_filename(step: int, rank: int) -> str:
    """The file name of a snapshot: ``step_{step:05d}_rank_{rank:03d}.safetensors``."""
    if not isinstance(step, int) or not isinstance(rank, int) or step < 0 or rank < 0:
        raise UsageError(f"snapshot_filename needs non-negative int step and rank, got {step!r}, {rank!r}")
    return f"step_{step:05d}_rank_{rank:03d}{SNAPSHOT_SUFFIX}"


def parse_snapshot_filename(name: str) -> tuple[int, int] | None:
    """Inverse of :func:`snapshot_filename`: ``(step, rank)``, or None if it is not one."""
    m = _NAME_RE.match(os.path.basename(name))
    return (int(m.group(1)), int(m.group(2))) if m else None


# --------------------------------------------------------------------------------------------
# Helpers shared with golden.py
# --------------------------------------------------------------------------------------------


def to_cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """A fresh contiguous CPU copy of ``t`` (own storage, no autograd history)."""
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device="cpu")
    out.copy_(t.detach())
    return out


def _raw_bytes(t: torch.Tensor) -> tuple[torch.Tensor, memoryview]:
    """(keep-alive tensor, zero-copy view of its raw bytes) for a CPU copy of ``t``."""
    t = t.detach()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = to_cpu_contiguous(t)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t, memoryview(b"")
    buf = (ctypes.c_ubyte * nbytes).from_address(t.data_ptr())
    return t, memoryview(buf).cast("B")


def tensor_sha256(t: torch.Tensor) -> str:
    """Hex sha256 of the tensor's raw bytes in C order (dtype and shape not included)."""
    keep, mv = _raw_bytes(t)
    h = hashlib.sha256(mv)
    del keep
    return h.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _safetensors_supports(dtype: torch.dtype) -> bool:
    """Whether the installed safetensors can store ``dtype`` natively."""
    try:
        safetensors.torch.save({"x": torch.zeros(16, dtype=torch.uint8).view(dtype)[:1]})
    except Exception:  # noqa: BLE001 - any refusal means "not supported"
        return False
    return True


def _dtype_from_name(name: str) -> torch.dtype | None:
    dt = getattr(torch, name.removeprefix("torch."), None)
    return dt if isinstance(dt, torch.dtype) else None


# --------------------------------------------------------------------------------------------
# Write
# --------------------------------------------------------------------------------------------


def _validate(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None, path: Path) -> None:
    if not isinstance(tensors, Mapping):
        raise UsageError(f"write_snapshot {path}: tensors must be a dict, got {type(tensors).__name__}")
    if not tensors:
        raise UsageError(f"write_snapshot {path}: refusing to write a snapshot with no tensors")
    for k, v in tensors.items():
        if not isinstance(k, str) or not k:
            raise UsageError(f"write_snapshot {path}: tensor names must be non-empty strings, got {k!r}")
        if k == "__metadata__":
            raise UsageError(f"write_snapshot {path}: '__metadata__' is reserved by safetensors")
        if not isinstance(v, torch.Tensor):
            raise UsageError(f"write_snapshot {path}: {k} is a {type(v).__name__}, not a torch.Tensor")
        if type(v) not in (torch.Tensor, torch.nn.Parameter):
            raise UsageError(
                f"write_snapshot {path}: {k} is a tensor subclass ({type(v).__name__}); "
                "store its raw data and scale tensors instead"
            )
        if v.layout != torch.strided or v.is_quantized:
            raise UsageError(f"write_snapshot {path}: {k} is not a dense tensor ({v.layout})")
    if metadata is None:
        return
    if not isinstance(metadata, Mapping):
        raise UsageError(f"write_snapshot {path}: metadata must be a dict of str to str")
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise UsageError(
                f"write_snapshot {path}: metadata must map str to str, got {k!r}: {type(v).__name__} "
                "(encode other values with json.dumps)"
            )
        if k.startswith(_RESERVED_PREFIX):
            raise UsageError(f"write_snapshot {path}: metadata key {k!r} uses the reserved prefix {_RESERVED_PREFIX!r}")


def write_snapshot(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Write ``tensors`` and ``metadata`` to ``path`` as a safetensors file, atomically.

    Args:
        path: the target file; its directory is created if needed. An
            existing file is replaced (atomically).
        tensors: ``{name: tensor}``; any device, any strides, may share
            storage. Each that is not a contiguous CPU tensor owning its whole storage is
            copied to one.
        metadata: ``{str: str}`` stored in the file header.

    Returns:
        The path written.

    Raises:
        UsageError: bad names, non-tensor values, non-str metadata.
        SnapshotError: the file could not be written (disk full, permissions).
    """
    path = Path(path)
    _validate(tensors, metadata, path)
    md = dict(metadata or {})
    cpu: dict[str, torch.Tensor] = {}
    encoded: dict[str, str] = {}
    storages: set[int] = set()
    for k, v in tensors.items():
        c = v.detach()
        # safetensors needs contiguous CPU tensors that share no memory: copy only those that
        # are not (a snapshot step can be gigabytes; a needless copy doubles the host memory)
        ptr = c.untyped_storage().data_ptr() if c.device.type == "cpu" else None
        owns = (ptr is not None and c.is_contiguous() and c.storage_offset() == 0
                and c.untyped_storage().nbytes() == c.numel() * c.element_size() and ptr not in storages)
        if owns:
            storages.add(ptr)
        else:
            c = to_cpu_contiguous(c)
        if not _safetensors_supports(c.dtype):
            int_dtype = _INT_OF_WIDTH.get(c.element_size())
            if int_dtype is None or c.is_complex():
                raise UsageError(f"write_snapshot {path}: {k} has dtype {c.dtype}, which safetensors cannot store")
            encoded[k] = str(c.dtype)
            c = c.view(int_dtype)
        cpu[k] = c
    if encoded:
        md[_DTYPES_KEY] = json.dumps(encoded, sort_keys=True)
    md[_ORDER_KEY] = json.dumps(list(cpu))

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.replace_file(path, lambda tmp: safetensors.torch.save_file(cpu, tmp, metadata=md or None))
    except OSError as e:
        raise SnapshotError(f"cannot write snapshot {path}: {e.strerror or e}") from None
    except safetensors.SafetensorError as e:
        raise SnapshotError(f"cannot write snapshot {path}: {e}") from None
    return path


# --------------------------------------------------------------------------------------------
# Read
# --------------------------------------------------------------------------------------------


def _open(path: Path):  # type: ignore[no-untyped-def]
    if not path.exists():
        raise SnapshotError(f"snapshot {path} not found")
    if not path.is_file():
        raise SnapshotError(f"snapshot {path} is not a regular file")
    try:
        return safetensors.safe_open(str(path), framework="pt", device="cpu")
    except safetensors.SafetensorError as e:
        raise SnapshotError(f"snapshot {path} is truncated or corrupt ({e}); re-create it") from None
    except OSError as e:
        raise SnapshotError(f"cannot read snapshot {path}: {e.strerror or e}") from None


def _split_metadata(md: dict[str, str] | None, path: Path) -> tuple[dict[str, str], dict[str, torch.dtype]]:
    md = dict(md or {})
    md.pop(_ORDER_KEY, None)  # read by _written_order
    raw = md.pop(_DTYPES_KEY, None)
    encoded: dict[str, torch.dtype] = {}
    if raw is not None:
        try:
            names = json.loads(raw)
            for k, name in names.items():
                dt = _dtype_from_name(name)
                if dt is None:
                    raise SnapshotError(f"snapshot {path}: tensor {k} has dtype {name}, unknown to this torch")
                encoded[k] = dt
        except (ValueError, AttributeError, TypeError):
            raise SnapshotError(f"snapshot {path}: malformed {_DTYPES_KEY} metadata; re-create it") from None
    return md, encoded


def _written_order(md: dict[str, str] | None, names: list[str]) -> list[str]:
    """``names`` (the file's, sorted) in the order they were written, where the file records it
    (files written before it did, or whose record does not name the same tensors: as they are)."""
    try:
        order = json.loads((md or {}).get(_ORDER_KEY, "null"))
    except ValueError:
        return names
    return order if isinstance(order, list) and sorted(order) == sorted(names) else names


def read_snapshot_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The user metadata of a snapshot, without loading its tensors."""
    path = Path(path)
    with _open(path) as f:
        md = f.metadata()
    return _split_metadata(md, path)[0]


def read_snapshot(
    path: str | os.PathLike[str],
    *,
    device: str | torch.device = "cpu",
    keys: list[str] | None = None,
    copy: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a snapshot written by :func:`write_snapshot`.

    Args:
        path: the safetensors file.
        device: where to put the tensors.
        keys: read only these tensors (all by default); a missing one is an error.
        copy: False (CPU only): views of the privately memory-mapped file instead of copies,
            for a reader that only looks (triage): nothing is read until a tensor is used, and a
            step file of a large model is not held twice (a write to a view stays in this
            process). They stay valid when the file is replaced, as every write here replaces
            it (rename), never truncates it in place.

    Returns:
        ``(tensors, metadata)``. Tensors are private copies (or views, see ``copy``) in the
        order they were written (safetensors sorts a file's tensors by name; the writer records
        their order), metadata is ``{str: str}`` (empty if none).

    Raises:
        SnapshotError: the file is missing, truncated or corrupt (exit code 2).
    """
    path = Path(path)
    out: dict[str, torch.Tensor] = {}
    with _open(path) as f:
        try:
            raw = f.metadata()
            md, encoded = _split_metadata(raw, path)
            names = _written_order(raw, list(f.keys()))
            if keys is not None:
                absent = [k for k in keys if k not in names]
                if absent:
                    raise SnapshotError(f"snapshot {path} has no tensor {absent[0]!r}")
                names = list(keys)
            for k in names:
                t = f.get_tensor(k)  # a view of the memory-mapped file
                if k in encoded:
                    t = t.view(encoded[k])
                if str(device) != "cpu":
                    t = t.to(device)  # a copy already
                elif copy:
                    t = t.clone()
                out[k] = t
        except safetensors.SafetensorError as e:
            raise SnapshotError(f"snapshot {path} is truncated or corrupt ({e}); re-create it") from None
        except OSError as e:
            raise SnapshotError(f"cannot read snapshot {path}: {e.strerror or e}") from None
    return out, md


# --------------------------------------------------------------------------------------------
# Streaming writer
# --------------------------------------------------------------------------------------------


class StreamingSnapshotWriter:
    """Writes one snapshot file per step as soon as the step is handed over, on a background thread.

    Host memory stays bounded: :meth:`submit` blocks while an earlier step is still queued, so at
    most two steps' tensors exist at once (the one being written and the one waiting). A rank that
    dies leaves every step it had handed over and the writer had finished, each file complete
    (written atomically by :func:`write_snapshot`). The tensors handed over must be private CPU
    copies: the caller's live tensors change in place in the next phase.
    """

    def __init__(self, directory: str | os.PathLike[str], rank: int, metadata: Mapping[str, str]):
        import queue
        import threading

        self.directory, self.rank, self.metadata = Path(directory), rank, dict(metadata)
        self.written: list[str] = []
        self.bytes_written = 0
        self.write_seconds = 0.0
        self._error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue(maxsize=1)
        self._thread = threading.Thread(target=self._drain, name=f"snapshot-writer-{rank}", daemon=True)
        self._thread.start()

    def submit(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Queue one step's tensors (blocks while the previous step is still waiting)."""
        self._raise_if_failed()
        self._queue.put((step, dict(tensors)))

    def close(self) -> list[str]:
        """Wait until every queued step is on disk; return the paths written, in step order."""
        self._queue.put(None)
        self._thread.join()
        self._raise_if_failed()
        return list(self.written)

    def _drain(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue  # keep draining so submit() never blocks forever after a failure
            try:
                self._write(*item)
            except BaseException as e:  # any failure, not only the file's: re-raised on the rank's main thread
                self._error = e

    def _write(self, step: int, tensors: Mapping[str, torch.Tensor]) -> None:
        path = self.directory / snapshot_filename(step, self.rank)
        t0 = time.perf_counter()
        write_snapshot(path, tensors, {**self.metadata, "step": str(step), "rank": str(self.rank)})
        self.write_seconds += time.perf_counter() - t0
        self.bytes_written += path.stat().st_size
        self.written.append(str(path))

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
