"""parity.atomic on its own: what makes a write survive a power loss, the one-rename swap where
Linux offers it, and names kept apart in a shared directory (goldens of several platforms sit side
by side, checkpoints of several steps). The interruption cases are in test_golden.py,
test_checkpoint.py and test_reliability.py."""

import ctypes
import errno
import os
import sys

import pytest

from parity import atomic


def _fsync_spy(monkeypatch) -> list:
    """Paths fsynced from now on (read back from each descriptor)."""
    synced, real = [], os.fsync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)
    monkeypatch.setattr(os, "fsync", spy)
    return synced


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc to name a descriptor's file")
def test_the_data_and_the_rename_are_fsynced(tmp_path, monkeypatch):
    """A file's content before its rename, the directory after it: without either, a power loss
    can leave the new name pointing at an empty or missing file."""
    synced = _fsync_spy(monkeypatch)
    target = tmp_path / "report.json"
    tmp = []
    atomic.replace_file(target, lambda p: (tmp.append(p), open(p, "w").write("{}")))
    assert synced == [tmp[0], str(tmp_path)]

    synced.clear()
    staged = []

    def fill(d):
        staged.append(str(d))
        (d / "manifest.json").write_text("{}")
    atomic.replace_dir(tmp_path / "golden", fill, overwrite=False, marker="manifest.json")
    assert synced == [staged[0], str(tmp_path)]  # the filled directory, then its new entry

    synced.clear()
    staged.clear()
    monkeypatch.setattr(atomic, "_rename_exchange", lambda a, b: False)
    atomic.replace_dir(tmp_path / "golden", fill, overwrite=True, marker="manifest.json")
    # two renames: the old one's move aside is durable before the new one takes its name
    assert synced == [staged[0], str(tmp_path), str(tmp_path)]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
def test_replacing_a_directory_on_linux_swaps_it_in_one_rename(tmp_path, monkeypatch):
    probe_a, probe_b = tmp_path / "probe-a", tmp_path / "probe-b"
    probe_a.mkdir()
    probe_b.mkdir()
    if not atomic._rename_exchange(probe_a, probe_b):
        pytest.skip("this filesystem cannot exchange two directories")
    target = tmp_path / "ckpt"
    atomic.replace_dir(target, lambda d: (d / "m").write_text("1"), overwrite=False, marker="m")
    monkeypatch.setattr(atomic, "_between_renames", lambda: pytest.fail("took the two-rename fallback"))
    atomic.replace_dir(target, lambda d: (d / "m").write_text("2"), overwrite=True, marker="m")
    assert (target / "m").read_text() == "2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "probe-a", "probe-b"]


def test_one_names_leftovers_are_not_anothers(tmp_path, monkeypatch):
    """A backup of ``a`` left by a swap cut short is ``a``'s alone: ``b`` neither resolves to it
    nor gets it put back in its place by its next writer."""
    a, b = tmp_path / "a", tmp_path / "b"
    atomic.replace_dir(a, lambda d: (d / "m").write_text("a1"), overwrite=False, marker="m")
    monkeypatch.setattr(atomic, "_rename_exchange", lambda x, y: False)
    monkeypatch.setattr(atomic, "_between_renames", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        atomic.replace_dir(a, lambda d: (d / "m").write_text("a2"), overwrite=True, marker="m")
    assert not a.exists() and (atomic.resolve(a, "m") / "m").read_text() == "a1"
    assert atomic.resolve(b, "m") is None
    monkeypatch.setattr(atomic, "_between_renames", lambda: None)
    atomic.replace_dir(b, lambda d: (d / "m").write_text("b1"), overwrite=False, marker="m")
    assert (b / "m").read_text() == "b1"
    assert (atomic.resolve(a, "m") / "m").read_text() == "a1"  # still there, still a's


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="renameat2 is Linux's")
@pytest.mark.parametrize("err,falls_back", [(errno.EINVAL, True), (errno.ENOSYS, True), (errno.EPERM, True),
                                            (errno.EACCES, False), (errno.EXDEV, False)])
def test_a_refused_exchange_falls_back_only_where_the_filesystem_cannot_do_it(tmp_path, monkeypatch, err,
                                                                             falls_back):
    """renameat2 failing because the kernel or filesystem lacks the exchange means: take the two
    renames. Failing for any other reason (permissions, another device) is the writer's error."""
    class Libc:
        def __init__(self, *args, **kwargs):
            pass

        @staticmethod
        def renameat2(*args):
            ctypes.set_errno(err)
            return -1
    monkeypatch.setattr(atomic.ctypes, "CDLL", Libc)
    a, b = tmp_path / "a", tmp_path / "b"
    if falls_back:
        assert atomic._rename_exchange(a, b) is False
    else:
        with pytest.raises(OSError) as e:
            atomic._rename_exchange(a, b)
        assert e.value.errno == err


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_the_next_writer_restores_a_cut_short_swap_and_publishes_no_dead_writers_staging(tmp_path, monkeypatch):
    """After a swap cut short between its renames the old directory sits under its backup name.
    The next writer puts it back before it writes, so that it stays even if that writer fails too.
    A dead writer's staging directory is removed, never published, even where it holds the marker
    (it died before its swap: its content was never the target's)."""
    a = tmp_path / "a"
    atomic.replace_dir(a, lambda d: (d / "m").write_text("a1"), overwrite=False, marker="m")
    monkeypatch.setattr(atomic, "_rename_exchange", lambda x, y: False)
    monkeypatch.setattr(atomic, "_between_renames", lambda: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        atomic.replace_dir(a, lambda d: (d / "m").write_text("a2"), overwrite=True, marker="m")
    monkeypatch.setattr(atomic, "_between_renames", lambda: None)

    def broken(d):
        raise RuntimeError("disk full")
    synced = _fsync_spy(monkeypatch)
    with pytest.raises(RuntimeError):
        atomic.replace_dir(a, broken, overwrite=True, marker="m")
    assert (a / "m").read_text() == "a1"
    if os.path.isdir("/proc/self/fd"):
        assert synced == [str(tmp_path)]  # the put-back rename is durable before anything else happens
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]

    b = tmp_path / "b"
    dead = tmp_path / f".b.tmp-{_dead_pid()}-x"
    dead.mkdir()
    (dead / "m").write_text("never published")
    with pytest.raises(RuntimeError):
        atomic.replace_dir(b, broken, overwrite=False, marker="m")
    assert not b.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["a"]


@pytest.mark.parametrize("mask", [0o077, 0o002], ids=["umask-077", "umask-002"])
def test_what_is_written_is_as_private_as_the_umask_says(tmp_path, mask):
    """Files and directories get a plain open's and mkdir's mode: a umask of 077 keeps checkpoints,
    goldens and reports private, one of 002 shares them with the group."""
    def own_private_file(p):  # as safetensors writes: a file of its own, 0600, renamed over ``p``
        os.close(os.open(p + ".own", os.O_WRONLY | os.O_CREAT, 0o600))
        os.replace(p + ".own", p)
    old = os.umask(mask)
    try:
        atomic.replace_file(tmp_path / "report.json", lambda p: open(p, "w").write("{}"))
        atomic.replace_file(tmp_path / "snapshot", own_private_file)
        atomic.replace_dir(tmp_path / "ckpt", lambda d: (d / "m").write_text("1"), overwrite=False, marker="m")
        atomic.replace_dir(tmp_path / "ckpt", lambda d: atomic.replace_file(d / "m", lambda p: open(p, "w").write("2")),
                           overwrite=True, marker="m")
    finally:
        os.umask(old)
    assert (tmp_path / "report.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "snapshot").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o777 & ~mask
    assert (tmp_path / "ckpt" / "m").stat().st_mode & 0o777 == 0o666 & ~mask
    assert (tmp_path / "ckpt" / "m").read_text() == "2"


def test_another_hosts_leftovers_are_left_to_it(tmp_path, monkeypatch):
    """A directory shared between hosts: a pid is only meaningful on its own host, so another
    host's staging and backup are never removed or put back (its writer may be mid-swap), though
    a reader still finds a backup of it. This host's dead writers' leftovers go, and so do those
    named before the host was recorded."""
    a = tmp_path / "a"
    dead = _dead_pid()
    here = atomic._host()
    other_tmp = tmp_path / f".a.tmp-elsewhere@{dead}-x"
    other_old = tmp_path / f".a.old-elsewhere@{dead}-y"
    mine = tmp_path / f".a.tmp-{here}@{dead}-z"
    unnamed = tmp_path / f".a.tmp-{dead}-w"
    for d in (other_tmp, other_old, mine, unnamed):
        d.mkdir()
        (d / "m").write_text(d.name)
    assert atomic.resolve(a, "m") == other_old  # mid-swap elsewhere: the old directory is readable
    atomic.replace_dir(a, lambda d: (d / "m").write_text("new"), overwrite=True, marker="m")
    assert (a / "m").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["a", other_tmp.name, other_old.name])
    assert [(k, h, w) for k, h, w, _ in sorted(atomic.leftovers(tmp_path), key=lambda t: t[0])] == [
        ("old", "elsewhere", dead), ("tmp", "elsewhere", dead)]


def test_a_staging_name_carries_this_host_and_pid(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic.socket, "gethostname", lambda: "node-7.cluster")
    staging = atomic.staging_dir(tmp_path / "ckpt", "m")
    assert staging.name.startswith(f".ckpt.tmp-node-7.cluster@{os.getpid()}-")
    assert atomic.leftovers(tmp_path) == [("tmp", "node-7.cluster", os.getpid(), staging)]


@pytest.mark.parametrize("name", ["node_7", "node 7", "nöde-7"])
def test_hosts_whose_names_differ_in_odd_characters_keep_apart(tmp_path, monkeypatch, name):
    """Hosts named node-7 and node_7 (or with a space, or a non-ASCII letter) sharing a directory:
    each host's name in a leftover is its own, so neither takes the other's leftovers for its
    own dead writer's."""
    dead = _dead_pid()
    monkeypatch.setattr(atomic.socket, "gethostname", lambda: "node-7")
    theirs = tmp_path / f".a.tmp-{atomic._host()}@{dead}-x"
    theirs.mkdir()
    monkeypatch.setattr(atomic.socket, "gethostname", lambda: name)
    here = atomic._host()
    assert here != "node-7" and atomic.leftovers(tmp_path) == [("tmp", "node-7", dead, theirs)]
    atomic.replace_dir(tmp_path / "a", lambda d: (d / "m").write_text("new"), overwrite=False, marker="m")
    assert theirs.is_dir()  # not this host's: left alone
    staging = atomic.staging_dir(tmp_path / "b", "m")
    assert [h for _, h, _, p in atomic.leftovers(tmp_path) if p == staging] == [here]
