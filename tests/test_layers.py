"""The import layering of zerofx, checked from the source (an ``ast`` walk: nothing is imported).

Layers, lowest first; a module may import its own layer and the layers its row allows:

    leaf      zerofx.ir.*, zerofx.errors, zerofx.options, zerofx._scoped, zerofx.stress
    passes    zerofx.passes.*                         -> leaf
    codegen   zerofx.codegen.*                        -> leaf, passes
    runtime   zerofx.runtime.*                        -> leaf
    measure   zerofx.measure.*                        -> leaf, zerofx.passes.cost_model (op counts)
    top       every other zerofx module (api, backend, sharding, dump, checkpoint, cli, ...) -> any

Imports inside functions count the same as module-level ones: a lazy import is still an edge,
and one that points up is how cycles hide. docs/architecture.md shows the same matrix.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (pyproject's package-dir mapping)
PACKAGES = {"zerofx": "zerofx", "passes": "zerofx.passes", "codegen": "zerofx.codegen"}
LEAF = ("zerofx.ir", "zerofx.errors", "zerofx.options", "zerofx._scoped", "zerofx.stress")
ALLOWED = {
    "leaf": {"leaf"},
    "passes": {"leaf", "passes"},
    "codegen": {"leaf", "passes", "codegen"},
    "runtime": {"leaf", "runtime"},
    "measure": {"leaf", "measure", "zerofx.passes.cost_model"},
    "top": {"leaf", "passes", "codegen", "runtime", "measure", "top"},
}


def layer_of(module: str) -> str:
    if any(module == p or module.startswith(p + ".") for p in LEAF) or module == "zerofx.ir":
        return "leaf"
    for prefix, layer in (
        ("zerofx.passes", "passes"),
        ("zerofx.codegen", "codegen"),
        ("zerofx.runtime", "runtime"),
        ("zerofx.measure", "measure"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "top"


def source_modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported zerofx module) for every import in the file, at any depth."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # ``from zerofx import ir`` imports the submodule zerofx.ir
            found += [
                (
                    node.lineno,
                    f"{base}.{a.name}"
                    if base
                    in ("zerofx", "zerofx.passes", "zerofx.codegen", "zerofx.runtime", "zerofx.measure", "zerofx.ir")
                    else base,
                )
                for a in node.names
            ]
    return [(line, m) for line, m in found if m == "zerofx" or m.startswith("zerofx.")]


def edge_allowed(importer: str, imported: str) -> bool:
    allowed = ALLOWED[layer_of(importer)]
    if imported == "zerofx":  # the package's __init__ is the top layer's public face
        return "top" in allowed
    return layer_of(imported) in allowed or any(imported == a or imported.startswith(a + ".") for a in allowed)


def violations(modules: dict[str, Path]) -> list[str]:
    bad = []
    for module, path in modules.items():
        for line, imported in imports_of(path, module):
            if not edge_allowed(module, imported):
                where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
                bad.append(f"{where}:{line}: {module} ({layer_of(module)}) imports {imported} ({layer_of(imported)})")
    return bad


def test_imports_point_down_the_layers():
    bad = violations(source_modules())
    assert not bad, "imports outside the layer matrix (tests/test_layers.py docstring):\n" + "\n".join(bad)


def test_every_module_is_in_a_layer_and_the_layer_packages_exist():
    modules = source_modules()
    for package in ("zerofx.ir", "zerofx.runtime", "zerofx.measure", "zerofx.passes", "zerofx.codegen"):
        assert package in modules, package
    assert {layer_of(m) for m in modules} == set(ALLOWED)


@pytest.mark.parametrize(
    "importer,imported",
    [
        ("zerofx.passes.bucket", "zerofx.backend"),  # a pass reaching up into the backend
        ("zerofx.ir.markers", "zerofx.measure.model_state"),  # the leaf importing measurement
        ("zerofx.runtime.eager_buckets", "zerofx.passes.transport"),  # what flat.py used to do
        ("zerofx.codegen.executor", "zerofx.measure.graph_buffers"),
    ],
)
def test_an_upward_import_is_reported(tmp_path, importer, imported):
    """The check can fail: a module with one deliberately upward import is caught, by line."""
    planted = tmp_path / "planted.py"
    planted.write_text(f'"""planted"""\n\nimport torch\n\n\ndef f():\n    from {imported} import something\n')
    bad = violations({importer: planted})
    assert len(bad) == 1 and f"imports {imported}" in bad[0] and ":7:" in bad[0], bad


def test_relative_imports_resolve_to_their_package(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text("from ..backend import make_backend\n")
    assert imports_of(planted, "zerofx.passes.bucket") == [(1, "zerofx.backend")]
