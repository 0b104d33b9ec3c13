"""How the command starts and stops: torch is imported with the garbage collector off, and what the
process holds then is frozen (parity.cli.import_torch_uncollected); a reader of its output that
leaves ends it quietly; a torch that does not import is one line, not a traceback."""

import gc
import os
import subprocess
import sys

import pytest

from parity import cli

_PROBE = """
import gc, sys
from parity.cli import main
collections = []  # those run while torch's import is under way (importlib's _initializing flag)
def during_import(phase, info):
    torch = sys.modules.get("torch")
    if phase == "start" and torch is not None and getattr(torch.__spec__, "_initializing", False):
        collections.append(info["generation"])
gc.callbacks.append(during_import)
code = main(sys.argv[1:])
print("torch" in sys.modules, len(collections), gc.isenabled(), gc.get_freeze_count(), code)
"""


def _probe(*argv):
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=300)
    torch_loaded, n_collections, enabled, frozen, code = r.stdout.split()[-5:]
    return torch_loaded == "True", int(n_collections), enabled == "True", int(frozen), int(code)


@pytest.mark.parametrize("command", ["run", "diff"])
def test_a_command_imports_torch_without_collections_then_freezes(tmp_path, command):
    if command == "run":  # one step of a one-rank run: its input is checked first, without torch
        argv, want = ["run", "--world", "1", "--steps", "1", "--golden", "off", "--snapshot", "none",
                      "--quiet", "--out", str(tmp_path / "out")], cli.EXIT_OK
    else:  # the diff of two missing snapshots: bad input, found once torch is there
        argv, want = ["diff", str(tmp_path / "a"), str(tmp_path / "b")], cli.EXIT_USAGE
    torch_loaded, n_collections, enabled, frozen, code = _probe(*argv)
    assert torch_loaded and code == want
    assert n_collections == 0, n_collections  # with the collector on: about 350
    assert enabled  # on again for the command itself
    assert frozen > 100_000  # torch's objects, out of the collector's reach


def test_list_does_not_load_torch():
    torch_loaded, _, enabled, frozen, code = _probe("list")
    assert not torch_loaded and enabled and frozen == 0 and code == cli.EXIT_OK


def test_a_process_that_has_torch_keeps_its_collector():
    import torch  # noqa: F401

    before = gc.get_freeze_count()
    cli.import_torch_uncollected()
    assert gc.get_freeze_count() == before and gc.isenabled()


def test_a_broken_pipe_is_quiet_only_when_stdout_lost_its_reader(tmp_path, monkeypatch):
    """A reader that leaves (`parity list | head`) ends the command quietly; a broken pipe anywhere
    else (a rank's) stays a failure the user is told about."""
    read_end, write_end = os.pipe()
    try:
        with open(write_end, "w", closefd=False) as out:
            monkeypatch.setattr(sys, "stdout", out)
            assert not cli._stdout_reader_gone()  # a reader is there
            os.close(read_end)
            read_end = None
            assert cli._stdout_reader_gone()
        with open(tmp_path / "f", "w") as out:  # a file never loses its reader
            monkeypatch.setattr(sys, "stdout", out)
            assert not cli._stdout_reader_gone()
    finally:
        for fd in (read_end, write_end):
            if fd is not None:
                os.close(fd)


def test_a_broken_pipe_that_is_not_stdouts_is_reported():
    code = ("import sys\n"
            "from parity import cli\n"
            "def command(args, argv):\n"
            "    raise BrokenPipeError(32, 'Broken pipe')  # e.g. writing to a rank that died\n"
            "cli.COMMANDS['list'] = command\n"
            "sys.exit(cli.main(['list']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == cli.EXIT_RUNTIME and "internal error: BrokenPipeError" in r.stderr, r.stderr


def test_a_torch_that_does_not_import_is_one_line_not_a_traceback():
    code = ("import sys\n"
            "sys.modules['torch'] = None  # what an environment without torch looks like to an import\n"
            "from parity.cli import main\n"
            "sys.exit(main(['golden', 'show', 'default']))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == cli.EXIT_RUNTIME, r.stderr
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("parity: internal error: ModuleNotFoundError"), r.stderr
