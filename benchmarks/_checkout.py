"""Import this checkout's zerofx, installed or not (for scripts run on a machine where nothing
was installed, such as a lent GPU machine)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def import_checkout() -> None:
    """Make ``import zerofx`` (and ``benchmarks``) resolve to this checkout: passes/ and
    codegen/ live at the top of the repository and install as zerofx.passes / zerofx.codegen,
    so putting the repository on ``sys.path`` alone would give a zerofx without them."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if "zerofx" in sys.modules:
        return

    def load(name: str, folder: Path):
        spec = importlib.util.spec_from_file_location(
            name, folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        return spec, module

    top_spec, top = load("zerofx", ROOT / "zerofx")
    subs = [load(f"zerofx.{sub}", ROOT / sub) for sub in ("passes", "codegen")]
    for (spec, module), sub in zip(subs, ("passes", "codegen")):
        setattr(top, sub, module)
        spec.loader.exec_module(module)
    top_spec.loader.exec_module(top)
