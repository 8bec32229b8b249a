"""Recipes: TOML files that name a case (and, for `sweep`, a grid of values), shipped in
`attn_doctor/recipes/` or given by path. A recipe is checked whole before anything runs: an unknown or
missing table or key is refused with the file and the key named, never silently ignored.

    description = "..."        # optional
    [case]                     # required: Case fields (batch, seq, heads, head_dim, kv_heads, seq_kv, dtype,
    batch = 4                  #   mask, window = [LEFT, RIGHT], seed, inputs)
    [grid]                     # optional, for sweep: a non-empty list per case field, or layers / tp
    layers = [24, 128]
    inputs = ["normal", "outliers"]
    [[grids]]                  # optional, for sweep: more grids, each over [case] and [grid]; their cases
    mask = ["padding_causal"]  #   are joined (a feature space too sparse for one cross product)
    seqlens = [[512, 387, 257, 1]]
    family = "mask"            #   optional: the grid's family, which `sweep --family` picks and tables count by
    drop_invalid = true        # optional: leave out the combinations TE's API cannot take (counted)
    layouts = ["contiguous"]   # optional: the sweep's layouts when --layout is not given

"none" stands for no value where a field may have none (window, seqlens, seqlens_kv, head_dim_v,
mask_source).
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
from attn_doctor.core.paths import check_input

RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"
TOP_LEVEL = ("description", "case", "grid", "grids", "drop_invalid", "layouts")
NONE_FIELDS = ("window", "seqlens", "seqlens_kv", "head_dim_v", "mask_source")
GRID_KEYS = GRID_FIELDS + ("layers", "tp")


@dataclass(frozen=True)
class Recipe:
    """One base case, optionally a grid of values for `sweep`."""

    name: str
    path: Path
    description: str
    case: dict[str, Any]
    grid: dict[str, list[Any]] = field(default_factory=dict)
    grids: list[dict[str, list[Any]]] = field(default_factory=list)  # more grids, each over case and grid
    drop_invalid: bool = False  # leave out the grids' combinations that are not valid cases
    layouts: list[str] = field(default_factory=list)  # the sweep's layouts when none are given
    families: list[str] = field(default_factory=list)  # each grid's family ("" where it names none)

    def family_names(self) -> list[str]:
        """The families the grids name, in order of first appearance."""
        return [name for name in dict.fromkeys(self.families) if name]

    def grids_of(self, families: list[str] | None) -> list[dict[str, list[Any]]]:
        """The grids of `families` (None: every grid); a family no grid names is bad input."""
        if families is None:
            return list(self.grids)
        unknown = [name for name in families if name not in self.families]
        if unknown:
            raise BadInput(f"recipe {self.path} has no family {', '.join(unknown)}; its families: "
                           f"{', '.join(self.family_names()) or '(none)'}")
        return [grid for grid, family in zip(self.grids, self.families) if family in families]


def find_recipe(name_or_path: str) -> Path:
    check_input(name_or_path, "--recipe", "file")
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
                       "[case], [grid], [[grids]], drop_invalid and layouts")
    case, grid, grids = data.get("case"), data.get("grid", {}), data.get("grids", [])
    if case is None:
        raise BadInput(f"recipe {path} has no [case] table; put the case's fields (batch, seq, heads, ...) under [case]")
    if not isinstance(case, dict) or not isinstance(grid, dict):
        raise BadInput(f"recipe {path}: [case] and [grid] must be tables")
    if not isinstance(grids, list) or not all(isinstance(g, dict) for g in grids):
        raise BadInput(f"recipe {path}: grids must be an array of tables ([[grids]])")
    known = {f.name for f in dataclasses.fields(Case)}
    unknown = sorted(set(case) - known)
    if unknown:
        raise BadInput(f"recipe {path}: unknown case field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    case = _nones(case, path, "case", single=True)
    grid = _checked_grid(grid, path, "grid")
    families = [_family(g, path, f"grids[{i}]") for i, g in enumerate(grids)]
    grids = [_checked_grid({k: v for k, v in g.items() if k != "family"}, path, f"grids[{i}]")
             for i, g in enumerate(grids)]
    drop_invalid = data.get("drop_invalid", False)
    layouts = data.get("layouts", [])
    if not isinstance(drop_invalid, bool):
        raise BadInput(f"recipe {path}: drop_invalid must be true or false")
    from attn_doctor.core.layouts import LAYOUTS, canonical_layouts

    if not isinstance(layouts, list) or any(name not in LAYOUTS for name in canonical_layouts(layouts)):
        raise BadInput(f"recipe {path}: layouts must be a list of {', '.join(LAYOUTS)} (or TE's names)")
    make_case(**case)  # validate now, so a broken recipe fails before any work starts
    return Recipe(path.stem, path, str(data.get("description", "")), case, grid, grids, drop_invalid,
                  canonical_layouts(layouts), families)


def _family(grid: dict, path: Path, where: str) -> str:
    family = grid.get("family", "")
    if not isinstance(family, str):
        raise BadInput(f"recipe {path}: {where}.family must be a name (a string), got {family!r}")
    return family


def _checked_grid(grid: dict, path: Path, where: str) -> dict[str, list[Any]]:
    unknown = sorted(set(grid) - set(GRID_KEYS))
    if unknown:
        raise BadInput(f"recipe {path}: unknown {where} key(s) {', '.join(unknown)}; known: {', '.join(GRID_KEYS)}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise BadInput(f"recipe {path}: {where}.{key} must be a non-empty list")
    return _nones(grid, path, where, single=False)


def _nones(fields: dict[str, Any], path: Path, where: str, single: bool) -> dict[str, Any]:
    """"none" as None where a field may have no value; windows and lengths as tuples."""
    def one(name: str, value: Any) -> Any:
        if name not in NONE_FIELDS:
            return value
        if value is None or value == "none":
            return None
        if name == "window":
            return _window(value, path, f"{where}.window")
        if name in ("seqlens", "seqlens_kv"):
            if not isinstance(value, list):
                raise BadInput(f"recipe {path}: {where}.{name} must be a list of lengths or \"none\", got {value!r}")
            return tuple(value)
        return value
    if single:
        return {name: one(name, value) for name, value in fields.items()}
    return {name: [one(name, v) for v in values] for name, values in fields.items()}


