"""Files and directories replaced atomically: a reader finds the old one or the new one, never a mix.

The one place the package writes results that must survive an interruption: report files,
snapshots, golden records and checkpoints. It sits below every other layer (the checkpoint, in
``parity.optim``, uses it as the harness does).

:func:`replace_file` writes a temporary file beside the target, fsyncs it, renames it over the
target and fsyncs the directory. A directory is staged and published: :func:`staging_dir` makes a
hidden directory beside the target (after removing what dead writers left there), the writers fill
it, and :func:`publish_dir` fsyncs it and swaps it in with one ``renameat2(RENAME_EXCHANGE)``
where Linux offers it, or with two renames otherwise (in between, :func:`resolve` finds the old
directory under its backup name). :func:`replace_dir` is the three in one process. An
interruption at any point (SIGINT, SIGKILL, power loss) leaves the previous directory readable;
the next writer removes the leftovers of dead writers and puts back a directory whose swap was
cut short.
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync_dir", "replace_file", "replace_dir", "staging_dir", "publish_dir", "resolve"]

_LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<writer>\d+)-")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync a directory so that renames and new entries in it are durable."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some filesystems refuse fsync on dirs
        pass
    finally:
        os.close(fd)


def replace_file(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """Make ``path`` hold what ``write(tmp)`` writes into ``tmp``, a temporary file beside it.

    The file is readable by all (0644, as a plain write makes it: results are shared), fsynced,
    renamed over ``path``, and the directory is fsynced so that the rename survives a power loss.
    If ``write`` or the filesystem fails, ``path`` keeps its old content and no temporary is left.

    Raises:
        OSError: the directory takes no files (and whatever ``write`` raises).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)  # mkstemp makes it private
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fsync_dir(directory)


def replace_dir(target: Path, fill: Callable[[Path], None], *, overwrite: bool, marker: str) -> None:
    """Make ``target`` a directory filled by ``fill(staging)``; ``marker`` is the file whose
    presence makes a directory complete (it should be written last).

    Raises:
        FileExistsError: ``target`` exists and ``overwrite`` is False.
        OSError: the filesystem refused.
    """
    if not overwrite and resolve(target, marker) is not None:
        raise FileExistsError(str(target))
    staging = staging_dir(target, marker)
    try:
        fill(staging)
        publish_dir(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def staging_dir(target: Path, marker: str) -> Path:
    """A new empty directory beside ``target`` (hidden, named after it and this process) to fill
    and then :func:`publish_dir`. The leftovers of ``target``'s dead writers go first; a backup
    holding ``marker`` whose swap was cut short is put back at ``target``. The directory is
    readable by all (0755, as :func:`replace_file`'s 0644: results are shared; mkdtemp makes it
    private. Not from the umask: reading it means setting it, for every thread of the process).

    Raises:
        OSError: the filesystem refused.
    """
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _cleanup_stale(parent, target.name, marker)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=parent))
    os.chmod(staging, 0o755)
    return staging


def publish_dir(staging: Path, target: Path) -> None:
    """fsync the filled ``staging`` and swap it in at ``target``; an older ``target`` is removed
    only once the new one is in place. On failure ``staging`` is left for the caller to remove.

    Raises:
        OSError: the filesystem refused.
    """
    fsync_dir(staging)
    _swap_into_place(staging, target)


def resolve(target: Path, marker: str) -> Path | None:
    """The directory holding ``target``'s content: itself, or its moved-aside copy mid-swap."""
    if target.is_dir():
        return target
    olds = [p for kind, _, p in leftovers(target.parent, target.name) if kind == "old" and (p / marker).is_file()]
    return max(olds, key=lambda p: p.stat().st_mtime) if olds else None


def leftovers(parent: Path, name: str | None = None) -> list[tuple[str, int, Path]]:
    """(kind "tmp" or "old", writer pid, path) of the staging and backup directories in ``parent``
    (of ``name``'s, or of every name when None)."""
    out = []
    for p in parent.iterdir() if parent.is_dir() else []:
        m = _LEFTOVER_RE.match(p.name)
        if m and (name is None or m["name"] == name) and p.is_dir():
            out.append((m["kind"], int(m["writer"]), p))
    return out


def backup_name(path: Path) -> str | None:
    """The name a moved-aside backup directory stands for (None for other paths)."""
    m = _LEFTOVER_RE.match(path.name)
    return m["name"] if m and m["kind"] == "old" else None


def _rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap two paths with Linux renameat2(RENAME_EXCHANGE); False if unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), 2) == 0:  # AT_FDCWD, RENAME_EXCHANGE
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _swap_into_place(staging: Path, target: Path) -> None:
    parent = target.parent
    if not target.exists():
        os.rename(staging, target)
    elif _rename_exchange(staging, target):
        shutil.rmtree(staging, ignore_errors=True)  # now holds the old directory
    else:  # two renames; in between, readers find the old directory under its backup name
        backup = parent / f".{target.name}.old-{os.getpid()}-{os.urandom(4).hex()}"
        os.rename(target, backup)
        fsync_dir(parent)
        _between_renames()
        os.rename(staging, target)
        shutil.rmtree(backup, ignore_errors=True)
    fsync_dir(parent)


def _between_renames() -> None:
    """Test hook: the window of the two-rename fallback."""


def _cleanup_stale(parent: Path, name: str, marker: str) -> None:
    target = parent / name
    for kind, writer, path in sorted(leftovers(parent, name)):
        if writer != os.getpid() and _pid_alive(writer):
            continue
        if kind == "old" and not target.exists() and (path / marker).is_file():
            os.rename(path, target)
            fsync_dir(parent)
        else:
            shutil.rmtree(path, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
