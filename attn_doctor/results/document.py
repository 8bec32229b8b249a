"""The results document: rows (backend x layout x case), the faulty paths, the environment.

Plain dataclasses with a JSON form that `report` and `bisect --from` read back. The JSON file is written
atomically (temp file, then rename), so an interrupted write never leaves half a document.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import shlex
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_doctor.core.case import Case
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.core.errors import BadInput
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.verdict.rule import TensorVerdict

FORMAT = "attn-doctor/results"
FORMAT_VERSION = 1


@dataclass
class Row:
    backend: str
    family: str
    layout: str
    case: Case
    verdict: str  # PASS / FAIL / SKIP / ERROR
    ran: str = ""
    reason: str = ""
    detail: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    tensors: dict[str, TensorVerdict] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)  # the backend spec's options (e.g. a kernel's target)
    coords: dict[str, Any] = field(default_factory=dict)  # probe coordinates beyond the case (layers, tp)
    extra: dict[str, Any] = field(default_factory=dict)  # probe-specific facts (per-layer errors, distances)

    def coords_text(self) -> str:
        """The probe's coordinates beyond its case and layout, as " tp=2 layers=24" (empty for a plain call)."""
        return "".join(f" {k}={v}" for k, v in self.coords.items() if k != "probe")

    def repro_command(self) -> str:
        """The attn-doctor command that re-runs exactly this row."""
        if self.family == "kernel":
            spec = f"{self.backend}={self.options.get('target')}:{self.options.get('func')}"
            target = f"--kernel {shlex.quote(spec)}"
        else:
            target = f"--backend {shlex.quote(self.backend)}"
        probe = self.coords.get("probe")
        if probe == "depth":
            return (f"attn-doctor sweep {target} {self.case.cli_flags()} --layers {self.coords['layers']}"
                    f" --tp {self.coords.get('tp', 1)}")
        if probe == "tp":
            return f"attn-doctor sweep {target} {self.case.cli_flags()} --tp {self.coords['tp']}"
        if probe == "distributed":
            comm = f" --cp-comm-type {self.coords['cp_comm_type']}" if self.coords.get("cp_comm_type") else ""
            return (f"attn-doctor run {target} {self.case.cli_flags()} --nproc {self.coords['nproc']}"
                    f" --tp {self.coords['tp']} --cp {self.coords['cp']}{comm}")
        return f"attn-doctor run {target} --layout {self.layout} {self.case.cli_flags()}"

    @property
    def failing_tensors(self) -> list[str]:
        return [name for name, t in self.tensors.items() if t.verdict == "FAIL"]

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "family": self.family,
            "layout": self.layout,
            "ran": self.ran,
            "verdict": self.verdict,
            "reason": self.reason,
            "detail": self.detail,
            "case": self.case.to_dict(),
            "options": self.options,
            "coords": self.coords,
            "extra": self.extra,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "seconds": self.seconds,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Row":
        tensors = {name: _tensor_verdict(name, t) for name, t in d.get("tensors", {}).items()}
        coords = d.get("coords", {})
        if coords.get("probe") == "depth" and not isinstance(coords.get("layers"), int):
            raise ValueError("a depth row has no whole-number coords.layers")
        return cls(
            backend=d["backend"],
            family=d.get("family", ""),
            layout=d["layout"],
            case=Case.from_dict(d["case"]),
            verdict=d["verdict"],
            ran=d.get("ran", ""),
            reason=d.get("reason", ""),
            detail=d.get("detail", ""),
            tensors=tensors,
            seconds=d.get("seconds", {}),
            options=d.get("options", {}),
            coords=coords,
            extra=d.get("extra", {}),
        )


def _tensor_verdict(name: str, d: dict[str, Any]) -> TensorVerdict:
    verdict = TensorVerdict(**d)
    for key, value in vars(verdict).items():
        if key not in ("verdict", "why") and (not isinstance(value, numbers.Real) or isinstance(value, bool)):
            raise ValueError(f"tensor {name}: {key} is {value!r}, not a number")
    return verdict


@dataclass(frozen=True)
class Faulty:
    """One kernel path that computes something wrong, with where and what."""

    backend: str
    ran: str
    verdict: str  # FAIL or ERROR
    layouts: tuple[str, ...]
    tensors: tuple[str, ...]
    cases: tuple[str, ...]
    worst_ratio: float
    nonfinite: tuple[str, ...] = ()  # failing tensors that hold NaN or Inf

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "ran": self.ran,
            "verdict": self.verdict,
            "layouts": list(self.layouts),
            "tensors": list(self.tensors),
            "cases": list(self.cases),
            "worst_ratio": self.worst_ratio,
            "nonfinite": list(self.nonfinite),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Faulty":
        return cls(d["backend"], d.get("ran", ""), d.get("verdict", "FAIL"), tuple(d.get("layouts", ())),
                   tuple(d.get("tensors", ())), tuple(d.get("cases", ())), float(d.get("worst_ratio", math.nan)),
                   tuple(d.get("nonfinite", ())))


@dataclass
class RunReport:
    command: str
    device: str
    env: EnvReport | None
    rows: list[Row]
    faulty: list[Faulty]
    summary: str
    tool_version: str = ""
    created: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)  # files beside the document, e.g. {"plot": "depth.png"}

    @property
    def exit_code(self) -> int:
        return 1 if any(row.verdict in ("FAIL", "ERROR") for row in self.rows) else 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "tool_version": self.tool_version,
            "created": self.created,
            "command": self.command,
            "device": self.device,
            "env": self.env.to_dict() if self.env is not None else None,
            "summary": self.summary,
            "faulty": [f.to_dict() for f in self.faulty],
            "results": [row.to_dict() for row in self.rows],
            "seconds": self.seconds,
            "artifacts": self.artifacts,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "results") -> "RunReport":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise BadInput(f"{source} is not an attn-doctor results document (no \"format\": \"{FORMAT}\")")
        try:
            return cls(
                command=d.get("command", ""),
                device=d.get("device", ""),
                env=EnvReport.from_dict(d["env"]) if d.get("env") else None,
                rows=[Row.from_dict(r) for r in d["results"]],
                faulty=[Faulty.from_dict(f) for f in d.get("faulty", [])],
                summary=d.get("summary", ""),
                tool_version=d.get("tool_version", ""),
                created=d.get("created", ""),
                seconds=d.get("seconds", {}),
                artifacts=d.get("artifacts", {}),
            )
        except (KeyError, TypeError, ValueError, BadInput) as exc:
            raise BadInput(f"{source} is damaged ({type(exc).__name__}: {exc}); re-run attn-doctor to regenerate it") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, default=_json_default, allow_nan=True) + "\n"


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    write_atomic_bytes(path, text.encode())


def write_atomic_bytes(path: Path, data: bytes) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_report(path: Path) -> RunReport:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise BadInput(f"no results file {path}; run `attn-doctor run --json {path}` first") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise BadInput(f"cannot read {path}: {exc}") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as exc:
        raise BadInput(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); it may be truncated") from None
    return RunReport.from_dict(document, source=str(path))
