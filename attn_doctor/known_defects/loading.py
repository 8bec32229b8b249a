"""Reading the known-defect file: TOML into `KnownBug`s, every field and condition validated (conditions by
the condition table), with a ValueError naming the rule and what is wrong."""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from attn_doctor.core.documents import read_document
from attn_doctor.known_defects.conditions import (
    CONDITION_BY_KEY,
    CONDITION_KEYS,
    CONDITIONS,
    MACHINE_LEVEL_KEYS,
    Check,
    Condition,
    Kind,
)
from attn_doctor.known_defects.facts import parse_version

SYMPTOMS = ("wrong gradient", "wrong output", "NaN", "illegal memory access", "backend disabled",
            "nondeterministic", "mask leak")
COMPONENTS = ("cuDNN", "TE", "flash-attn", "PyTorch", "Megatron-LM")
FOUND_BY = ("attn-doctor",)

_BUG_FIELDS = ("id", "title", "symptom", "component", "reference", "source", "see_also", "fixed_in",
               "workaround", "note", "found_by", "when")


@dataclass(frozen=True)
class KnownBug:
    """One known defect, as read from the data file."""

    id: str
    title: str
    symptom: str | None
    component: str | None
    reference: str
    fixed_in: str | None = None
    note: str | None = None
    when: dict = field(default_factory=dict, hash=False)
    source: str | None = None
    see_also: tuple[str, ...] = ()
    workaround: str | None = None
    found_by: str | None = None

    @property
    def scope(self) -> str:
        """"environment" when every condition (but the affected path) is about the machine or the run;
        else "case"."""
        return "environment" if set(self.when) <= MACHINE_LEVEL_KEYS else "case"

    @property
    def label(self) -> str:
        """How lines name it: "TE#1195", "pytorch/pytorch#196678", "attn-doctor's finding", ..."""
        if self.found_by == "attn-doctor":
            return "attn-doctor's finding"
        m = re.match(r"https://github\.com/([^/]+)/([^/]+)/(?:issues|pull)/(\d+)", self.reference)
        if m:
            owner, repo, number = m.groups()
            return f"TE#{number}" if (owner, repo) == ("NVIDIA", "TransformerEngine") else f"{owner}/{repo}#{number}"
        m = re.match(r"https://github\.com/NVIDIA/TransformerEngine/blob/[^/]+/.*?([^/]+)$", self.reference)
        if m:
            return f"TE's {m.group(1)}"  # a rule TE encodes in its source, e.g. "TE's fused_attn.cpp#L451-L463"
        return self.id

    @functools.cached_property
    def conditions(self) -> tuple[tuple[Condition, Any], ...]:
        """The conditions to check, with their values, in the condition table's order (the order evidence
        names them); of keys read together (one check for cudnn and cudnn_in, ...), the first alone."""
        checks: set[Check] = set()
        chosen: list[tuple[Condition, Any]] = []
        for condition in CONDITIONS:
            if condition.key in self.when and condition.check not in checks:
                checks.add(condition.check)
                chosen.append((condition, self.when[condition.key]))
        return tuple(chosen)


def known_bugs_path() -> Path:
    """The shipped data file."""
    return Path(str(resources.files("attn_doctor").joinpath("data", "known_bugs.toml")))


def load_known_bugs(path: str | Path | None = None) -> list[KnownBug]:
    """Read and validate the data file (default: the shipped one). Raises ValueError naming the bug."""
    path = Path(path) if path is not None else known_bugs_path()
    data = read_document(
        path, tomllib.loads, tomllib.TOMLDecodeError,
        unreadable=lambda exc: ValueError(f"known-bugs file {path} cannot be read: {exc}"),
        malformed=lambda exc: ValueError(f"known-bugs file {path} is not valid TOML: {exc}"),
    )
    return parse_known_bugs(data, origin=str(path))


def parse_known_bugs(data: Mapping[str, Any], origin: str = "known bugs") -> list[KnownBug]:
    """Validate an already-parsed document ``{"bug": [...]}``."""
    extra = sorted(set(data) - {"bug"})
    if extra:
        raise ValueError(f"{origin}: unknown top-level key(s) {', '.join(extra)}; expected [[bug]] tables only")
    rows = data.get("bug", [])
    if not isinstance(rows, list):
        raise ValueError(f"{origin}: 'bug' must be an array of tables ([[bug]])")  # noqa: TRY004 - the loader's one error type
    bugs: list[KnownBug] = []
    seen: set[str] = set()
    for i, row in enumerate(rows, 1):
        bug = _parse_bug(row, f"{origin}: bug #{i}")
        if bug.id in seen:
            raise ValueError(f"{origin}: bug {bug.id!r}: duplicate id")
        seen.add(bug.id)
        bugs.append(bug)
    return bugs


def _parse_bug(row: Any, where: str) -> KnownBug:
    if not isinstance(row, Mapping):
        raise ValueError(f"{where}: must be a table")  # noqa: TRY004 - the loader's one error type
    bug_id = row.get("id")
    if not isinstance(bug_id, str) or not bug_id.strip():
        title = row.get("title")
        raise ValueError(f"{where}{f' ({title!r})' if title else ''}: missing id")
    where = f"{where.rsplit(': bug #', 1)[0]}: bug {bug_id!r}"
    unknown = sorted(set(row) - set(_BUG_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(_BUG_FIELDS)}")
    for name in ("title", "reference"):
        value = row.get(name)
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{where}: missing {name}")
    for name in ("symptom", "component", "fixed_in", "workaround", "note", "source", "found_by"):
        if name in row and not isinstance(row[name], str):
            raise ValueError(f"{where}: {name} must be a string")
    for name, allowed in (("symptom", SYMPTOMS), ("component", COMPONENTS), ("found_by", FOUND_BY)):
        if name in row and row[name] not in allowed:
            raise ValueError(f"{where}: {name} {row[name]!r} is not one of {', '.join(allowed)}")
    _check_reference(row["reference"], row.get("found_by"), where)
    see_also = row.get("see_also", [])
    if not isinstance(see_also, list) or not all(isinstance(u, str) for u in see_also):
        raise ValueError(f"{where}: see_also must be a list of URLs")
    when = row.get("when")
    if not isinstance(when, Mapping) or not when:
        raise ValueError(f"{where}: needs a non-empty [bug.when] table of conditions")
    when = {str(k): _check_condition(str(k), v, where) for k, v in when.items()}
    return KnownBug(
        id=bug_id,
        title=row["title"],
        symptom=row.get("symptom"),
        component=row.get("component"),
        reference=row["reference"],
        fixed_in=row.get("fixed_in"),
        note=row.get("note"),
        when=when,
        source=row.get("source"),
        see_also=tuple(see_also),
        workaround=row.get("workaround"),
        found_by=row.get("found_by"),
    )


def _check_reference(reference: str, found_by: str | None, where: str) -> None:
    """An upstream reference is an https URL; attn-doctor's own finding may instead name the committed
    report by its path in this repository."""
    if reference.startswith("https://"):
        return
    if found_by is None:
        raise ValueError(f"{where}: reference {reference!r} must be an https URL (or set found_by = \"attn-doctor\" "
                         "for a finding whose reference is a report in this repository)")
    if "://" in reference or reference.startswith("/") or ".." in Path(reference).parts:
        raise ValueError(f"{where}: reference {reference!r} must be an https URL or a relative path in this repository")


# --------------------------------------------------------------------------- conditions, by kind

# A kind's validator: the condition, its value in the file and how errors begin ("<where>: condition <key>")
# -> the value in canonical form, or ValueError.
_Validator = Callable[[Condition, Any, str], Any]


def _check_condition(key: str, value: Any, where: str) -> Any:
    """Validate one condition; returns the value in canonical form."""
    bad = f"{where}: condition {key}"
    condition = CONDITION_BY_KEY.get(key)
    if condition is None:
        raise ValueError(f"{bad} is unknown; known conditions: {', '.join(CONDITION_KEYS)}")
    return _VALIDATORS[condition.kind](condition, value, bad)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _specifier(condition: Condition, value: Any, bad: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{bad} must be a PEP 440 specifier string such as '<=2.17', got {value!r}")
    try:
        SpecifierSet(value)
    except InvalidSpecifier:
        raise ValueError(f"{bad} = {value!r} is not a valid PEP 440 specifier (e.g. '>=9.11', '==90')") from None
    return value


def _versions(condition: Condition, value: Any, bad: str) -> list[str]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{bad} must be a non-empty list of versions")
    for v in value:
        if not isinstance(v, str) or parse_version(v) is None:
            raise ValueError(f"{bad}: {v!r} is not a version such as '9.14.0'")
    return list(value)


def _bool(condition: Condition, value: Any, bad: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{bad} must be true or false, got {value!r}")
    return value


def _whole_number(least: int) -> _Validator:
    def validate(condition: Condition, value: Any, bad: str) -> int:
        if not _is_int(value) or value < least:
            raise ValueError(f"{bad} must be a whole number{f' >= {least}' if least else ''}, got {value!r}")
        return value

    return validate


def _int_list(value: Any, valid: Callable[[int], bool], what: str, bad: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_int(v) and valid(v) for v in value):
        raise ValueError(f"{bad} must be a non-empty list of {what}, got {value!r}")
    return list(value)


def _ints(condition: Condition, value: Any, bad: str) -> list[int]:
    return _int_list(value, lambda v: v > 0, "positive whole numbers such as [89, 120]", bad)


def _sub_backends(condition: Condition, value: Any, bad: str) -> list[int]:
    numbers = ", ".join(map(str, condition.choices))
    return _int_list(value, condition.choices.__contains__, f"FusedAttention sub-backends ({numbers})", bad)


def _names(condition: Condition, value: Any, bad: str) -> list[str]:
    choices = condition.choices
    if not isinstance(value, list) or not value or not all(v in choices for v in value):
        raise ValueError(f"{bad} must be a non-empty list of {', '.join(map(str, choices))}, got {value!r}")
    return list(value)


def _pairs(condition: Condition, value: Any, bad: str) -> list[tuple[int, int]]:
    ok = isinstance(value, list) and all(isinstance(p, list) and len(p) == 2 and all(_is_int(d) for d in p)
                                         for p in value)
    if not ok or not value:
        raise ValueError(f"{bad} must be a non-empty list of [d_qk, d_v] pairs")
    return [tuple(p) for p in value]


def _modulus(condition: Condition, value: Any, bad: str) -> tuple[int, int]:
    ok = isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)
    if not ok or not 0 <= value[1] < value[0]:
        raise ValueError(f"{bad} must be [m, r] with 0 <= r < m (seq_kv % m == r), got {value!r}")
    return value[0], value[1]


_VALIDATORS: dict[Kind, _Validator] = {
    "specifier": _specifier,
    "versions": _versions,
    "bool": _bool,
    "count": _whole_number(0),
    "positive": _whole_number(1),
    "ints": _ints,
    "sub_backends": _sub_backends,
    "names": _names,
    "pairs": _pairs,
    "modulus": _modulus,
}
