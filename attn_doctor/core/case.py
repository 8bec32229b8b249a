"""The attention problem to check: shapes, dtype, mask and seed, validated, and loaded from recipes."""

from __future__ import annotations

import dataclasses
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from attn_doctor.core.errors import BadInput

DTYPES = ("bf16", "fp16", "fp32")
MASKS = ("causal", "none")
RECIPES_DIR = Path(__file__).resolve().parents[1] / "recipes"


@dataclass(frozen=True)
class Case:
    """One attention call. Defaults are the case of TE#1615 / Megatron-LM#1503 (GPT, 16 heads of 64)."""

    batch: int = 4
    seq: int = 1024
    heads: int = 16
    head_dim: int = 64
    kv_heads: int | None = None  # None: same as heads (no GQA)
    seq_kv: int | None = None  # None: same as seq (self-attention)
    dtype: str = "bf16"
    mask: str = "causal"
    # Sliding window (left, right) in TE's convention: query i sees keys [i-left, i+right]; -1 = unbounded.
    window: tuple[int, int] | None = None
    seed: int = 1234

    @property
    def num_kv_heads(self) -> int:
        return self.heads if self.kv_heads is None else self.kv_heads

    @property
    def seq_k(self) -> int:
        return self.seq if self.seq_kv is None else self.seq_kv

    @property
    def causal(self) -> bool:
        return self.mask == "causal"

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def key(self) -> tuple:
        """Identity of the inputs: cases with equal keys get bitwise-equal q, k, v, dout."""
        return dataclasses.astuple(self)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kv_heads"] = self.num_kv_heads
        d["seq_kv"] = self.seq_k
        d["window"] = list(self.window) if self.window is not None else None
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Case":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadInput(f"unknown case field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        d = dict(d)
        if d.get("window") is not None:
            d["window"] = tuple(d["window"])
        return make_case(**d)

    def short(self) -> str:
        parts = [f"b{self.batch}", f"s{self.seq}"]
        if self.seq_k != self.seq:
            parts.append(f"skv{self.seq_k}")
        parts.append(f"h{self.heads}")
        if self.num_kv_heads != self.heads:
            parts.append(f"kv{self.num_kv_heads}")
        parts += [f"d{self.head_dim}", self.dtype, self.mask]
        if self.window is not None:
            parts.append(f"win{self.window[0]},{self.window[1]}")
        return " ".join(parts)

    def cli_flags(self) -> str:
        """The `attn-doctor run` flags that rebuild this case."""
        flags = [
            f"--batch {self.batch}",
            f"--seq {self.seq}",
            f"--heads {self.heads}",
            f"--head-dim {self.head_dim}",
        ]
        if self.num_kv_heads != self.heads:
            flags.append(f"--kv-heads {self.num_kv_heads}")
        if self.seq_k != self.seq:
            flags.append(f"--seq-kv {self.seq_k}")
        flags += [f"--dtype {self.dtype}", f"--mask {self.mask}"]
        if self.window is not None:
            flags.append(f"--window {self.window[0]},{self.window[1]}")
        flags.append(f"--seed {self.seed}")
        return " ".join(flags)


def tp_unsupported(case: Case, tp: int) -> str | None:
    """Why the heads cannot be split into `tp` tensor-parallel shards (a SKIP reason), or None."""
    if case.heads % tp or case.num_kv_heads % tp:
        return f"TP={tp} needs heads ({case.heads}) and kv heads ({case.num_kv_heads}) divisible by {tp}"
    return None


def tp_shard(case: Case, tp: int) -> Case:
    """The case one of `tp` tensor-parallel head shards sees."""
    return dataclasses.replace(case, heads=case.heads // tp, kv_heads=case.num_kv_heads // tp)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be a whole number, got {value!r}")
    if value <= 0:
        raise BadInput(f"{name} must be at least 1, got {value}")
    return value


def make_case(**fields: Any) -> Case:
    """Build a Case, refusing impossible combinations with a message that says how to fix them."""
    case = Case(**fields)
    # Canonical form: equal cases compare and hash equal however they were spelled.
    case = dataclasses.replace(
        case,
        kv_heads=case.heads if case.kv_heads is None else case.kv_heads,
        seq_kv=case.seq if case.seq_kv is None else case.seq_kv,
        window=tuple(case.window) if case.window is not None else None,
    )
    for name in ("batch", "seq", "heads", "head_dim"):
        _positive(name, getattr(case, name))
    if case.kv_heads is not None:
        _positive("kv_heads", case.kv_heads)
    if case.seq_kv is not None:
        _positive("seq_kv", case.seq_kv)
    if case.heads % case.num_kv_heads:
        raise BadInput(
            f"heads ({case.heads}) must be divisible by kv-heads ({case.num_kv_heads}): "
            "each key/value head serves a whole group of query heads"
        )
    if case.dtype not in DTYPES:
        raise BadInput(f"unknown dtype {case.dtype!r}; choose one of {', '.join(DTYPES)}")
    if case.mask not in MASKS:
        raise BadInput(f"unknown mask {case.mask!r}; choose one of {', '.join(MASKS)}")
    if case.window is not None:
        left, right = case.window
        if any(not isinstance(w, int) or isinstance(w, bool) or w < -1 for w in (left, right)):
            raise BadInput(f"window must be two whole numbers >= -1 (LEFT,RIGHT; -1 = unbounded), got {case.window}")
        if case.causal and right not in (0, -1):
            raise BadInput("a causal mask already fixes the right window to 0; use --window LEFT,0 or --mask none")
        if case.causal and right == -1:
            case = dataclasses.replace(case, window=(left, 0))
    if not isinstance(case.seed, int):
        raise BadInput(f"seed must be a whole number, got {case.seed!r}")
    return case


@dataclass(frozen=True)
class Recipe:
    """A TOML file under recipes/: one base case, optionally a grid of values for `sweep`."""

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


def load_recipe(name_or_path: str) -> Recipe:
    path = find_recipe(name_or_path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise BadInput(f"recipe {path} is not valid TOML ({exc}); fix the file or pick another recipe") from None
    case = data.get("case", {})
    grid = data.get("grid", {})
    if not isinstance(case, dict) or not isinstance(grid, dict):
        raise BadInput(f"recipe {path}: [case] and [grid] must be tables")
    known = {f.name for f in dataclasses.fields(Case)}
    unknown = sorted(set(case) - known)
    if unknown:
        raise BadInput(f"recipe {path}: unknown case field(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for key, values in grid.items():
        if not isinstance(values, list) or not values:
            raise BadInput(f"recipe {path}: grid.{key} must be a non-empty list")
    if "window" in case and case["window"] is not None:
        case = {**case, "window": tuple(case["window"])}
    make_case(**case)  # validate now, so a broken recipe fails before any work starts
    return Recipe(path.stem, path, str(data.get("description", "")), case, grid)
