"""How the command starts: torch is imported with the garbage collector off, and what the
process holds then is frozen (parity.cli._import_torch_uncollected)."""

import gc
import subprocess
import sys

from parity import cli

_PROBE = """
import gc, sys
from parity.cli import main
collections = []
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
code = main(sys.argv[1:])
print("torch" in sys.modules, len(collections), gc.isenabled(), gc.get_freeze_count(), code)
"""


def _probe(*argv):
    r = subprocess.run([sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=300)
    torch_loaded, n_collections, enabled, frozen, code = r.stdout.split()[-5:]
    return torch_loaded == "True", int(n_collections), enabled == "True", int(frozen), int(code)


def test_a_command_imports_torch_without_collections_then_freezes(tmp_path):
    torch_loaded, n_collections, enabled, frozen, code = _probe("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert torch_loaded and code == cli.EXIT_USAGE  # the diff of two missing snapshots: bad input
    # With the collector on, `import torch` alone set off hundreds of collections.
    assert n_collections < 10, n_collections
    assert enabled  # on again for the command itself
    assert frozen > 100_000  # torch's objects, out of the collector's reach


def test_list_does_not_load_torch():
    torch_loaded, _, enabled, frozen, code = _probe("list")
    assert not torch_loaded and enabled and frozen == 0 and code == cli.EXIT_OK


def test_a_process_that_has_torch_keeps_its_collector():
    import torch  # noqa: F401

    before = gc.get_freeze_count()
    cli._import_torch_uncollected()
    assert gc.get_freeze_count() == before and gc.isenabled()
