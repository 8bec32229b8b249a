"""Recipes: TOML files that name a case (and, for `sweep`, a grid of values), shipped in
`attn_doctor/recipes/` or given by path. A recipe is checked whole before anything runs: an unknown or
missing table or key is refused with the file and the key named, never silently ignored.

    description = "..."        # optional
    [case]                     # required: Case fields (batch, seq, heads, head_dim, kv_heads, seq_kv, dtype,
    batch = 4                  #   mask, window = [LEFT, RIGHT], seed, inputs)
    [grid]                     # optional, for sweep: a non-empty list per case field, or layers / tp
    layers = [24, 128]
    inputs = ["normal", "outliers"]
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from attn_doctor.core.case import GRID_FIELDS, Case, make_case
from attn_doctor.core.errors import BadInput

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
TOP_LEVEL = ("description", "case", "grid")
GRID_KEYS = GRID_FIELDS + ("layers", "tp")


@dataclass(frozen=True)
class Recipe:
    """One base case, optionally a grid of values for `sweep`."""

    name: str
    path: Path
    description: str
    case: dict[str, Any]
    grid: dict[str, list[Any]] = field(default_factory=dict)


def find_recipe(name_or_path: str) -> Path:
    candidates = [Path(name_or_path)]
    if not name_or_path.endswith(".toml"):
        candidates += [Path("recipes") / f"{name_or_path}.toml", RECIPES_DIR / f"{name_or_path}.toml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    shipped = sorted(p.stem for p in RECIPES_DIR.glob("*.toml")) if RECIPES_DIR.is_dir() else []
    raise BadInput(
        f"no recipe {name_or_path!r}: give a path to a .toml file or one of: {', '.join(shipped) or '(none shipped)'}"
    )


def _window(value: Any, path: Path, where: str) -> tuple[int, int] | None:
    if value is None or value == "none":
        return None
    if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, int) for v in value):
        raise BadInput(f"recipe {path}: {where} must be [LEFT, RIGHT] (whole numbers) or \"none\", got {value!r}")
    return value[0], value[1]


def load_recipe(name_or_path: str) -> Recipe:
    path = find_recipe(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"recipe {path} is not valid TOML ({exc}); fix the file or pick another recipe") from None
    unknown = sorted(set(data) - set(TOP_LEVEL))
    if unknown:
        raise BadInput(f"recipe {path}: unknown table or key {', '.join(unknown)}; a recipe holds description, "
                       "[case] and [grid]")
    case, grid = data.get("case"), data.get("grid", {})
    if case is None:
        raise BadInput(f"recipe {path} has no [case] table; put the case's fields (batch, seq, heads, ...) under [case]")
    if not isinstance(case, dict) or not isinstance(grid, dict):
        raise BadInput(f"recipe {path}: [case] and [grid] must be tables")
    known = {f.name for f in dataclasses.fields(Case)}
    unknown = sorted(set(case) - known)
    if unknown:
        raise BadInput(f"recipe {path}: unknown case field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise BadInput(f"recipe {path}: unknown grid key(s) {', '.join(unknown)}; known: {', '.join(GRID_KEYS)}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise BadInput(f"recipe {path}: grid.{key} must be a non-empty list")
    if "window" in case:
        case = {**case, "window": _window(case["window"], path, "case.window")}
    if "window" in grid:
        grid = {**grid, "window": [_window(w, path, "each grid.window entry") for w in grid["window"]]}
    make_case(**case)  # validate now, so a broken recipe fails before any work starts
    return Recipe(path.stem, path, str(data.get("description", "")), case, grid)
