"""Reading any results `report` takes (`load_source`), and a sweep's folder: `results.jsonl` (rows streamed
point by point, each point flushed to disk as it finishes), `sweep.json` (the sweep's header, written before
the first point: command, device, requested backends, a first fingerprint) and, once the sweep is over,
`results.json`.

An interrupted sweep loses at most the points in flight; `--resume` skips the points already there, and
`report` reads the folder as it is (`load_source`), so an interrupted sweep reports exactly what a
finished one reports for the rows it has.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attn_doctor.core import schemas
from attn_doctor.core.errors import BadInput, first_line
from attn_doctor.results.bisect_record import (
    BisectRecord,
    is_bisect_document,
    read_bisect,
)
from attn_doctor.results.files import write_atomic, write_atomic_bytes
from attn_doctor.results.report import RunReport, dumps, read_json
from attn_doctor.results.row import Row

RESULTS_FILE = "results.jsonl"
HEADER_FILE = "sweep.json"
DOCUMENT_FILE = "results.json"


@dataclass
class Record:
    """One line of results.jsonl: a row of a point, the last of the point's lines marked complete."""

    line: bytes  # as written, without its newline
    point: str
    complete: bool
    row: Row


def read_records(path: Path, hint: str, skip_blank: bool = False) -> tuple[list[Record], bool]:
    """Every whole line of a results.jsonl, and whether the last line was torn (cut off mid-write: the sweep
    was killed while writing it). A line that is not a sweep record is bad input naming the file, the line
    and `hint` (what to do about it)."""
    lines = path.read_bytes().split(b"\n")
    torn = lines.pop() != b""  # b"" when the file ends with a newline
    records = []
    for number, line in enumerate(lines, start=1):
        if skip_blank and not line.strip():
            continue
        try:
            record = json.loads(line.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadInput(f"{path}:{number} is not JSON ({type(exc).__name__}); {hint}") from None
        schemas.check(record, schemas.SWEEP_RECORD, f"{path}:{number}", hint)
        try:
            records.append(Record(line, record["point"], bool(record.get("point_complete")), Row.from_dict(record)))
        except (KeyError, TypeError, ValueError, AttributeError, BadInput) as exc:
            raise BadInput(f"{path}:{number} is not an attn-doctor sweep record ({first_line(exc)}); {hint}") from None
    return records, torn


class ResultsLog:
    """results.jsonl: rows appended point by point, each line flushed to disk before the next point runs."""

    def __init__(self, directory: Path):
        self.directory = Path(directory)
        self.path = self.directory / RESULTS_FILE
        self.header_path = self.directory / HEADER_FILE

    def load(self) -> tuple[list[Row], set[str]]:
        """Rows and finished point ids already there. Lines of a point that never finished (the sweep was
        killed while writing it, possibly mid-line) are dropped from the file, so its rerun is the only copy."""
        if not self.path.exists():
            return [], set()
        records, torn = read_records(self.path, "move the file away to start over")
        by_point: dict[str, list[Record]] = {}
        for record in records:
            by_point.setdefault(record.point, []).append(record)
        complete = [record.point for record in records if record.complete]
        if set(by_point) - set(complete) or torn:
            kept = b"".join(record.line + b"\n" for point in complete for record in by_point[point])
            write_atomic_bytes(self.path, kept)
        rows = [record.row for point in complete for record in by_point[point]]
        return rows, set(complete)

    def write_header(self, report: RunReport) -> None:
        """What a finished sweep's document holds besides its rows and what they conclude (command, device,
        requested backends, fingerprint): `report` shows it with the rows of an interrupted sweep."""
        if not self.header_path.exists():
            header = {k: v for k, v in report.to_dict().items() if k not in ("summary", "faulty", "results")}
            write_atomic(self.header_path, dumps(header))

    def append(self, point_id: str, rows: list[Row]) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        lines = []
        for index, row in enumerate(rows):
            record = {"point": point_id, **row.to_dict()}
            if index == len(rows) - 1:
                record["point_complete"] = True
            lines.append(json.dumps(record, allow_nan=True))
        with open(self.path, "a") as handle:
            handle.write("\n".join(lines) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


def read_header(directory: Path) -> dict[str, Any]:
    """A sweep folder's sweep.json ({} when it has none or it cannot be read)."""
    path = directory / HEADER_FILE
    try:
        header = json.loads(path.read_text())
        return header if isinstance(header, dict) else {}
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return {}


def _from_jsonl(path: Path) -> RunReport:
    records, _torn = read_records(path, "the file may be truncated or foreign", skip_blank=True)
    rows = [record.row for record in records]  # unfinished points too: this is what the sweep got to
    if not rows:
        raise BadInput(f"{path} holds no results yet")
    header = read_header(path.parent)
    if header:
        report = RunReport.from_dict({**header, "results": []}, source=str(path.parent / HEADER_FILE))
        return dataclasses.replace(report, rows=rows)
    return RunReport(command=f"(interrupted sweep, read from {path.name})", device="", env=None, rows=rows)


BISECT_GLOB = "bisect*.json"  # bisect documents in a folder: bisect_<backend>_<id>.json (older: bisect.json)


@dataclass
class Loaded:
    """What `report` renders: the results document, the folder it lives in (its plot is beside it), the
    file read, and the bisects of its failing rows (the bisect itself, when a bisect document was given)."""

    report: RunReport
    directory: Path
    source: Path
    bisects: list[BisectRecord] = dataclasses.field(default_factory=list)


def load_source(path: Path) -> Loaded:
    """A run's results.json, a sweep folder (its results.json, or the results.jsonl of an interrupted sweep
    with its header), or a bisect's folder or document; with the bisect documents beside a results document
    that started from one of its failing rows."""
    loaded = _load(path)
    if not loaded.bisects:  # results, not a bisect: the bisects that started from them
        loaded.bisects = bisects_beside(loaded.directory, loaded.report)
    return loaded


def _load(path: Path) -> Loaded:
    """The document at `path` (see `load_source`), a bisect document as its only bisect; no other file read."""
    path = Path(path)
    if path.is_dir():
        bisects = sorted(path.glob(BISECT_GLOB))
        if (path / DOCUMENT_FILE).is_file():
            path = path / DOCUMENT_FILE
        elif (path / RESULTS_FILE).is_file():
            path = path / RESULTS_FILE
        elif len(bisects) == 1:
            path = bisects[0]
        elif bisects:
            raise BadInput(f"{path} holds {len(bisects)} bisect documents ({', '.join(b.name for b in bisects)}); "
                           "pass one of them")
        else:
            raise BadInput(f"{path} holds no results.json or results.jsonl (nor a bisect document); pass a results "
                           "file, a sweep directory or a bisect folder")
    if path.suffix == ".jsonl":
        report = _from_jsonl(path)
    else:
        document = read_json(path)
        if is_bisect_document(document):
            bisect = read_bisect(document, path)
            return Loaded(bisect.report(), path.parent, path, [bisect])
        report = RunReport.from_dict(document, source=str(path))
    return Loaded(report, path.parent, path)


def bisects_beside(directory: Path, report: RunReport) -> list[BisectRecord]:
    """The readable bisect documents in `directory` that started from a failing row of `report` (`bisect
    --from` writes its document beside the results it started from)."""
    found = []
    for path in sorted(directory.glob(BISECT_GLOB)):
        try:
            document = read_json(path)
            bisect = read_bisect(document, path) if is_bisect_document(document) else None
        except BadInput:  # a damaged bisect beside the results does not stop their report
            continue
        if bisect is not None and any(bisect.started_from(row) for row in report.failing_rows):
            found.append(bisect)
    return found


def load_results(path: Path) -> tuple[RunReport, Path]:
    """The results document at `path` (see `load_source`) and the folder it lives in, without reading the
    bisect documents beside it."""
    loaded = _load(path)
    return loaded.report, loaded.directory
