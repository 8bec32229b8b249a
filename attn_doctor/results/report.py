"""The results document of a run, a sweep or a distributed run: its rows, what was asked and the machine.

Like black's `Report`, everything concluded from the rows is derived, never stored and patched: the faulty
paths, the summary sentence, the exit code and the depth findings are properties (`attn_doctor.verdict`
computes them). The JSON form writes them out for other readers; reading a document back derives them again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from attn_doctor.core import schemas
from attn_doctor.core.documents import read_document
from attn_doctor.core.errors import BadInput, first_line
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.results.row import Row
from attn_doctor.verdict import depth as depth_analysis
from attn_doctor.verdict import diagnosis

FORMAT = "attn-doctor/results"
FORMAT_VERSION = 1
REGENERATE = "re-run attn-doctor to regenerate it"


@dataclass
class RunReport:
    command: str
    device: str
    env: EnvReport | None
    rows: list[Row]
    requested: list[str] | None = None  # the backends the user asked for (None: not recorded, all of them)
    tool_version: str = ""
    created: str = ""
    seconds: dict[str, float] = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)  # files beside the document, e.g. {"plot": "depth.png"}
    interrupted: bool = False  # Ctrl-C: the rows are what finished before it
    notes: list[str] = field(default_factory=list)  # what attn-doctor chose for the user, e.g. the CPU sizing
    # What was asked for but could not be judged, and why (a captured call whose values cannot be read): a run
    # that judged everything else still does not exit 0.
    not_judged: list[str] = field(default_factory=list)
    # The memory plan it ran by (`attn_doctor.execution.memory_plan.MemoryPlan.to_dict`: budget, estimate, workers)
    memory: dict[str, Any] = field(default_factory=dict)

    # -- derived (the rows are not changed after a report is made) --

    @cached_property
    def faulty(self) -> list[diagnosis.Faulty]:
        return diagnosis.find_faulty(self.rows)

    @cached_property
    def summary(self) -> str:
        return self._rows_summary() + (f" Not judged: {len(self.not_judged)} captured call"
                                       f"{'s' * (len(self.not_judged) > 1)} ({self.not_judged[0]})."
                                       if self.not_judged else "")

    def _rows_summary(self) -> str:
        if not self.interrupted:
            return diagnosis.summarize(self.rows, self.requested)
        if self.untested is not None:
            return "Interrupted (Ctrl-C or SIGTERM) before any requested probe finished."
        return (f"Interrupted (Ctrl-C or SIGTERM) before every probe ran; of the {len(self.rows)} that finished: "
                f"{diagnosis.summarize(self.rows, self.requested)}")

    @property
    def exit_code(self) -> int:
        """The rows' exit code (`diagnosis.exit_code`); 1 instead of 0 while something asked for was not judged."""
        code = diagnosis.exit_code(self.rows, self.requested)
        return 1 if code == 0 and self.not_judged else code

    @property
    def untested(self) -> str | None:
        """Why nothing that was asked for was tested (exit code 2), or None."""
        return diagnosis.untested(self.rows, self.requested)

    @property
    def failing_rows(self) -> list[Row]:
        """The rows where a kernel path FAILs or ERRORs (attn-doctor's own errors name no path): what `bisect
        --from` counts with --row."""
        return [row for row in self.rows if row.verdict in ("FAIL", "ERROR") and not row.internal]

    @cached_property
    def depth_lines(self) -> list[depth_analysis.DepthLine]:
        return depth_analysis.depth_lines(self.rows)

    # -- JSON --

    def to_dict(self) -> dict[str, Any]:
        d = {
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
        if self.requested is not None:  # documents written before it was recorded read back unchanged
            d["requested"] = self.requested
        if self.interrupted:
            d["interrupted"] = True
        if self.notes:  # documents without notes read as they always did
            d["notes"] = list(self.notes)
        if self.not_judged:
            d["not_judged"] = list(self.not_judged)
        if self.memory:
            d["memory"] = dict(self.memory)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "results") -> "RunReport":
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise BadInput(f"{source} is not an attn-doctor results document (no \"format\": \"{FORMAT}\")")
        schemas.check(d, schemas.RESULTS, source, REGENERATE)
        try:
            requested = d.get("requested")
            notes = d.get("notes")
            return cls(
                command=d.get("command", ""),
                device=d.get("device", ""),
                env=EnvReport.from_dict(d["env"]) if d.get("env") else None,
                rows=[_row(index, r) for index, r in enumerate(d["results"])],
                requested=[str(name) for name in requested] if isinstance(requested, list) else None,
                tool_version=d.get("tool_version", ""),
                created=d.get("created", ""),
                seconds=d.get("seconds", {}),
                artifacts=d.get("artifacts", {}),
                interrupted=bool(d.get("interrupted", False)),
                notes=[str(note) for note in notes] if isinstance(notes, list) else [],
                not_judged=list(d.get("not_judged", [])),
                memory=dict(d.get("memory") or {}),
            )
        except (KeyError, TypeError, ValueError, AttributeError, BadInput) as exc:
            raise BadInput(f"{source} is damaged ({type(exc).__name__}: {exc}); {REGENERATE}") from None


def _row(index: int, d: dict[str, Any]) -> Row:
    try:
        return Row.from_dict(d)
    except (KeyError, TypeError, ValueError, AttributeError, BadInput) as exc:
        raise ValueError(f"results[{index}]: {exc if type(exc) is ValueError else first_line(exc)}") from None


def _json_default(value: Any) -> Any:
    if isinstance(value, tuple):
        return list(value)
    raise TypeError(f"cannot serialise {type(value).__name__}")


def dumps(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=2, default=_json_default, allow_nan=True) + "\n"


def read_report(path: Path) -> RunReport:
    return RunReport.from_dict(read_json(path), source=str(path))


def read_json(path: Path) -> Any:
    """A JSON file attn-doctor wrote (BadInput naming the file when it is missing or not JSON)."""
    path = Path(path)

    def unreadable(exc: OSError | UnicodeDecodeError) -> BadInput:
        if isinstance(exc, FileNotFoundError):
            return BadInput(f"no results file {path}: it does not exist; check the path (a results.json that run, sweep "
                            "or replay wrote, their folder, or a bisect document)")
        return BadInput(f"cannot read {path}: {exc}")

    def malformed(exc: json.JSONDecodeError) -> BadInput:
        return BadInput(f"{path} is not valid JSON ({exc.msg} at line {exc.lineno}); it may be truncated")

    return read_document(path, json.loads, json.JSONDecodeError, unreadable, malformed)
