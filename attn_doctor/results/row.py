"""One results row: where a probe ran (its coordinates), what ran, what it measured and the verdict."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from attn_doctor.core.case import Case
from attn_doctor.core.coords import BackendSpec, Coords
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.verdict.rule import FAIL, TensorVerdict


@dataclass
class Row:
    coords: Coords
    verdict: str  # PASS / FAIL / SKIP / ERROR ("" until judged)
    ran: str = ""
    reason: str = ""
    detail: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    tensors: dict[str, TensorVerdict] = field(default_factory=dict)
    # The baseline's row only: what a correct flash-style backward's output rounding makes on the case (dQ, dK)
    flash_style: dict[str, TensorMetrics] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # probe-specific facts (per-layer errors, distances)
    internal: bool = False  # an ERROR that is attn-doctor's own failure, not the kernel's

    @property
    def backend(self) -> str:
        return self.coords.backend.name

    @property
    def family(self) -> str:
        return self.coords.backend.family

    @property
    def options(self) -> dict[str, Any]:
        return self.coords.backend.options

    @property
    def layout(self) -> str:
        return self.coords.layout

    @property
    def case(self) -> Case:
        return self.coords.case

    def repro_command(self) -> str:
        """The attn-doctor command that re-runs exactly this row (with its --repeats: a failure on one call
        of several may not show on a single one)."""
        from attn_doctor.backends import selector

        command = self.coords.repro_command(selector(self.coords.backend))
        return f"{command} --repeats {self.repeats['n']}" if self.repeats else command

    @property
    def padding_writes(self) -> dict[str, tuple[int, int]]:
        """Per tensor that wrote non-zero values into padding: (how many, of how many values in padding)."""
        return {name: (t.padding_nonzero, t.padding_values) for name, t in self.tensors.items() if t.padding_nonzero}

    @property
    def failing_tensors(self) -> list[str]:
        return [name for name, t in self.tensors.items() if t.verdict == FAIL]

    @property
    def repeats(self) -> dict[str, Any] | None:
        """A call run more than once (`--repeats`): {"n", "identical", "spread", "worst", "rel_err"} per
        tensor (see `attn_doctor.probes.repeats`); None for a call run once."""
        facts = self.extra.get("repeats")
        if not isinstance(facts, dict) or not all(isinstance(facts.get(k), dict) for k in ("identical", "spread")):
            return None
        n = facts.get("n")
        return facts if isinstance(n, int) and not isinstance(n, bool) and n > 1 else None

    @property
    def differing_tensors(self) -> list[str]:
        """The tensors whose repeats were not all bitwise identical to the first."""
        return [name for name, same in (self.repeats or {}).get("identical", {}).items() if not same]

    def to_dict(self) -> dict[str, Any]:
        d = {
            "backend": self.backend,
            "family": self.family,
            "layout": self.layout,
            "ran": self.ran,
            "verdict": self.verdict,
            "reason": self.reason,
            "detail": self.detail,
            "case": self.case.to_dict(),
            "options": self.options,
            "coords": self.coords.params(),
            "extra": self.extra,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "seconds": self.seconds,
        }
        if self.internal:
            d["internal"] = True
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Row:
        from attn_doctor.backends import REGISTRY

        family, options = d.get("family", ""), d.get("options", {})
        if family not in REGISTRY:
            raise ValueError(f"family {family!r} is no backend family attn-doctor knows ({', '.join(REGISTRY)})")
        missing = [name for name in REGISTRY[family].required_options if not isinstance(options.get(name), str)]
        if missing:
            raise ValueError(f"a {family} row's options have no {' or '.join(missing)}")
        tensors = {name: _tensor_verdict(name, t) for name, t in d.get("tensors", {}).items()}
        spec = BackendSpec(d["backend"], family, dict(options))
        coords = Coords.from_params(Case.from_dict(d["case"]), spec, d["layout"], d.get("coords", {}))
        return cls(
            coords=coords,
            verdict=d["verdict"],
            ran=d.get("ran", ""),
            reason=d.get("reason", ""),
            detail=d.get("detail", ""),
            tensors=tensors,
            seconds=d.get("seconds", {}),
            extra=d.get("extra", {}),
            internal=bool(d.get("internal", False)),
        )


def _tensor_verdict(name: str, d: dict[str, Any]) -> TensorVerdict:
    # Verdicts stored before errors were scaled by the terms: the relative errors were what was judged.
    d = {"scaled_err": d.get("rel_err"), "baseline_scaled_err": d.get("baseline_rel_err"),
         "yardstick": d.get("baseline_rel_err"), **d}
    verdict = TensorVerdict(**d)
    for key, value in vars(verdict).items():
        if key in ("verdict", "why", "yardstick_kind"):
            if not isinstance(value, str):
                raise ValueError(f"tensor {name}: {key} is {value!r}, not text")
        elif key in ("bias_failed", "borderline"):
            if not isinstance(value, bool):
                raise ValueError(f"tensor {name}: {key} is {value!r}, not true or false")
        elif key in ("worst_row_err", "flash_style_err") and value is None:
            continue
        elif not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise ValueError(f"tensor {name}: {key} is {value!r}, not a number")
    return verdict
