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
cut short. A leftover's name carries its writer's host and pid: only a writer on that host can
tell whether the pid is still alive, so a directory shared between hosts keeps another host's
leftovers (its writer may be mid-swap) for a writer on that host to clear.

What is written is as private as a plain ``open``/``mkdir`` would make it: files 0666 and
directories 0777, less the process's umask (the kernel applies it; tempfile's private 0600/0700
would hide shared results, a fixed 0644/0755 would expose what a umask of 077 keeps private).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
import socket
import string
import sys
from collections.abc import Callable
from pathlib import Path

__all__ = ["fsync_dir", "replace_file", "replace_dir", "staging_dir", "publish_dir", "resolve"]

# ".NAME.KIND-HOST@PID-RANDOM"; names written before the host was recorded lack "HOST@"
_LEFTOVER_RE = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?:(?P<host>[A-Za-z0-9_.-]+)@)?(?P<writer>\d+)-")


_HOST_CHARS = frozenset(string.ascii_letters + string.digits + ".-")


def _host() -> str:
    """This host as a leftover's name carries it: letters, digits, ``.`` and ``-`` as they are,
    any other byte as ``_XX`` (hex), so that two hosts never share a name (``node_7`` is not
    ``node-7``: each must leave the other's leftovers alone)."""
    name = socket.gethostname() or "localhost"
    return "".join(c if c in _HOST_CHARS else "".join(f"_{b:02x}" for b in c.encode()) for c in name)


def _unique_name(directory: str, base: str, make: Callable[[str], None]) -> str:
    """``make(path)`` for a new ``directory/base-RANDOM``; ``make`` raises FileExistsError when the
    path is taken (as ``os.mkdir`` and ``O_EXCL`` do), and another random suffix is tried."""
    for _ in range(100):
        path = os.path.join(directory, f"{base}-{os.urandom(4).hex()}")
        try:
            make(path)
        except FileExistsError:
            continue
        return path
    raise FileExistsError(errno.EEXIST, "no unused temporary name", os.path.join(directory, base))


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

    The file has a plain write's mode (0666 less the umask), is fsynced, renamed over ``path``,
    and the directory is fsynced so that the rename survives a power loss.
    If ``write`` or the filesystem fails, ``path`` keeps its old content and no temporary is left.

    Raises:
        OSError: the directory takes no files (and whatever ``write`` raises).
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    tmp = _unique_name(directory, f".{os.path.basename(path)}.tmp",
                       lambda p: os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)))
    try:
        mode = os.stat(tmp).st_mode & 0o777  # the umask applied: no need to read it (by setting it)
        write(tmp)
        os.chmod(tmp, mode)  # a writer may have made its own file there (safetensors makes it 0600)
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
    """A new empty directory beside ``target`` (hidden, named after it, this host and this process;
    a plain mkdir's mode) to fill and then :func:`publish_dir`. The leftovers of ``target``'s dead
    writers on this host go first; a backup holding ``marker`` whose swap was cut short is put
    back at ``target``.

    Raises:
        OSError: the filesystem refused.
    """
    parent = target.parent
    parent.mkdir(parents=True, exist_ok=True)
    _cleanup_stale(parent, target.name, marker)
    return Path(_unique_name(str(parent), f".{target.name}.tmp-{_host()}@{os.getpid()}", os.mkdir))


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
    olds = [p for kind, _, _, p in leftovers(target.parent, target.name) if kind == "old" and (p / marker).is_file()]
    return max(olds, key=lambda p: p.stat().st_mtime) if olds else None


def leftovers(parent: Path, name: str | None = None) -> list[tuple[str, str | None, int, Path]]:
    """(kind "tmp" or "old", writer's host or None where the name predates it, writer pid, path) of
    the staging and backup directories in ``parent`` (of ``name``'s, or of every name when None)."""
    out = []
    for p in parent.iterdir() if parent.is_dir() else []:
        m = _LEFTOVER_RE.match(p.name)
        if m and (name is None or m["name"] == name) and p.is_dir():
            out.append((m["kind"], m["host"], int(m["writer"]), p))
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
        backup = parent / f".{target.name}.old-{_host()}@{os.getpid()}-{os.urandom(4).hex()}"
        os.rename(target, backup)
        fsync_dir(parent)
        _between_renames()
        os.rename(staging, target)
        shutil.rmtree(backup, ignore_errors=True)
    fsync_dir(parent)


def _between_renames() -> None:
    """Test hook: the window of the two-rename fallback."""


def _cleanup_stale(parent: Path, name: str, marker: str) -> None:
    target, here = parent / name, _host()
    for kind, host, writer, path in sorted(leftovers(parent, name), key=lambda t: (t[0], t[2], str(t[3]))):
        if host not in (None, here) or (writer != os.getpid() and _pid_alive(writer)):
            continue  # another host's writer, or a live one here: it may be mid-swap
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
