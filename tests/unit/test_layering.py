"""The package imports only downward: vocab -> atomic -> fp8 -> distributed -> model -> ddp -> optim
-> harness -> cli (`__main__`, which only calls cli, sits above it)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "parity"
LAYERS = ["vocab", "atomic", "fp8", "distributed", "model", "ddp", "optim", "harness", "cli", "__main__"]


def _layer(module: str) -> int:
    """Layer index of a dotted module name inside parity (``parity.__init__`` counts as lowest)."""
    parts = module.split(".")
    if len(parts) < 2:
        return -1
    return LAYERS.index(parts[1])


def _imports(path: Path, root: Path = PKG.parent) -> list[tuple[str, int]]:
    """The parity modules ``path`` imports, with their lines; ``root`` is the folder holding the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(root).with_suffix("")
    here = list(rel.parts if rel.name != "__init__" else rel.parts[:-1])
    if path.name != "__init__.py":
        here = here[:-1]  # the package holding this module
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("parity")]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("parity"):
                out.append((mod, node.lineno))
    return out


def test_every_module_sits_in_a_known_layer():
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        if mod != "parity.__init__":
            assert _layer(mod) >= 0, f"{mod}: not in any layer of {LAYERS}"


def _upward_imports(pkg: Path) -> list[str]:
    """"file:line imports module" for every import in ``pkg`` of a module in a higher layer."""
    bad = []
    for path in pkg.rglob("*.py"):
        mod = ".".join(path.relative_to(pkg.parent).with_suffix("").parts)
        if mod == "parity.__init__":
            continue
        mine = _layer(mod)
        for target, line in _imports(path, pkg.parent):
            if target != "parity" and _layer(target) > mine:
                bad.append(f"{path.relative_to(pkg.parent)}:{line} imports {target}")
    return bad


def test_imports_only_go_downward():
    bad = _upward_imports(PKG)
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: an fp8 module importing the harness, absolutely or relatively, is
    reported (in a copy of the layout under tmp_path: the source tree is shared with other tests)."""
    fp8 = tmp_path / "parity" / "fp8"
    fp8.mkdir(parents=True)
    (fp8 / "ok.py").write_text("from parity.vocab import Recipe\nfrom . import formats\n")
    (fp8 / "probe.py").write_text("import os\nfrom parity.harness import compare\nfrom ..optim import muon\n")
    assert sorted(_upward_imports(tmp_path / "parity")) == [
        "parity/fp8/probe.py:2 imports parity.harness", "parity/fp8/probe.py:3 imports parity.optim"]
