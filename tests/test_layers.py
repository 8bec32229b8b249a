"""The package's layers only point down: every import (a lazy one inside a function too) goes to the module's
own layer or a lower one, and no modules import each other in a circle.

The layers, from the ground up, are what a newcomer reads in the folder list: the vocabulary (core), the
numerics and the machine's facts, the backends, verdicts and probes, results, the known defects matched
against them, tracing (a user's own model), the execution of probes, bisection and real ranks, the renderers,
the workflows, the command line."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "attn_doctor"
LAYERS: tuple[tuple[str, ...], ...] = (
    ("core",),
    ("numerics", "machine"),
    ("backends",),
    ("verdict", "probes"),
    ("results",),
    ("known_defects",),
    ("tracing",),
    ("execution",),
    ("bisect", "distributed"),
    ("render",),
    ("workflows",),
    ("cli", "__init__", "__main__"),
)
LAYER_OF = {part: height for height, parts in enumerate(LAYERS) for part in parts}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _part(module: str) -> str:
    """The layer a module of the package belongs to: its top-level folder (or the package's own files)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules `path` imports, wherever the import stands (module level, in a function, or for
    annotations alone under TYPE_CHECKING: a layer names no type of a higher one either)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # `from attn_doctor.backends import te_call` imports that module; `... import select`, the package.
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                     for alias in node.names]
        else:
            continue
        found |= {name for name in names if name in modules}
    return found


def _graph() -> dict[str, set[str]]:
    paths = {_module(path): path for path in PACKAGE.rglob("*.py")}
    return {module: _imports(path, set(paths)) - {module} for module, path in paths.items()}


GRAPH = _graph()


def test_every_folder_of_the_package_has_a_layer():
    assert {_part(module) for module in GRAPH} <= set(LAYER_OF), sorted({_part(m) for m in GRAPH} - set(LAYER_OF))


@pytest.mark.parametrize("module", sorted(GRAPH))
def test_imports_point_down(module):
    # The package's root (`attn_doctor`: its version, and the capture API's lazy wrappers) runs before any of
    # its modules does: taking its __version__ is no dependency on the layers above.
    upward = sorted(target for target in GRAPH[module] - {"attn_doctor"}
                    if LAYER_OF[_part(target)] > LAYER_OF[_part(module)])
    assert not upward, f"{module} ({_part(module)}) imports from higher layers: {upward}"


def test_no_modules_import_each_other_in_a_circle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    circles = []

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH[module]):
            if state.get(target) == 1:
                circles.append(path[path.index(target):] + [target])
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [module])
    assert not circles, circles
