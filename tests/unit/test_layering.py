"""The package imports only downward: vocab -> fp8 -> distributed -> model -> ddp -> optim -> harness -> cli
(`__main__`, which only calls cli, sits above it)."""

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "parity"
LAYERS = ["vocab", "fp8", "distributed", "model", "ddp", "optim", "harness", "cli", "__main__"]


def _layer(module: str) -> int:
    """Layer index of a dotted module name inside parity (``parity.__init__`` counts as lowest)."""
    parts = module.split(".")
    if len(parts) < 2:
        return -1
    return LAYERS.index(parts[1])


def _imports(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    rel = path.relative_to(PKG.parent).with_suffix("")
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


def test_imports_only_go_downward():
    bad = []
    for path in PKG.rglob("*.py"):
        mod = ".".join(path.relative_to(PKG.parent).with_suffix("").parts)
        if mod == "parity.__init__":
            continue
        mine = _layer(mod)
        for target, line in _imports(path):
            if target != "parity" and _layer(target) > mine:
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {target}")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_sees_an_upward_import(tmp_path):
    """The rule is not vacuous: an fp8 module importing the harness is reported."""
    fake = PKG / "fp8" / "_layering_probe.py"
    fake.write_text("from parity.harness import compare\n")
    try:
        imports = _imports(fake)
        assert imports == [("parity.harness", 1)]
        assert _layer(imports[0][0]) > _layer("parity.fp8._layering_probe")
    finally:
        fake.unlink()
