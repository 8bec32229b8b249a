"""The shape of every document attn-doctor reads back, and the one check each is read through.

A results file, a sweep's records and header, a bisect document, a capture's header, its call lines and its model
facts are JSON that a user may have edited, merged by hand or cut short: a field of the wrong type (a list where an
object belongs, text where a number belongs) used to surface later as a traceback from whichever renderer touched
it first. `check` reads a document against its schema (JSON Schema, checked by the `jsonschema` library) before
anything else looks at it, and a mismatch is bad input naming the file and the field (exit 2).

The schemas say what the readers rely on and no more: extra fields are allowed (a newer attn-doctor may add
some), and a field an older attn-doctor did not write is optional where its reader has a default. What the
readers check themselves stays with them (a case's own fields: `Case.from_dict`; the fingerprint:
`EnvReport.from_dict`; a tensor verdict's numbers: `results.row`).
"""

from __future__ import annotations

from typing import Any

from attn_doctor.core.errors import BadInput

TEXT = {"type": "string"}
FLAG = {"type": "boolean"}
NUMBER = {"type": "number"}
WHOLE = {"type": "integer"}
COUNT = {"type": "integer", "minimum": 0}
OBJECT = {"type": "object"}
TEXTS = {"type": "array", "items": TEXT}
COUNTS = {"type": "array", "items": COUNT}
MAYBE_TEXT = {"type": ["string", "null"]}
MAYBE_COUNT = {"type": ["integer", "null"], "minimum": 0}
SECONDS = {"type": "object", "additionalProperties": NUMBER}


def _object(properties: dict[str, Any], required: tuple[str, ...] = (), nullable: bool = False) -> dict[str, Any]:
    return {"type": ["object", "null"] if nullable else "object", "properties": properties, "required": list(required)}


# -- results (`attn_doctor.results`) --

VERDICTS = ("PASS", "FAIL", "SKIP", "ERROR", "INCONCLUSIVE", "TOO-BIG", "")

ROW = _object({
    "backend": TEXT, "family": TEXT, "layout": TEXT, "ran": TEXT, "verdict": {"enum": list(VERDICTS)},
    "reason": TEXT, "detail": TEXT, "case": OBJECT, "options": OBJECT, "coords": OBJECT, "extra": OBJECT,
    "tensors": {"type": "object", "additionalProperties": OBJECT}, "seconds": SECONDS, "internal": FLAG,
}, required=("backend", "layout", "verdict", "case"))

_RUN_FIELDS = {
    "format": {"const": "attn-doctor/results"}, "format_version": WHOLE, "tool_version": TEXT, "created": TEXT,
    "command": TEXT, "device": TEXT, "env": {"type": ["object", "null"]}, "summary": TEXT, "faulty": {"type": "array"},
    "seconds": SECONDS, "artifacts": {"type": "object", "additionalProperties": TEXT}, "requested": TEXTS,
    "interrupted": FLAG, "notes": TEXTS, "not_judged": TEXTS, "memory": {"type": ["object", "null"]},
}

RESULTS = _object({**_RUN_FIELDS, "results": {"type": "array", "items": ROW}}, required=("format", "results"))

SWEEP_HEADER = _object(_RUN_FIELDS, required=("format",))  # a results document without its rows

SWEEP_RECORD = {"allOf": [ROW, _object({"point": TEXT, "point_complete": FLAG}, required=("point",))]}

BISECT = _object({
    "format": {"const": "attn-doctor/bisect"}, "format_version": WHOLE, "backend": TEXT, "layout": TEXT,
    "start_case": OBJECT, "minimal_case": OBJECT, "necessary": {"type": "array", "items": OBJECT},
    "changes": {"type": "array", "items": OBJECT}, "probes": {"type": "array", "items": OBJECT},
    "backend_spec": OBJECT, "diagnosis": OBJECT, "repro": TEXT, "command": TEXT, "tool_version": TEXT, "created": TEXT,
    "results": {"type": "array", "items": ROW}, "env": {"type": ["object", "null"]},
}, required=("start_case", "minimal_case", "necessary", "probes"))

# -- captures (`attn_doctor.tracing.store`) --

CAPTURE_HEADER = _object({"format": TEXT, "format_version": COUNT}, required=("format",))

TENSOR = _object({
    "shape": COUNTS, "stride": {"type": "array", "items": WHOLE}, "storage_offset": COUNT, "dtype": TEXT,
    "device": TEXT, "storage": _object({"id": WHOLE, "nbytes": COUNT}), "requires_grad": FLAG,
}, required=("shape", "dtype"))

# The lines of a calls file, each checked once, by its kind: a signature (what calls share, written once for
# many calls: the tensors' geometry is the costly part to check, about 0.4 ms), a call naming its signature
# (what is its own), a call whole (format 1), an output gradient's geometry, and which geometry a call's output
# gradient had.
_SHARED = {"rank": COUNT, "world_size": COUNT, "api": TEXT,
           "process": _object({"pid": WHOLE, "started": TEXT}, ("pid",)),
           "parallel": {"type": "object", "additionalProperties": WHOLE}, "arguments": OBJECT,
           "tensors": {"type": "object", "additionalProperties": TENSOR}}
_OWN = {"index": COUNT, "module": MAYBE_TEXT, "layer": MAYBE_COUNT, "step": COUNT, "values": MAYBE_TEXT,
        "signature": COUNT}
SIGNATURE = _object({**_SHARED, "signature": COUNT}, required=("signature", "rank", "api", "process", "tensors"))
CALL_OF_SIGNATURE = _object(_OWN, required=("index", "signature"))
CALL = _object({**_OWN, **_SHARED}, required=("index", "rank", "api", "process", "tensors"))
GRADIENT_GEOMETRY = _object({"gradient_geometry": COUNT, "tensor": TENSOR}, required=("gradient_geometry", "tensor"))
GRADIENT_OF = _object({"gradient_of": COUNT, "geometry": COUNT}, required=("gradient_of", "geometry"))

WEIGHT = _object({
    "name": TEXT, "dtype": TEXT, "shape": COUNTS, "split_dim": WHOLE, "sum_squares": {"type": "number", "minimum": 0},
    "checksums": {"type": "array", "items": NUMBER, "minItems": 1},
}, required=("name", "dtype", "shape", "split_dim", "sum_squares", "checksums"))

MODEL_FACTS = _object({
    "rank": COUNT, "parallel": {"type": "object", "additionalProperties": WHOLE}, "model": TEXT,
    "weights": {"type": "array", "items": WEIGHT},
    "settings": _object({"dropout_modules": _object({"count": {"type": "integer", "minimum": 1}, "first": TEXT,
                                                     "p": NUMBER}, ("count", "first", "p"), nullable=True)}),
    "data": _object({"shape": COUNTS, "sha256": TEXT}, ("shape", "sha256"), nullable=True),
})


_validators: dict[int, Any] = {}  # by the schema's id: the schemas are module constants


def check(document: Any, schema: dict[str, Any], source: str, fix: str) -> None:
    """Bad input when `document` does not fit `schema`: one line naming `source` (the file, and its line for a
    file of lines), the field and what it should be, then `fix` (what to do about it)."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import best_match

    validator = _validators.setdefault(id(schema), Draft202012Validator(schema))
    error = best_match(validator.iter_errors(document))
    if error is None:
        return
    path = list(error.absolute_path)
    if error.validator == "required":
        path.append(next(name for name in error.validator_value if name not in error.instance))
        raise BadInput(f"{source}: {field_name(path)} is missing; {fix}")
    raise BadInput(f"{source}: {field_name(path)} {_what(error)}; {fix}")


def field_name(path: list[str | int]) -> str:
    """`field results[3].verdict`, or "the document" for the whole of it."""
    name = ""
    for part in path:
        name += f"[{part}]" if isinstance(part, int) else (f".{part}" if name else str(part))
    return f"field {name}" if name else "the document"


def _what(error: Any) -> str:
    """What is wrong, without quoting a large value whole."""
    shown = repr(error.instance)
    shown = shown if len(shown) <= 40 else shown[:37] + "..."
    if error.validator == "type":
        wanted = error.validator_value
        wanted = " or ".join(wanted) if isinstance(wanted, list) else wanted
        return f"is {shown}, not {'an' if wanted[0] in 'aeiou' else 'a'} {wanted}"
    if error.validator in ("enum", "const"):
        allowed = error.validator_value if error.validator == "enum" else [error.validator_value]
        return f"is {shown}, not one of {', '.join(map(repr, allowed))}"
    if error.validator in ("minimum", "minItems"):
        return f"is {shown}, below the least allowed ({error.validator_value})"
    return error.message if len(error.message) <= 100 else error.message[:97] + "..."
