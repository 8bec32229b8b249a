"""Known-bug recognition: which known TE / cuDNN / FlashAttention / PyTorch attention defects match this
machine, and which match (or were not reproduced by) the probes of a run.

The defects are data, in ``attn_doctor/data/known_bugs.toml`` (shipped as package data): one
``[[bug]]`` table per defect with

- ``id`` (required, unique), ``title`` (required), ``reference`` (required: the issue, PR or source line
  to read; an https URL, or for a defect attn-doctor found itself a path in this repository to the
  committed report),
- ``symptom``: one of :data:`SYMPTOMS`; ``component``: one of :data:`COMPONENTS`,
- ``fixed_in`` (free text, e.g. "cuDNN 9.15.1"; omit when unknown), ``workaround`` (what to do until
  then, e.g. "set NVTE_FUSED_ATTN=0"), ``note`` (the mechanism, and what TE does about it),
- ``found_by``: "attn-doctor" for a defect attn-doctor found itself (no upstream report yet),
- ``source`` (optional URL of the code line that encodes the rule or holds the fault), ``see_also``
  (optional list of URLs),
- ``[bug.when]``: the conditions, all of which must hold. Keys (all optional, at least one):

  environment (:data:`ENV_KEYS`)
    ``te`` PEP 440 specifier on TE's version; ``cudnn`` specifier on the cuDNN the path loaded (TE paths:
    the one TE loaded, torch's when that is unknown; SDPA paths: torch's); ``cudnn_in`` list of exact
    cuDNN versions; ``sm`` specifier on the compute capability as a number (90 for sm_90); ``sm_in``
    list of such numbers; ``flash_attn`` specifier on an installed flash-attn (v2, v3 or v4, e.g.
    ">=4.0.0a0,<5" for FlashAttention 4); ``torch`` specifier on torch's version.
  run (:data:`CONTEXT_KEYS`, read from :class:`MatchContext`)
    booleans ``training``, ``deterministic``, ``cuda_graph``, ``fp8``, ``context_parallel``,
    ``kv_cache``, ``softmax_sink``, ``bias``, ``dout_strided`` (the output gradient's strides differ
    from the output's), ``causal_with_explicit_mask`` (an attention_mask passed with a causal mask type
    that ignores it), ``varying_cu_seqlens`` (successive calls in one process with different
    cu_seqlens), ``recompute`` (full activation recompute); ``cp_comm_type`` list of TE's CP
    communication types ("p2p", "a2a", "all_gather", "a2a+p2p").
  path (:data:`PATH_KEYS`, read from :class:`MatchContext`)
    ``backend`` list of attn-doctor path names (:data:`BACKEND_NAMES`); a name matches itself and the
    paths under it ("te" every TE path, "te.fused" also "te.fused.det"); ``sub_backend`` list of TE's
    FusedAttention sub-backends (0 F16_max512_seqlen, 1 F16_arbitrary_seqlen, 2 FP8), read back from
    what TE ran; ``layout`` list of attn-doctor's memory layouts (`attn_doctor.core.layouts`).
  case (:data:`CASE_KEYS`)
    ``dtype`` list of "bf16"/"fp16"/"fp32"/"fp8"; ``qkv_format`` list of "bshd"/"sbhd"/"thd"/"bhsd"
    (from the context: the backend's format); ``mask`` list (TE's mask names; "none" is read as
    no_mask); ``window`` bool (a sliding window is set, left != -1); ``causal`` bool;
    ``cross_attention`` bool (seq != seq_kv); ``seq_kv_shorter`` bool (some sequence has fewer keys
    than queries); ``ragged`` bool (some sequence is shorter than the padded length); ``seq_kv_gt``,
    ``seq_q_gt``, ``seq_q_le`` int; ``seq_kv_not_multiple_of`` int; ``seq_kv_mod`` [m, r] (seq_kv % m
    == r); ``seqlens_not_multiple_of_2cp`` bool (some sequence's length is not a multiple of 2 x the
    CP size; needs context parallelism); ``batch_ge`` int; ``gqa`` bool (fewer kv heads than heads);
    ``kv_heads_lt`` int; ``head_dim_qk_ge`` / ``head_dim_v_ge`` int; ``head_dim_in`` list of d_qk;
    ``head_dims_differ`` bool (d_qk != d_v); ``head_dims_not_in`` list of [d_qk, d_v] pairs excluded;
    ``head_dim_v_not_in`` list of ints; ``head_dim_v_not_multiple_of`` int; ``fp8_recipe`` list of
    :data:`FP8_RECIPE_NAMES`; ``bias_shape`` list of :data:`BIAS_SHAPE_NAMES` (post_scale_bias shapes,
    or "alibi"); ``softmax_type`` list of "vanilla"/"off-by-one"/"learnable"; ``pad_between_seqs`` bool.

A rule is machine-level (scope "environment", printed by ``attn-doctor env``) when every condition but
``backend``/``sub_backend`` (which say what it affects) is about the environment or the run; otherwise
case-level, matched against each probe of a run.

A fact that is unknown (no TE installed, no GPU, an unreadable version, no qkv_format, a sub-backend TE
did not report) makes the condition that needs it fail: a rule never matches on a guess.

A rule whose conditions hold for a probe is reported as matching where the probe shows its symptom
(:func:`shows_symptom`), and as "not reproduced here" where none does (:func:`find_known_bugs`).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
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

from attn_doctor.core.case import BIAS_SHAPES, SOFTMAX_TYPES, Case
from attn_doctor.core.coords import CP_COMM_TYPES
from attn_doctor.core.layouts import CAPTURED, LAYOUTS
from attn_doctor.machine.fingerprint import EnvReport

SYMPTOMS = ("wrong gradient", "wrong output", "NaN", "illegal memory access", "backend disabled",
            "nondeterministic", "mask leak")
COMPONENTS = ("cuDNN", "TE", "flash-attn", "PyTorch", "Megatron-LM")
FOUND_BY = ("attn-doctor",)

ENV_KEYS = ("te", "cudnn", "cudnn_in", "sm", "sm_in", "flash_attn", "torch")
_CONTEXT_FLAGS = (
    "training",
    "deterministic",
    "cuda_graph",
    "fp8",
    "context_parallel",
    "kv_cache",
    "softmax_sink",
    "bias",
    "dout_strided",
    "causal_with_explicit_mask",
    "varying_cu_seqlens",
    "recompute",
)
CONTEXT_KEYS = _CONTEXT_FLAGS + ("cp_comm_type",)
PATH_KEYS = ("backend", "sub_backend", "layout")
CASE_KEYS = (
    "dtype",
    "qkv_format",
    "mask",
    "causal",
    "window",
    "cross_attention",
    "seq_kv_shorter",
    "ragged",
    "seq_kv_gt",
    "seq_q_gt",
    "seq_q_le",
    "seq_kv_not_multiple_of",
    "seq_kv_mod",
    "seqlens_not_multiple_of_2cp",
    "batch_ge",
    "gqa",
    "kv_heads_lt",
    "head_dim_qk_ge",
    "head_dim_v_ge",
    "head_dim_in",
    "head_dims_differ",
    "head_dims_not_in",
    "head_dim_v_not_in",
    "head_dim_v_not_multiple_of",
    "fp8_recipe",
    "bias_shape",
    "softmax_type",
    "pad_between_seqs",
)
CONDITION_KEYS = ENV_KEYS + CONTEXT_KEYS + PATH_KEYS + CASE_KEYS
# What a machine-level rule may name besides the environment: the path it affects.
_AFFECTED_PATH_KEYS = ("backend", "sub_backend")

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
# attn-doctor's path names and the families above them (tests check they cover every built-in path).
BACKEND_NAMES = ("te", "te.fused", "te.fused.det", "te.flash", "te.unfused", "sdpa", "sdpa.flash",
                 "sdpa.efficient", "sdpa.cudnn", "sdpa.math", "local")
SUB_BACKENDS = {0: "F16_max512_seqlen", 1: "F16_arbitrary_seqlen", 2: "FP8"}
# TE's FP8 attention recipes; attn-doctor runs "delayed" and "current" (its Case.fp8).
FP8_RECIPE_NAMES = ("delayed", "current", "mxfp8", "blockwise")
BIAS_SHAPE_NAMES = BIAS_SHAPES + ("alibi",)

_BUG_FIELDS = ("id", "title", "symptom", "component", "reference", "source", "see_also", "fixed_in",
               "workaround", "note", "found_by", "when")

# How each condition key's value is validated (and put in canonical form) on load.
_KINDS: dict[str, str] = {
    **{key: "specifier" for key in ("te", "cudnn", "sm", "flash_attn", "torch")},
    "cudnn_in": "versions",
    **{key: "bool" for key in _CONTEXT_FLAGS + ("causal", "window", "cross_attention", "seq_kv_shorter", "ragged",
                                                "seqlens_not_multiple_of_2cp", "gqa", "head_dims_differ",
                                                "pad_between_seqs")},
    **{key: "count" for key in ("seq_kv_gt", "seq_q_gt", "seq_q_le", "batch_ge", "head_dim_qk_ge",
                                "head_dim_v_ge")},
    **{key: "positive" for key in ("seq_kv_not_multiple_of", "kv_heads_lt", "head_dim_v_not_multiple_of")},
    **{key: "ints" for key in ("sm_in", "head_dim_in", "head_dim_v_not_in")},
    "sub_backend": "sub_backends",
    "head_dims_not_in": "pairs",
    "seq_kv_mod": "modulus",
    **{key: "choices" for key in ("dtype", "qkv_format", "mask", "cp_comm_type", "backend", "layout",
                                  "fp8_recipe", "bias_shape", "softmax_type")},
}
_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": DTYPE_NAMES,
    "qkv_format": QKV_FORMATS,
    "mask": MASK_NAMES,
    "cp_comm_type": CP_COMM_TYPES + ("a2a+p2p",),
    "backend": BACKEND_NAMES,
    "layout": LAYOUTS + (CAPTURED,),
    "fp8_recipe": FP8_RECIPE_NAMES,
    "bias_shape": BIAS_SHAPE_NAMES,
    "softmax_type": SOFTMAX_TYPES,
}

_CONTEXT_LABELS = {
    "training": ("training", "inference"),
    "deterministic": ("deterministic (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)", "non-deterministic"),
    "cuda_graph": ("CUDA-graph capture", "no CUDA graphs"),
    "fp8": ("FP8", "no FP8"),
    "context_parallel": ("context parallelism", "no context parallelism"),
    "kv_cache": ("KV cache", "no KV cache"),
    "softmax_sink": ("softmax sink (off-by-one/learnable)", "vanilla softmax"),
    "bias": ("attention bias", "no bias"),
    "dout_strided": ("output gradient strided unlike the output", "output gradient strided like the output"),
    "causal_with_explicit_mask": ("attention_mask with a causal mask type", "no attention_mask beside causal"),
    "varying_cu_seqlens": ("calls with varying cu_seqlens", "fixed cu_seqlens"),
    "recompute": ("activation recompute", "no recompute"),
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
    workaround: str | None = None
    found_by: str | None = None

    @property
    def scope(self) -> str:
        """"environment" when every condition (but the affected path) is about the machine or the run;
        else "case"."""
        machine = set(ENV_KEYS) | set(CONTEXT_KEYS) | set(_AFFECTED_PATH_KEYS)
        return "environment" if set(self.when) <= machine else "case"

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


@dataclass(frozen=True)
class MatchContext:
    """How the attention is run, beyond the Case: the run (attn-doctor runs forward + backward, no FP8 etc.)
    and the path that ran it (unknown: None)."""

    training: bool = True
    deterministic: bool = False
    cuda_graph: bool = False
    fp8: bool = False
    context_parallel: bool = False
    kv_cache: bool = False
    softmax_sink: bool = False
    bias: bool = False
    dout_strided: bool = False
    causal_with_explicit_mask: bool = False
    varying_cu_seqlens: bool = False
    recompute: bool = False
    cp_size: int = 1
    cp_comm_type: str | None = None
    qkv_format: str | None = None  # the backend's format (TE paths: the case's); None = unknown
    backend: str | None = None  # attn-doctor's path name, e.g. "te.fused.det"
    sub_backend: int | None = None  # TE's FusedAttention sub-backend as TE reported it
    layout: str | None = None  # attn-doctor's memory layout

    @classmethod
    def from_env(cls, env: EnvReport, *, qkv_format: str | None = None, **overrides: Any) -> MatchContext:
        """attn-doctor's context on this machine: deterministic when NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."""
        deterministic = (env.env_vars or {}).get("NVTE_ALLOW_NONDETERMINISTIC_ALGO") == "0"
        values: dict[str, Any] = {"deterministic": deterministic, "qkv_format": qkv_format}
        values.update(overrides)
        return cls(**values)

    @classmethod
    def for_case(cls, env: EnvReport, case: Case, **overrides: Any) -> MatchContext:
        """The machine's context plus what the case itself sets about how the attention runs (FP8, a
        softmax sink, a bias); ``overrides`` (the path, CP, ...) win."""
        values: dict[str, Any] = {"fp8": case.fp8 != "none", "softmax_sink": case.softmax != "vanilla",
                                  "bias": case.bias != "no_bias"}
        values.update(overrides)
        return cls.from_env(env, **values)


@dataclass(frozen=True)
class Match:
    """A known bug that matches; evidence names the facts that matched."""

    bug: KnownBug
    scope: str  # "environment" or "case"
    evidence: str


@dataclass(frozen=True)
class Probe:
    """One probe of a run (a results row) as the rules read it: the case, how it ran, what it showed."""

    case: Case
    context: MatchContext
    verdict: str  # PASS / FAIL / SKIP / ERROR
    ran: str = ""  # what the library reported it ran
    reason: str = ""  # why it was skipped or errored
    failing: frozenset[str] = frozenset()  # tensors that FAILed ("out", "dq", ...)
    nonfinite: frozenset[str] = frozenset()  # tensors holding NaN or Inf
    nondeterministic: bool = False  # its repeats were not bitwise identical
    internal: bool = False  # an ERROR that is attn-doctor's own


@dataclass(frozen=True)
class Finding:
    """A known bug whose conditions hold for some probes of a run: reproduced where a probe shows its
    symptom, else "not reproduced here"."""

    bug: KnownBug
    reproduced: bool
    shown: tuple[Probe, ...]  # the probes that show the symptom (empty when not reproduced)
    quiet: tuple[Probe, ...]  # the probes whose conditions hold and that do not show it
    evidence: str  # the facts that matched, on the first probe named


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


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_condition(key: str, value: Any, where: str) -> Any:
    """Validate one condition; returns the value in canonical form."""
    bad = f"{where}: condition {key}"
    kind = _KINDS.get(key)
    if kind is None:
        raise ValueError(f"{bad} is unknown; known conditions: {', '.join(CONDITION_KEYS)}")
    if kind == "specifier":
        if not isinstance(value, str) or not value.strip():
            raise ValueError(f"{bad} must be a PEP 440 specifier string such as '<=2.17', got {value!r}")
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"{bad} = {value!r} is not a valid PEP 440 specifier (e.g. '>=9.11', '==90')") from None
        return value
    if kind == "versions":
        if not isinstance(value, list) or not value:
            raise ValueError(f"{bad} must be a non-empty list of versions")
        for v in value:
            if not isinstance(v, str) or _parse_version(v) is None:
                raise ValueError(f"{bad}: {v!r} is not a version such as '9.14.0'")
        return list(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{bad} must be true or false, got {value!r}")
        return value
    if kind in ("count", "positive"):
        least = 1 if kind == "positive" else 0
        if not _is_int(value) or value < least:
            raise ValueError(f"{bad} must be a whole number{' >= 1' if least else ''}, got {value!r}")
        return value
    if kind in ("ints", "sub_backends"):
        if kind == "sub_backends":
            valid, what = SUB_BACKENDS.__contains__, f"FusedAttention sub-backends ({', '.join(map(str, SUB_BACKENDS))})"
        else:
            valid, what = (lambda v: v > 0), "positive whole numbers such as [89, 120]"
        if not isinstance(value, list) or not value or not all(_is_int(v) and valid(v) for v in value):
            raise ValueError(f"{bad} must be a non-empty list of {what}, got {value!r}")
        return list(value)
    if kind == "choices":
        choices = _CHOICES[key]
        if not isinstance(value, list) or not value or not all(v in choices for v in value):
            raise ValueError(f"{bad} must be a non-empty list of {', '.join(choices)}, got {value!r}")
        return list(value)
    if kind == "pairs":
        ok = isinstance(value, list) and all(
            isinstance(p, list) and len(p) == 2 and all(_is_int(d) for d in p) for p in value
        )
        if not ok or not value:
            raise ValueError(f"{bad} must be a non-empty list of [d_qk, d_v] pairs")
        return [tuple(p) for p in value]
    if kind == "modulus":
        ok = isinstance(value, list) and len(value) == 2 and all(_is_int(v) for v in value)
        if not ok or not 0 <= value[1] < value[0]:
            raise ValueError(f"{bad} must be [m, r] with 0 <= r < m (seq_kv % m == r), got {value!r}")
        return tuple(value)
    raise AssertionError(key)  # pragma: no cover - every kind is handled above


# --------------------------------------------------------------------------- facts


@functools.lru_cache(maxsize=256)  # a report's rows repeat the same few version strings thousands of times
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


def sub_backend_from_ran(ran: str) -> int | None:
    """TE's FusedAttention sub-backend in what a TE row ran ("FusedAttention (sub-backend 1: ...)")."""
    m = re.search(r"sub-backend (\d+)", ran or "")
    return int(m.group(1)) if m else None


def _fact_version(fact: Any) -> Version | None:
    return _parse_version(fact.value) if fact is not None else None


def _cudnn(env: EnvReport, sdpa: bool) -> tuple[Version | None, str]:
    """(version, whose): the cuDNN the path loads. SDPA paths load torch's; TE paths TE's own, torch's when
    TE's is unknown."""
    torch_v = _fact_version(env.torch_cudnn)
    if sdpa:
        return (torch_v, "torch's") if torch_v is not None else (None, "")
    te_v = _fact_version(env.te_cudnn)
    if te_v is not None:
        return te_v, "TE's"
    if torch_v is not None:
        return torch_v, "torch's; TE's unknown"
    return None, ""


def _is_sdpa_rule(when: Mapping[str, Any], context: MatchContext) -> bool:
    """Whether the cuDNN that counts is torch's: the path is an SDPA kernel (or, at machine level, every
    path the rule names is)."""
    if context.backend is not None:
        return context.backend.startswith("sdpa")
    backends = when.get("backend", [])
    return bool(backends) and all(b.startswith("sdpa") for b in backends)


@functools.lru_cache(maxsize=1024)  # each (version, rule's range) pair is checked once per row otherwise
def _in_spec(version: Version, spec: str) -> bool:
    return SpecifierSet(spec).contains(version, prereleases=True)


def _backend_matches(name: str, wanted: Iterable[str]) -> bool:
    return any(name == w or name.startswith(w + ".") for w in wanted)


# --------------------------------------------------------------------------- matching


def _match_env(when: Mapping[str, Any], env: EnvReport, context: MatchContext) -> list[str] | None:
    """Evidence pieces for the environment conditions, or None when one fails or is unknown."""
    pieces: list[str] = []
    for key, label in (("te", "TE"), ("torch", "torch")):
        if key in when:
            v = _fact_version(getattr(env, key))
            if v is None or not _in_spec(v, when[key]):
                return None
            pieces.append(f"{label} {v}")
    if "cudnn" in when or "cudnn_in" in when:
        v, whose = _cudnn(env, _is_sdpa_rule(when, context))
        if v is None:
            return None
        if "cudnn" in when and not _in_spec(v, when["cudnn"]):
            return None
        if "cudnn_in" in when and not any(v == Version(x) for x in when["cudnn_in"]):
            return None
        pieces.append(f"cuDNN {v} ({whose})")
    if "flash_attn" in when:
        installed = [v for v in map(_fact_version, (env.flash_attn or {}).values()) if v is not None]
        hit = next((v for v in installed if _in_spec(v, when["flash_attn"])), None)
        if hit is None:
            return None
        pieces.append(f"flash-attn {hit}")
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
    for key in _CONTEXT_FLAGS:
        if key in when:
            if bool(getattr(context, key)) != when[key]:
                return None
            pieces.append(_CONTEXT_LABELS[key][0 if when[key] else 1])
    if "cp_comm_type" in when:
        if context.cp_comm_type not in when["cp_comm_type"]:
            return None
        pieces.append(f"cp_comm_type {context.cp_comm_type}")
    return pieces


def _match_path(when: Mapping[str, Any], context: MatchContext) -> list[str] | None:
    pieces: list[str] = []
    if "backend" in when:
        if context.backend is None or not _backend_matches(context.backend, when["backend"]):
            return None
        pieces.append(context.backend)
    if "sub_backend" in when:
        if context.sub_backend not in when["sub_backend"]:
            return None
        pieces.append(f"sub-backend {context.sub_backend} ({SUB_BACKENDS[context.sub_backend]})")
    if "layout" in when:
        if context.layout not in when["layout"]:
            return None
        pieces.append(f"layout {context.layout}")
    return pieces


# Each case condition: (its value, the case, the context) -> the evidence ("" for none) or None when it
# does not hold.
_CaseCheck = Callable[[Any, Case, MatchContext], "str | None"]


def _when(holds: bool, evidence: str = "") -> str | None:
    return evidence if holds else None


def _flag(value: bool, actual: bool, yes: str, no: str) -> str | None:
    return _when(actual == value, yes if actual else no)


def _dtype(value: list[str], case: Case, context: MatchContext) -> str | None:
    dtypes = [case.dtype] + (["fp8"] if context.fp8 else [])
    return next((d for d in dtypes if d in value), None)


def _mask(value: list[str], case: Case, context: MatchContext) -> str | None:
    return _when(case.mask in ["no_mask" if m == "none" else m for m in value], f"mask {case.mask}")


def _window(value: bool, case: Case, context: MatchContext) -> str | None:
    sliding = case.window is not None and case.window[0] != -1
    return _flag(value, sliding, f"sliding window {case.window}", "no sliding window")


def _kv_shorter(value: bool, case: Case, context: MatchContext) -> str | None:
    shorter = any(kv < q for q, kv in zip(case.lengths_q(), case.lengths_kv()))
    return _flag(value, shorter, f"fewer keys than queries (seq {case.seq}, seq_kv {case.seq_kv})",
                 "no sequence with fewer keys than queries")


def _ragged(value: bool, case: Case, context: MatchContext) -> str | None:
    ragged = any(n < case.seq for n in case.lengths_q()) or any(n < case.seq_kv for n in case.lengths_kv())
    return _flag(value, ragged, "ragged sequence lengths", "full-length sequences")


def _not_multiple_of_2cp(value: bool, case: Case, context: MatchContext) -> str | None:
    if context.cp_size <= 1:  # a condition about CP shards: without CP it cannot hold
        return None
    step = 2 * context.cp_size
    odd = [n for n in case.lengths_q() if n % step]
    return _flag(value, bool(odd), f"sequence length {odd[0] if odd else ''} not a multiple of 2 x CP {context.cp_size}",
                 f"every sequence length a multiple of 2 x CP {context.cp_size}")


def _in_list(value: list, actual: Any, label: str) -> str | None:
    return _when(actual in value, f"{label} {actual}")


_CASE_CHECKS: dict[str, _CaseCheck] = {
    "dtype": _dtype,
    "qkv_format": lambda v, c, x: _when(x.qkv_format is not None and x.qkv_format in v, f"qkv_format {x.qkv_format}"),
    "mask": _mask,
    "causal": lambda v, c, x: _flag(v, c.causal, "causal", "non-causal"),
    "window": _window,
    "cross_attention": lambda v, c, x: _flag(v, c.seq != c.seq_kv, f"cross-attention (seq {c.seq} != seq_kv {c.seq_kv})",
                                              "self-attention"),
    "seq_kv_shorter": _kv_shorter,
    "ragged": _ragged,
    "seq_kv_gt": lambda v, c, x: _when(c.seq_kv > v, f"seq_kv {c.seq_kv} > {v}"),
    "seq_q_gt": lambda v, c, x: _when(c.seq > v, f"seq {c.seq} > {v}"),
    "seq_q_le": lambda v, c, x: _when(c.seq <= v, f"seq {c.seq} <= {v}"),
    "seq_kv_not_multiple_of": lambda v, c, x: _when(c.seq_kv % v != 0, f"seq_kv {c.seq_kv} not a multiple of {v}"),
    "seq_kv_mod": lambda v, c, x: _when(c.seq_kv % v[0] == v[1], f"seq_kv {c.seq_kv} = {v[1]} mod {v[0]}"),
    "seqlens_not_multiple_of_2cp": _not_multiple_of_2cp,
    "batch_ge": lambda v, c, x: _when(c.batch >= v, f"batch {c.batch} >= {v}"),
    "gqa": lambda v, c, x: _flag(v, c.kv_heads < c.heads, f"GQA ({c.heads}/{c.kv_heads} heads)", "no GQA"),
    "kv_heads_lt": lambda v, c, x: _when(c.kv_heads < v, f"{c.kv_heads} kv heads < {v}"),
    "head_dim_qk_ge": lambda v, c, x: _when(c.head_dim >= v, f"d_qk {c.head_dim} >= {v}"),
    "head_dim_v_ge": lambda v, c, x: _when(c.head_dim_v >= v, f"d_v {c.head_dim_v} >= {v}"),
    "head_dim_in": lambda v, c, x: _in_list(v, c.head_dim, "d_qk"),
    "head_dims_differ": lambda v, c, x: _flag(v, c.head_dim != c.head_dim_v, f"d_qk {c.head_dim} != d_v {c.head_dim_v}",
                                               f"d_qk == d_v == {c.head_dim}"),
    "head_dims_not_in": lambda v, c, x: _when((c.head_dim, c.head_dim_v) not in v),
    "head_dim_v_not_in": lambda v, c, x: _when(c.head_dim_v not in v, f"d_v {c.head_dim_v} not in {{{', '.join(map(str, v))}}}"),
    "head_dim_v_not_multiple_of": lambda v, c, x: _when(c.head_dim_v % v != 0, f"d_v {c.head_dim_v} not a multiple of {v}"),
    "fp8_recipe": lambda v, c, x: _in_list(v, c.fp8, "FP8 recipe"),
    "bias_shape": lambda v, c, x: _in_list(v, c.bias.removeprefix("post_scale_bias:"), "bias"),
    "softmax_type": lambda v, c, x: _in_list(v, c.softmax, "softmax"),
    "pad_between_seqs": lambda v, c, x: _flag(v, c.pad_between_seqs, "pad_between_seqs", "no padding between sequences"),
}


def _match_case(when: Mapping[str, Any], case: Case, context: MatchContext) -> list[str] | None:
    pieces: list[str] = []
    for key in CASE_KEYS:
        if key in when:
            evidence = _CASE_CHECKS[key](when[key], case, context)
            if evidence is None:
                return None
            if evidence:
                pieces.append(evidence)
    return pieces


def _evaluate(bug: KnownBug, env: EnvReport, case: Case | None, context: MatchContext) -> Match | None:
    """The match of one rule, or None. Without a case, only a machine-level rule can match, and the path
    it names is what it affects rather than a condition."""
    if case is None and bug.scope != "environment":
        return None
    parts = [_match_env(bug.when, env, context), _match_context(bug.when, context)]
    if case is not None:
        parts += [_match_path(bug.when, context), _match_case(bug.when, case, context)]
    if any(part is None for part in parts):
        return None
    evidence = " + ".join(piece for part in parts for piece in part)
    if case is None and "backend" in bug.when:
        evidence += f"; affects {'/'.join(bug.when['backend'])}"
    return Match(bug=bug, scope=bug.scope, evidence=evidence)


def match_environment(
    bugs: Iterable[KnownBug], env: EnvReport, context: MatchContext | None = None
) -> list[Match]:
    """Bugs whose conditions are all about the machine (TE, cuDNN, sm, ...) and the run (default context).

    For `attn-doctor env`. ``context`` defaults to :meth:`MatchContext.from_env`.
    """
    context = context if context is not None else MatchContext.from_env(env)
    return [m for bug in bugs if (m := _evaluate(bug, env, None, context)) is not None]


def match_case(
    bugs: Iterable[KnownBug], env: EnvReport, case: Case, context: MatchContext | None = None
) -> list[Match]:
    """Every bug whose conditions hold on this machine, run, path and case, machine-level rules included
    (their path conditions are checked here: the context says which path ran)."""
    context = context if context is not None else MatchContext.from_env(env)
    return [m for bug in bugs if (m := _evaluate(bug, env, case, context)) is not None]


# --------------------------------------------------------------------------- symptoms and findings


def shows_symptom(symptom: str | None, probe: Probe) -> bool:
    """Whether a probe shows a defect's symptom: the backend did not run (SKIP) for "backend disabled", the
    kernel's own ERROR for an illegal memory access, NaN/Inf (or the kernel's ERROR) for NaN, differing
    repeats for nondeterminism, a failing out or gradient for wrong numbers. A FAIL without per-tensor
    verdicts (older documents) counts for every numerical symptom."""
    kernel_error = probe.verdict == "ERROR" and not probe.internal
    failed_whole = probe.verdict == "FAIL" and not probe.failing
    if symptom == "backend disabled":
        return probe.verdict == "SKIP"
    if symptom == "illegal memory access":
        return kernel_error
    if symptom == "NaN":
        return bool(probe.nonfinite) or kernel_error or failed_whole
    if symptom == "nondeterministic":
        return probe.nondeterministic
    if symptom == "wrong output":
        return "out" in probe.failing or failed_whole
    if symptom == "wrong gradient":
        return any(name != "out" for name in probe.failing) or failed_whole
    return probe.verdict == "FAIL" or kernel_error  # "mask leak", or a rule without a symptom


def _tells(symptom: str | None, probe: Probe) -> bool:
    """Whether a probe can show the symptom or its absence: one that did not run (SKIP) says nothing about
    wrong numbers, and attn-doctor's own ERROR nothing about anything."""
    if probe.internal:
        return False
    return symptom == "backend disabled" or probe.verdict != "SKIP"


def find_known_bugs(bugs: Iterable[KnownBug], env: EnvReport, probes: Sequence[Probe]) -> list[Finding]:
    """Every bug whose conditions hold for some probe that can tell: reproduced when one of them shows its
    symptom, "not reproduced here" when none does. Reproduced findings first, each in the data file's order."""
    findings: list[Finding] = []
    for bug in bugs:
        held = [(probe, m) for probe in probes
                if _tells(bug.symptom, probe) and (m := _evaluate(bug, env, probe.case, probe.context)) is not None]
        if not held:
            continue
        shown = [(p, m) for p, m in held if shows_symptom(bug.symptom, p)]
        quiet = tuple(p for p, _ in held if not shows_symptom(bug.symptom, p))
        first = (shown or held)[0][1]
        findings.append(Finding(bug, bool(shown), tuple(p for p, _ in shown), quiet, first.evidence))
    return sorted(findings, key=lambda f: not f.reproduced)


# --------------------------------------------------------------------------- lines


def _fix_and_workaround(bug: KnownBug) -> str:
    fixed = f"fixed in {bug.fixed_in}" if bug.fixed_in else "no fixed version known"
    return f"{fixed}; workaround: {bug.workaround}" if bug.workaround else fixed


def _headline(bug: KnownBug) -> str:
    symptom = f" ({bug.symptom})" if bug.symptom else ""
    return f"{bug.label}: {bug.title}{symptom}"


def describe(match: Match) -> str:
    """One machine-level line: the defect, the facts that matched, the fix and the workaround, where to read."""
    bug = match.bug
    return f"{_headline(bug)} — matches {match.evidence}; {_fix_and_workaround(bug)}. See {bug.reference}"


def _where(probes: Sequence[Probe], most: int = 6) -> str:
    """'te.fused, te.fused.det on transposed (b4 s1024 ...)': the paths by the layouts they share, then the case."""
    layouts: dict[str, list[str]] = {}
    for p in probes:
        places = layouts.setdefault(p.context.backend or "?", [])
        if (p.context.layout or "?") not in places:
            places.append(p.context.layout or "?")
    groups: dict[tuple[str, ...], list[str]] = {}
    for backend, places in layouts.items():
        groups.setdefault(tuple(places), []).append(backend)
    parts = []
    for places, backends in groups.items():
        shown = ", ".join(places[:most]) + (f" and {len(places) - most} more" if len(places) > most else "")
        parts.append(f"{', '.join(backends)} on {shown}")
    cases = list(dict.fromkeys(p.case.short() for p in probes))
    text = "; ".join(parts)
    return f"{text} ({cases[0]})" if len(cases) == 1 else f"{text} (in {len(cases)} cases, e.g. {cases[0]})"


def _absence(bug: KnownBug, probes: Sequence[Probe]) -> str:
    if bug.symptom == "backend disabled":
        ran = next((p.ran for p in probes if p.ran), "")
        return f"the backend ran ({ran})" if ran else "the backend ran"
    verdicts = sorted({p.verdict for p in probes})
    return "it passed" if verdicts == ["PASS"] else f"the symptom did not show ({', '.join(verdicts)})"


def describe_finding(finding: Finding) -> str:
    """One line for a run: "<paths> (<case>): this matches TE#NNNN: ..., fixed in X; workaround: Y" with the
    code line the rule names (what `report --format issue` shows as the suspected location), or "not
    reproduced here: TE#NNNN: ... — its conditions hold for <paths>, but it passed"."""
    bug = finding.bug
    if finding.reproduced:
        said = next((p.reason for p in finding.shown if p.reason), "") if bug.symptom == "backend disabled" else ""
        read = (f"Code: {bug.source}; see {bug.reference}" if bug.source and bug.source != bug.reference
                else f"See {bug.reference}")
        line = (f"{_where(finding.shown)}: this matches {_headline(bug)}; {_fix_and_workaround(bug)}. "
                f"Conditions: {finding.evidence}.{f' Skipped: {said}.' if said else ''} {read}")
        if finding.quiet:
            line += f" (Its conditions also hold for {_where(finding.quiet)}, where it did not show.)"
        return line
    return (f"not reproduced here: {_headline(bug)} — its conditions hold for {_where(finding.quiet)} "
            f"({finding.evidence}), but {_absence(bug, finding.quiet)}. See {bug.reference}")


def describe_run(bugs: Sequence[KnownBug], env: EnvReport, probes: Sequence[Probe]) -> list[str]:
    """The lines for a run: each finding on its probes (reproduced first), then the machine-level rules that
    match the machine but none of the probes (e.g. a path the run did not include)."""
    findings = find_known_bugs(bugs, env, probes)
    found = {f.bug.id for f in findings}
    machine = [m for m in match_environment(bugs, env) if m.bug.id not in found]
    return [describe_finding(f) for f in findings] + [describe(m) for m in machine]
