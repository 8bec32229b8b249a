"""The attention problem to check: shapes, dtype, mask, seed and input distribution, validated; and grids of
them."""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

from attn_doctor.core.errors import BadInput

DTYPES = ("bf16", "fp16", "fp32")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
MASKS = ("causal", "none")
# The distributions of q, k, v (`attn_doctor.numerics.inputs` says what each is and why), plainest first.
INPUTS = ("normal", "uniform", "outliers", "large-logits", "structured")


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
    # The distribution q, k, v are drawn from (one of INPUTS). Shown, written and keyed only when it is not
    # "normal", so every case, document and point id of the plain distribution reads as it always did.
    inputs: str = "normal"

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
    def score_elements(self) -> int:
        """How many (query, key) scores one attention call has: what a path that materialises them holds."""
        return self.batch * self.heads * self.seq * self.seq_k

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
        if self.inputs == "normal":  # absent means normal: documents written before --inputs read the same
            del d["inputs"]
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
        if self.inputs != "normal":
            parts.append(self.inputs)
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
        if self.inputs != "normal":
            flags.append(f"--inputs {self.inputs}")
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
    if case.inputs not in INPUTS:
        raise BadInput(f"unknown inputs {case.inputs!r}; choose one of {', '.join(INPUTS)}")
    return case


GRID_FIELDS = ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "dtype", "mask", "window", "seed",
               "inputs")


def expand_grid(base: dict[str, Any], grid: dict[str, list[Any]]) -> list[Case]:
    """The cross product of every gridded case field over the base fields, each validated, duplicates dropped."""
    unknown = sorted(set(grid) - set(GRID_FIELDS))
    if unknown:
        raise BadInput(f"cannot sweep over {', '.join(unknown)}; case fields are {', '.join(GRID_FIELDS)}")
    names = [n for n in GRID_FIELDS if n in grid]
    cases, seen = [], set()
    for values in itertools.product(*(grid[n] for n in names)):
        case = make_case(**{**base, **dict(zip(names, values))})
        if case.key() not in seen:
            seen.add(case.key())
            cases.append(case)
    return cases
