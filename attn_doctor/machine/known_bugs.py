"""Known-bug recognition: which known TE / cuDNN attention defects match this machine and case.

The defects are data, in ``attn_doctor/data/known_bugs.toml`` (shipped as package data): one
``[[bug]]`` table per defect with

- ``id`` (required, unique), ``title`` (required), ``reference`` (required: the issue, PR or
  source line to read),
- ``symptom``: one of :data:`SYMPTOMS`; ``component``: one of :data:`COMPONENTS`,
- ``fixed_in`` (free text, e.g. "cuDNN 9.15.1"; omit when unknown), ``note`` (what TE does about it),
- ``source`` (optional URL of the code line that encodes the rule), ``see_also`` (optional list of URLs),
- ``[bug.when]``: the conditions, all of which must hold. Keys (all optional, at least one):

  environment (:data:`ENV_KEYS`)
    ``te`` PEP 440 specifier on TE's version; ``cudnn`` specifier on the cuDNN TE loaded (torch's
    when TE's is unknown); ``cudnn_in`` list of exact cuDNN versions; ``sm`` specifier on the
    compute capability as a number (90 for sm_90); ``sm_in`` list of such numbers.
  run (:data:`CONTEXT_KEYS`, booleans read from :class:`MatchContext`)
    ``training``, ``deterministic``, ``cuda_graph``, ``fp8``, ``context_parallel``, ``kv_cache``,
    ``softmax_sink``, ``bias``.
  case (:data:`CASE_KEYS`)
    ``dtype`` list of "bf16"/"fp16"/"fp32"/"fp8"; ``qkv_format`` list of "bshd"/"sbhd"/"thd"/"bhsd"
    (from the context: the backend's format); ``mask`` list (TE's mask names; "none" is read as no_mask); ``window`` bool (a sliding window is set, left != -1); ``causal`` bool;
    ``cross_attention`` bool (seq != seq_kv); ``seq_kv_gt`` int; ``seq_kv_not_multiple_of`` int;
    ``head_dim_qk_ge`` / ``head_dim_v_ge`` int; ``head_dims_differ`` bool (d_qk != d_v);
    ``head_dims_not_in`` list of [d_qk, d_v] pairs excluded; ``head_dim_v_not_in`` list of ints.

A fact that is unknown (no TE installed, no GPU, an unreadable version, no qkv_format) makes the
condition that needs it fail: a rule never matches on a guess.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from attn_doctor.core.case import Case
from attn_doctor.machine.fingerprint import EnvReport

SYMPTOMS = ("wrong gradient", "wrong output", "NaN", "illegal memory access", "backend disabled")
COMPONENTS = ("cuDNN", "TE", "flash-attn")

ENV_KEYS = ("te", "cudnn", "cudnn_in", "sm", "sm_in")
CONTEXT_KEYS = (
    "training",
    "deterministic",
    "cuda_graph",
    "fp8",
    "context_parallel",
    "kv_cache",
    "softmax_sink",
    "bias",
)
CASE_KEYS = (
    "dtype",
    "qkv_format",
    "mask",
    "causal",
    "window",
    "cross_attention",
    "seq_kv_gt",
    "seq_kv_not_multiple_of",
    "head_dim_qk_ge",
    "head_dim_v_ge",
    "head_dims_differ",
    "head_dims_not_in",
    "head_dim_v_not_in",
)
CONDITION_KEYS = ENV_KEYS + CONTEXT_KEYS + CASE_KEYS

DTYPE_NAMES = ("bf16", "fp16", "fp32", "fp8")
QKV_FORMATS = ("bshd", "sbhd", "thd", "bhsd")
MASK_NAMES = (
    "no_mask",
    "none",  # the name attn-doctor used for no_mask before TE's mask types
    "causal",
    "padding",
    "padding_causal",
    "causal_bottom_right",
    "padding_causal_bottom_right",
    "arbitrary",
)

_BUG_FIELDS = ("id", "title", "symptom", "component", "reference", "source", "see_also", "fixed_in", "note", "when")
_SPEC_KEYS = ("te", "cudnn", "sm")
_INT_KEYS = ("seq_kv_gt", "seq_kv_not_multiple_of", "head_dim_qk_ge", "head_dim_v_ge")
_BOOL_KEYS = CONTEXT_KEYS + ("causal", "window", "cross_attention", "head_dims_differ")
_CHOICE_KEYS = {"dtype": DTYPE_NAMES, "qkv_format": QKV_FORMATS, "mask": MASK_NAMES}

_CONTEXT_LABELS = {
    "training": ("training", "inference"),
    "deterministic": ("deterministic (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)", "non-deterministic"),
    "cuda_graph": ("CUDA-graph capture", "no CUDA graphs"),
    "fp8": ("FP8", "no FP8"),
    "context_parallel": ("context parallelism", "no context parallelism"),
    "kv_cache": ("KV cache", "no KV cache"),
    "softmax_sink": ("softmax sink (off-by-one/learnable)", "vanilla softmax"),
    "bias": ("attention bias", "no bias"),
}


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

    @property
    def scope(self) -> str:
        """"environment" when every condition is about the machine or the run; else "case"."""
        return "environment" if all(k in ENV_KEYS or k in CONTEXT_KEYS for k in self.when) else "case"


@dataclass(frozen=True)
class MatchContext:
    """How the attention is run, beyond the Case. attn-doctor runs forward + backward, no FP8 etc."""

    training: bool = True
    deterministic: bool = False
    cuda_graph: bool = False
    fp8: bool = False
    context_parallel: bool = False
    kv_cache: bool = False
    softmax_sink: bool = False
    bias: bool = False
    qkv_format: str | None = None  # the backend's format (TE paths: "sbhd"); None = unknown

    @classmethod
    def from_env(cls, env: EnvReport, *, qkv_format: str | None = None, **overrides: Any) -> MatchContext:
        """attn-doctor's context on this machine: deterministic when NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."""
        deterministic = (env.env_vars or {}).get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0"
        values: dict[str, Any] = {"deterministic": deterministic, "qkv_format": qkv_format}
        values.update(overrides)
        return cls(**values)


@dataclass(frozen=True)
class Match:
    """A known bug that matches; evidence names the facts that matched."""

    bug: KnownBug
    scope: str  # "environment" or "case"
    evidence: str


# --------------------------------------------------------------------------- loading


def known_bugs_path() -> Path:
    """The shipped data file."""
    return Path(str(resources.files("attn_doctor").joinpath("data", "known_bugs.toml")))


def load_known_bugs(path: str | Path | None = None) -> list[KnownBug]:
    """Read and validate the data file (default: the shipped one). Raises ValueError naming the bug."""
    path = Path(path) if path is not None else known_bugs_path()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"known-bugs file {path} cannot be read: {exc}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"known-bugs file {path} is not valid TOML: {exc}") from None
    return parse_known_bugs(data, origin=str(path))


def parse_known_bugs(data: Mapping[str, Any], origin: str = "known bugs") -> list[KnownBug]:
    """Validate an already-parsed document ``{"bug": [...]}``."""
    extra = sorted(set(data) - {"bug"})
    if extra:
        raise ValueError(f"{origin}: unknown top-level key(s) {', '.join(extra)}; expected [[bug]] tables only")
    rows = data.get("bug", [])
    if not isinstance(rows, list):
        raise ValueError(f"{origin}: 'bug' must be an array of tables ([[bug]])")
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
        raise ValueError(f"{where}: must be a table")
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
    for name in ("symptom", "component", "fixed_in", "note", "source"):
        if name in row and not isinstance(row[name], str):
            raise ValueError(f"{where}: {name} must be a string")
    if "symptom" in row and row["symptom"] not in SYMPTOMS:
        raise ValueError(f"{where}: symptom {row['symptom']!r} is not one of {', '.join(SYMPTOMS)}")
    if "component" in row and row["component"] not in COMPONENTS:
        raise ValueError(f"{where}: component {row['component']!r} is not one of {', '.join(COMPONENTS)}")
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
    )


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_condition(key: str, value: Any, where: str) -> Any:
    """Validate one condition; returns the value in canonical form."""
    bad = f"{where}: condition {key}"
    if key not in CONDITION_KEYS:
        raise ValueError(f"{bad} is unknown; known conditions: {', '.join(CONDITION_KEYS)}")
    if key in _SPEC_KEYS:
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{bad} must be a PEP 440 specifier string such as '<=2.17', got {value!r}")
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"{bad} = {value!r} is not a valid PEP 440 specifier (e.g. '>=9.11', '==90')") from None
        return value
    if key == "cudnn_in":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{bad} must be a non-empty list of versions")
        for v in value:
            if not isinstance(v, str) or _parse_version(v) is None:
                raise ValueError(f"{bad}: {v!r} is not a version such as '9.14.0'")
        return list(value)
    if key == "sm_in":
        if not isinstance(value, list) or not value or not all(_is_int(v) and v > 0 for v in value):
            raise ValueError(f"{bad} must be a non-empty list of compute capabilities such as [89, 120]")
        return list(value)
    if key in _BOOL_KEYS:
        if not isinstance(value, bool):
            raise ValueError(f"{bad} must be true or false, got {value!r}")
        return value
    if key in _INT_KEYS:
        if not _is_int(value) or value < (1 if key == "seq_kv_not_multiple_of" else 0):
            raise ValueError(f"{bad} must be a whole number{' >= 1' if key == 'seq_kv_not_multiple_of' else ''}")
        return value
    if key in _CHOICE_KEYS:
        choices = _CHOICE_KEYS[key]
        if not isinstance(value, list) or not value or not all(v in choices for v in value):
            raise ValueError(f"{bad} must be a non-empty list of {', '.join(choices)}, got {value!r}")
        return list(value)
    if key == "head_dims_not_in":
        ok = isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and all(_is_int(d) for d in p) for p in value
        )
        if not ok or not value:
            raise ValueError(f"{bad} must be a non-empty list of [d_qk, d_v] pairs")
        return [tuple(p) for p in value]
    if key == "head_dim_v_not_in":
        if not isinstance(value, list) or not value or not all(_is_int(v) for v in value):
            raise ValueError(f"{bad} must be a non-empty list of head dimensions")
        return list(value)
    raise AssertionError(key)  # pragma: no cover - every key is handled above


# --------------------------------------------------------------------------- facts


def _parse_version(text: str | None) -> Version | None:
    """'9.14.0 (91400)' -> Version('9.14.0'); '2.20.0.dev0+abc' as is; None when unreadable."""
    words = str(text).split() if text else []
    if not words:
        return None
    try:
        return Version(words[0])
    except InvalidVersion:
        m = re.match(r"\d+(?:\.\d+)*", words[0])
        return Version(m.group(0)) if m else None


def _parse_sm(text: str | None) -> int | None:
    m = re.fullmatch(r"\s*sm_?(\d+)[a-z]?\s*", text or "")
    return int(m.group(1)) if m else None


def _te_version(env: EnvReport) -> Version | None:
    return _parse_version(env.te.value) if env.te is not None else None


def _cudnn(env: EnvReport) -> tuple[Version | None, str]:
    """(version, whose): TE's cuDNN, else torch's."""
    te_v = _parse_version(env.te_cudnn.value) if env.te_cudnn is not None else None
    if te_v is not None:
        return te_v, "TE's"
    torch_v = _parse_version(env.torch_cudnn.value) if env.torch_cudnn is not None else None
    if torch_v is not None:
        return torch_v, "torch's; TE's unknown"
    return None, ""


def _in_spec(version: Version, spec: str) -> bool:
    return SpecifierSet(spec).contains(version, prereleases=True)


def _head_dims(case: Case) -> tuple[int, int]:
    d_qk = case.head_dim
    d_v = getattr(case, "head_dim_v", None) or d_qk
    return d_qk, d_v


# --------------------------------------------------------------------------- matching


def _match_env(when: Mapping[str, Any], env: EnvReport) -> list[str] | None:
    """Evidence pieces for the environment conditions, or None when one fails or is unknown."""
    pieces: list[str] = []
    if "te" in when:
        v = _te_version(env)
        if v is None or not _in_spec(v, when["te"]):
            return None
        pieces.append(f"TE {v}")
    if "cudnn" in when or "cudnn_in" in when:
        v, whose = _cudnn(env)
        if v is None:
            return None
        if "cudnn" in when and not _in_spec(v, when["cudnn"]):
            return None
        if "cudnn_in" in when and not any(v == Version(x) for x in when["cudnn_in"]):
            return None
        pieces.append(f"cuDNN {v} ({whose})")
    if "sm" in when or "sm_in" in when:
        sms = [(g.index, _parse_sm(g.sm)) for g in env.gpus or ()]
        known = [(i, sm) for i, sm in sms if sm is not None]
        hits = [
            (i, sm)
            for i, sm in known
            if ("sm" not in when or _in_spec(Version(str(sm)), when["sm"])) and ("sm_in" not in when or sm in when["sm_in"])
        ]
        if not hits:
            return None
        if len(hits) == len(sms) and len({sm for _, sm in hits}) == 1:
            pieces.append(f"sm_{hits[0][1]}")
        else:
            pieces.append(" / ".join(f"sm_{sm} (GPU {i})" for i, sm in hits))
    return pieces


def _match_context(when: Mapping[str, Any], context: MatchContext) -> list[str] | None:
    pieces: list[str] = []
    for key in CONTEXT_KEYS:
        if key in when:
            if bool(getattr(context, key)) != when[key]:
                return None
            pieces.append(_CONTEXT_LABELS[key][0 if when[key] else 1])
    return pieces


def _match_case(when: Mapping[str, Any], case: Case, context: MatchContext) -> list[str] | None:
    pieces: list[str] = []
    d_qk, d_v = _head_dims(case)
    seq_kv = case.seq_k
    if "dtype" in when:
        dtypes = [case.dtype] + (["fp8"] if context.fp8 else [])
        hit = next((d for d in dtypes if d in when["dtype"]), None)
        if hit is None:
            return None
        pieces.append(hit)
    if "qkv_format" in when:
        if context.qkv_format is None or context.qkv_format not in when["qkv_format"]:
            return None
        pieces.append(f"qkv_format {context.qkv_format}")
    if "mask" in when:
        if case.mask not in ["no_mask" if m == "none" else m for m in when["mask"]]:
            return None
        pieces.append(f"mask {case.mask}")
    if "window" in when:
        sliding = case.window is not None and case.window[0] != -1
        if sliding != when["window"]:
            return None
        pieces.append(f"sliding window ({case.window[0]},{case.window[1]})" if sliding else "no sliding window")
    if "causal" in when:
        if case.causal != when["causal"]:
            return None
        pieces.append("causal" if case.causal else "non-causal")
    if "cross_attention" in when:
        cross = case.seq != seq_kv
        if cross != when["cross_attention"]:
            return None
        pieces.append(f"cross-attention (seq {case.seq} != seq_kv {seq_kv})" if cross else "self-attention")
    if "seq_kv_gt" in when:
        if not seq_kv > when["seq_kv_gt"]:
            return None
        pieces.append(f"seq_kv {seq_kv} > {when['seq_kv_gt']}")
    if "seq_kv_not_multiple_of" in when:
        if seq_kv % when["seq_kv_not_multiple_of"] == 0:
            return None
        pieces.append(f"seq_kv {seq_kv} not a multiple of {when['seq_kv_not_multiple_of']}")
    if "head_dim_qk_ge" in when:
        if not d_qk >= when["head_dim_qk_ge"]:
            return None
        pieces.append(f"d_qk {d_qk} >= {when['head_dim_qk_ge']}")
    if "head_dim_v_ge" in when:
        if not d_v >= when["head_dim_v_ge"]:
            return None
        pieces.append(f"d_v {d_v} >= {when['head_dim_v_ge']}")
    if "head_dims_differ" in when:
        if (d_qk != d_v) != when["head_dims_differ"]:
            return None
        pieces.append(f"d_qk {d_qk} != d_v {d_v}" if d_qk != d_v else f"d_qk == d_v == {d_qk}")
    if "head_dims_not_in" in when:
        if (d_qk, d_v) in when["head_dims_not_in"]:
            return None
    if "head_dim_v_not_in" in when:
        if d_v in when["head_dim_v_not_in"]:
            return None
        pieces.append(f"d_v {d_v} not in {{{', '.join(map(str, when['head_dim_v_not_in']))}}}")
    return pieces


def _evaluate(bug: KnownBug, env: EnvReport, case: Case | None, context: MatchContext) -> Match | None:
    env_pieces = _match_env(bug.when, env)
    if env_pieces is None:
        return None
    case_pieces: list[str] = []
    if bug.scope == "case":
        if case is None:
            return None
        got = _match_case(bug.when, case, context)
        if got is None:
            return None
        case_pieces = got
    ctx_pieces = _match_context(bug.when, context)
    if ctx_pieces is None:
        return None
    evidence = " + ".join(env_pieces + case_pieces + ctx_pieces)
    return Match(bug=bug, scope=bug.scope, evidence=evidence)


def match_environment(
    bugs: Iterable[KnownBug], env: EnvReport, context: MatchContext | None = None
) -> list[Match]:
    """Bugs whose conditions are all about the machine (TE, cuDNN, sm) and the run (default context).

    For `attn-doctor env`. ``context`` defaults to :meth:`MatchContext.from_env`.
    """
    context = context if context is not None else MatchContext.from_env(env)
    out = []
    for bug in bugs:
        if bug.scope != "environment":
            continue
        m = _evaluate(bug, env, None, context)
        if m is not None:
            out.append(m)
    return out


def match_case(
    bugs: Iterable[KnownBug], env: EnvReport, case: Case, context: MatchContext | None = None
) -> list[Match]:
    """Every bug that matches this machine, run and case: environment-only rules (scope
    "environment") and rules with case conditions (scope "case")."""
    context = context if context is not None else MatchContext.from_env(env)
    out = []
    for bug in bugs:
        m = _evaluate(bug, env, case, context)
        if m is not None:
            out.append(m)
    return out


def describe(match: Match) -> str:
    """One line: what matched, what TE does, the symptom, where to read, and the fix."""
    bug = match.bug
    what = bug.note or bug.title
    symptom = bug.symptom or ""
    low = what.lower()
    if symptom and symptom.lower() not in low and not (symptom == "backend disabled" and "disabl" in low):
        what = f"{what} ({symptom})"
    text = f"{match.evidence}: {what}; see {bug.reference}"
    if bug.fixed_in:
        text += f" (fixed in {bug.fixed_in})"
    return text



def case_descriptions(env: EnvReport,
                      cases: Sequence[tuple[Case, Sequence[str | None | Mapping[str, Any]]]]) -> list[str]:
    """One line per known bug that matches the machine and any of the cases (each case with the qkv formats
    it ran in; None: a path whose format no rule is written for; or, for a path that runs in another context
    than the machine's, a mapping of MatchContext fields, e.g. {"qkv_format": "sbhd", "deterministic": True})."""
    bugs = load_known_bugs()
    found: dict[str, str] = {}
    for case, formats in cases:
        for entry in formats or [None]:
            values = dict(entry) if isinstance(entry, Mapping) else {"qkv_format": entry}
            # What the case itself sets about how the attention runs.
            values = {"fp8": case.fp8 != "none", "softmax_sink": case.softmax != "vanilla",
                      "bias": case.bias != "no_bias", **values}
            context = MatchContext.from_env(env, **values)
            for match in match_case(bugs, env, case, context):
                found.setdefault(match.bug.id, describe(match))
    return list(found.values())
