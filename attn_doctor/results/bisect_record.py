"""A bisect's document, read back for `report`: where the bisect started, the minimal failing case, the
necessary conditions (the knobs whose simplification made the failure go away), the probes, the diagnosis,
the standalone repro script beside it, and the judged rows.

`attn-doctor bisect` writes the document into its folder (bisect_<backend>_<id>.json, beside the repro) and
to --json. Documents written before it recorded its rows and machine (no "format", e.g. the committed
reports/h200/api/bisect-*/bisect.json) are read too: their rows are rebuilt from the start's and the minimal
case's probe notes — each failing tensor's error and yardstick, in the words of `attn_doctor.verdict.rule`
(a note was cut at 200 characters; a clause cut short is left out) — and their machine and command from the
repro script's header.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from attn_doctor.core import schemas
from attn_doctor.core.case import Case
from attn_doctor.core.coords import BackendSpec, Coords, coords_at, knob_dict
from attn_doctor.core.errors import BadInput
from attn_doctor.machine.cudnn_builds import builds_sentence, version_order
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.results.files import inside
from attn_doctor.results.report import RunReport
from attn_doctor.results.row import Row
from attn_doctor.verdict.rule import (
    BASELINE_YARDSTICK,
    FAIL,
    NOISE_YARDSTICK,
    TensorVerdict,
)

BISECT_FORMAT = "attn-doctor/bisect"
BISECT_FORMAT_VERSION = 2  # 2: conditions may carry a relation; "changes" lists knobs that changed the failure
BISECT_KEYS = ("start_case", "minimal_case", "necessary", "probes")  # what every bisect document has
REPRO_NAME = re.compile(r"repro_[\w.-]+\.py")  # `attn_doctor.bisect.repro.repro_name`
NOTE_CHARS = 200  # a probe's note is cut at this many characters
REGENERATE = "re-run the bisect to regenerate it"
ON_MINIMAL = " on the minimal case"  # a step's `tried` ends so when it was tried again after the others moved


@dataclass(frozen=True)
class Step:
    """One probe of a bisect: the knob moved, the value tried, the probe's coordinates, and how it came out."""

    knob: str
    tried: str
    config: str
    verdict: str
    fails: bool
    note: str = ""


@dataclass(frozen=True)
class Condition:
    """A necessary condition: the knob fails at one value and passes at the plainer one. A `relation` ("seq >
    seq_kv") is a boundary that moves with another length: the values then name both lengths."""

    knob: str
    failing_value: object
    passing_value: object
    relation: str = ""

    def sentence(self) -> str:
        if self.relation:
            return self.clause()
        return f"fails at {self.knob} {self.failing_value}, passes at {self.passing_value}"

    def clause(self) -> str:
        """The sentence after "knob: " (a list of conditions names each knob first)."""
        if self.relation:
            return f"fails when {self.relation} ({self.failing_value}), passes at {self.passing_value}"
        return f"fails at {self.failing_value}, passes at {self.passing_value}"

    def to_dict(self) -> dict[str, Any]:
        d = {"knob": self.knob, "failing_value": self.failing_value, "passing_value": self.passing_value}
        return {**d, "relation": self.relation} if self.relation else d


@dataclass(frozen=True)
class Change:
    """A simplification that neither kept the failure nor made it go away: the case failed differently (what
    changed), crashed or could not run there; or a condition whose confirming rerun disagreed. Never a
    necessary condition: it says only that the knob changes what happens."""

    knob: str
    tried: str
    what: str

    def sentence(self) -> str:
        return f"{self.knob} {self.tried}: {self.what}"


@dataclass
class BisectRecord:
    path: Path  # the document
    start: Coords
    minimal: Coords
    necessary: list[Condition]
    probes: list[Step]
    diagnosis: dict[str, Any]
    repro_name: str  # the repro script's file name
    repro: str | None  # its text, when it lies beside the document
    rows: list[Row]
    env: EnvReport | None
    command: str = ""
    tool_version: str = ""
    created: str = ""
    rebuilt: bool = False  # an older document: the rows were rebuilt from the probes' notes
    changes: list[Change] = field(default_factory=list)  # knobs that changed the failure (not conditions)

    def cudnn_builds(self) -> tuple[list[str], list[str]]:
        """(failing, passing): the cuDNN builds the bisect saw the failure on and those it passed on (bisect's
        cudnn knob), oldest first; ([], []) when it tried no other build."""
        start = self.start.backend.options.get("cudnn")
        machine = self.env.te_cudnn.value if self.env is not None else None
        return self._alternatives("cudnn", (start.get("version") or start.get("directory")) if start else None,
                                  machine)

    def te_releases(self) -> tuple[list[str], list[str]]:
        """(failing, passing): the TE releases the bisect saw the failure on and those it passed on (bisect's te
        knob), oldest first; ([], []) when it tried no other release."""
        start = self.start.backend.options.get("te")
        return self._alternatives("te", start.get("version") if start else None,
                                  self.env.te.value if self.env is not None else None)

    def _alternatives(self, knob: str, start: str | None, machine: str | None) -> tuple[list[str], list[str]]:
        """(failing, passing) of an alternatives knob: the start's value (the one asked for, else the machine's
        `machine` fact) failing, and each value the knob tried as it went, oldest first."""
        tried = [step for step in self.probes if step.knob == knob and step.verdict in ("PASS", "FAIL", "ERROR")]
        if not tried:
            return [], []
        first = start if start is not None else machine.split()[0] if machine else None
        failing = {first} if first else set()
        passing: set[str] = set()
        for step in tried:
            (failing if step.fails else passing if step.verdict == "PASS" else set()).add(
                step.tried.removesuffix(ON_MINIMAL))
        return sorted(failing - passing, key=version_order), sorted(passing - failing, key=version_order)

    def te_sentence(self) -> str:
        """"fails with TE 2.18.0, passes with 2.20.2: fixed by 2.20.2", "reproduced with TE 2.18.0 and 2.20.2",
        or "" when the bisect tried no other TE release."""
        return builds_sentence(*self.te_releases(), library="TE")

    def cudnn_sentence(self) -> str:
        """"fails with cuDNN 9.14.0, passes with 9.19.0: fixed by 9.19.0", "reproduced with cuDNN 9.14.0 and
        9.19.0", or "" when the bisect tried no other cuDNN build."""
        return builds_sentence(*self.cudnn_builds())

    @property
    def tested(self) -> str:
        """The kernel path that was bisected."""
        return self.start.backend.name

    def row_at(self, coords: Coords) -> Row | None:
        """The tested path's row at these coordinates (the start or the minimal case)."""
        return next((row for row in self.rows if row.backend == self.tested and _same_probe(row.coords, coords)),
                    None)

    @property
    def minimal_row(self) -> Row | None:
        return self.row_at(self.minimal)

    @property
    def start_row(self) -> Row | None:
        return self.row_at(self.start)

    def started_from(self, row: Row) -> bool:
        """Whether this bisect started from `row` (as `bisect --from` takes a results row)."""
        return row.backend == self.tested and _same_probe(
            coords_at(row.case, row.layout, row.coords.tp, row.coords.layers, row.coords.backend), self.start)

    def report(self) -> RunReport:
        """The bisect as a results document: its rows, its machine, its command."""
        return RunReport(command=self.command, device="", env=self.env, rows=list(self.rows),
                         tool_version=self.tool_version, created=self.created)


def _same_probe(a: Coords, b: Coords) -> bool:
    return knob_dict(a) == knob_dict(b)


def is_bisect_document(document: Any) -> bool:
    return isinstance(document, dict) and (document.get("format") == BISECT_FORMAT or (
        "format" not in document and all(key in document for key in BISECT_KEYS)))


def read_bisect(document: dict[str, Any], path: Path) -> BisectRecord:
    """The bisect document `document`, read from `path` (its repro is looked for beside it); BadInput naming
    the file when it is damaged."""
    path = Path(path)
    schemas.check(document, schemas.BISECT, str(path), REGENERATE)
    try:
        spec = _backend_spec(document)
        start, minimal = _coords(document["start_case"], spec), _coords(document["minimal_case"], spec)
        necessary = [Condition(str(c["knob"]), c["failing_value"], c["passing_value"], str(c.get("relation", "")))
                     for c in document["necessary"]]
        changes = [Change(str(c["knob"]), str(c["tried"]), str(c["what"])) for c in document.get("changes") or []]
        probes = [Step(str(p["knob"]), str(p["tried"]), str(p["config"]), str(p["verdict"]), bool(p["fails"]),
                      str(p.get("note", ""))) for p in document["probes"]]
        diagnosis = dict(document.get("diagnosis") or {})
        recorded_repro = str(document.get("repro") or "")
        rows = [Row.from_dict(r) for r in document.get("results") or []]
        env = EnvReport.from_dict(document["env"]) if document.get("env") else None
    except (KeyError, TypeError, ValueError, AttributeError, BadInput) as exc:
        raise BadInput(f"{path} is a damaged bisect document ({type(exc).__name__}: {exc}); {REGENERATE}") from None
    repro_name = Path(recorded_repro).name
    repro = _read_repro(path.parent, recorded_repro)
    record = BisectRecord(path, start, minimal, necessary, probes, diagnosis, repro_name, repro, rows, env,
                          command=str(document.get("command", "")), tool_version=str(document.get("tool_version", "")),
                          created=str(document.get("created", "")), changes=changes)
    if "results" not in document:
        _rebuild(record)
    return record


def _backend_spec(document: dict[str, Any]) -> BackendSpec:
    """The bisected path: recorded whole, or (older documents) by its name among the built-in paths."""
    if document.get("backend_spec"):
        return BackendSpec.from_dict(document["backend_spec"])
    from attn_doctor.backends import builtin_specs

    name = str(document.get("backend", ""))
    if not name:
        raise KeyError("backend")
    return next((spec for spec in builtin_specs() if spec.name == name), BackendSpec(name, "kernel"))


def _coords(knobs: dict[str, Any], spec: BackendSpec) -> Coords:
    if knobs.get("te"):  # the probe ran on a prepared TE release (bisect's te knob)
        from attn_doctor.backends import on_release
        from attn_doctor.machine.te_installs import TEInstall

        spec = on_release(spec, TEInstall.from_dict(knobs["te"]))
    if knobs.get("cudnn"):  # the probe ran on a cuDNN build of its own (bisect's cudnn knob)
        from attn_doctor.backends import on_build
        from attn_doctor.machine.cudnn_builds import CudnnBuild

        spec = on_build(spec, CudnnBuild.from_dict(knobs["cudnn"]))
    return coords_at(Case.from_dict(knobs["case"]), str(knobs["layout"]), int(knobs["tp"]), int(knobs["layers"]),
                     spec)


def _read_repro(directory: Path, recorded: str) -> str | None:
    """The repro script, beside the document (bisect writes both into its folder). Only a file named as bisect
    names its repros is read: a document from elsewhere must not pull any other file into a report."""
    name = Path(recorded).name
    if not REPRO_NAME.fullmatch(name) or not inside(directory, name):  # nor a symbolic link out of the folder
        return None
    try:
        return (directory / name).read_text()
    except (OSError, UnicodeDecodeError):
        return None


def _probe_at(probes: list[Step], coords: Coords) -> Step | None:
    """The last probe of these coordinates that kept the failure (older documents name the mask by its old
    names)."""
    from attn_doctor.core.case import MASK_ALIASES

    def words(text: str) -> list[str]:
        return [MASK_ALIASES.get(word, word) for word in text.split()]

    described = words(coords.describe())
    return next((step for step in reversed(probes) if step.fails and words(step.config) == described), None)


# --- documents written before bisect recorded rows ----------------------------------------------------------

# The FAIL clauses of `attn_doctor.verdict.rule` (`_error_why` and the NaN/Inf one), and the wording of
# documents older than the errors' yardsticks ("error 1.38 > 3 x baseline 0.0036").
_ERROR_CLAUSE = re.compile(
    r"(?:^|; )(?P<tensor>[a-z_]+): (?P<what>error|worst head's error) (?P<err>\S+) "
    r"\((?P<units>relative|of its terms' scale)\) > (?P<multiple>[0-9.]+) x (?P<yardstick>\S+) \((?P<because>[^)]*)\)")
_OLD_ERROR_CLAUSE = re.compile(
    r"(?:^|; )(?P<tensor>[a-z_]+): (?P<what>error) (?P<err>\S+) > (?P<multiple>[0-9.]+) x baseline (?P<yardstick>[^;\s]+)")
_NONFINITE_CLAUSE = re.compile(r"(?:^|; )(?P<tensor>[a-z_]+): (?P<nan>\d+) NaN and (?P<inf>\d+) Inf where float64 has none")


# A failing tensor's verdict where nothing of its figures is known (each is NaN).
_BLANK = {"rel_err": math.nan, "max_abs_err": math.nan, "cosine": math.nan, "worst_head_rel_err": math.nan, "nan": 0,
          "inf": 0, "baseline_rel_err": math.nan, "baseline_worst_head_rel_err": math.nan, "ratio": math.nan,
          "threshold": math.nan, "err_in_eps": math.nan, "verdict": FAIL}
# `attn_doctor.verdict.diagnosis.first_wrong` of a backward fault: "backward (out is right; dq, dk wrong)".
_DIAGNOSED = re.compile(r"\(out is right; (?P<tensors>[a-z_]+(?:, [a-z_]+)*) wrong\)")


def noted_verdicts(note: str) -> dict[str, TensorVerdict]:
    """The failing tensors' verdicts a probe note states in full (what it does not state is NaN); a clause
    that runs to the end of a note cut at NOTE_CHARS may be cut short, and is left out."""
    nan = math.nan
    verdicts: dict[str, TensorVerdict] = {}
    for pattern in (_ERROR_CLAUSE, _OLD_ERROR_CLAUSE, _NONFINITE_CLAUSE):
        for match in pattern.finditer(note):
            if match.end() == len(note) >= NOTE_CHARS:
                continue
            why = match.group(0).removeprefix("; ").split(": ", 1)[1]
            if pattern is _NONFINITE_CLAUSE:
                verdicts[match["tensor"]] = TensorVerdict(**{**_BLANK, "nan": int(match["nan"]), "inf": int(match["inf"]),
                                                             "ratio": math.inf, "why": why})
                continue
            try:
                err, multiple, yardstick = (float(match[k]) for k in ("err", "multiple", "yardstick"))
            except ValueError:
                continue
            because = match.groupdict().get("because") or "the local baseline's own error"
            kind = NOISE_YARDSTICK if because.startswith("rounding noise") else BASELINE_YARDSTICK
            whole = match["what"] == "error"
            scaled = match.groupdict().get("units") == "of its terms' scale"
            verdicts[match["tensor"]] = TensorVerdict(**{
                **_BLANK, "why": why,
                "rel_err": err if whole and not scaled else nan, "worst_head_rel_err": nan if whole else err,
                "scaled_err": err if whole and scaled else nan, "cancellation": 0.0 if whole and scaled else 1.0,
                "baseline_rel_err": yardstick if kind == BASELINE_YARDSTICK and whole else nan,
                "yardstick": yardstick, "yardstick_kind": kind, "ratio": err / yardstick if yardstick else math.inf,
                "threshold": multiple * yardstick})
    return verdicts


_MADE_BY = re.compile(r"^Made by attn-doctor (?P<version>\S+) \((?P<command>.*)\)\.$", re.MULTILINE)


def _rebuild(record: BisectRecord) -> None:
    """An older document's rows (the start and the minimal case, from their probe notes), its machine and
    its command (from the repro's header)."""
    record.rebuilt = True
    rows: list[Row] = []
    for coords in (record.start, record.minimal):
        step = _probe_at(record.probes, coords)
        if step is not None and not any(_same_probe(row.coords, coords) for row in rows):
            rows.append(Row(coords=coords, verdict=step.verdict, reason=step.note, tensors=noted_verdicts(step.note)))
    record.rows = rows
    minimal = record.minimal_row
    if minimal is not None:  # the diagnosis names every failing tensor of the minimal case, figures or not
        named = _DIAGNOSED.search(str(record.diagnosis.get("first_wrong", "")))
        for name in named["tensors"].split(", ") if named else ():
            minimal.tensors.setdefault(name, TensorVerdict(**{
                **_BLANK, "why": "named by the bisect's diagnosis; its figures were cut from the probe's note"}))
    if record.repro is None:
        return
    made_by = _MADE_BY.search(record.repro)
    if made_by:
        record.tool_version, record.command = made_by["version"], made_by["command"]
    record.env = _header_env(record.repro)


def _header_env(script: str) -> EnvReport | None:
    """The machine a repro script was made on, from its header's "Environment it was made on:" lines."""
    from attn_doctor.machine.env_rows import env_from_rows

    lines = script.split("Environment it was made on:\n", 1)
    if len(lines) < 2:
        return None
    rows = []
    for line in lines[1].splitlines():
        if not line.startswith("  ") or ": " not in line:
            break
        label, value = line.strip().split(": ", 1)
        rows.append((label, value))
    return env_from_rows(rows) if rows else None
