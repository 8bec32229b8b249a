"""The condition table: every key a rule's ``[bug.when]`` may hold, declared once, with its scope, the kind of
value it takes (and, for a list of names, the vocabulary they come from: attn-doctor's own, never repeated
here) and the check that evaluates it against the facts, worded as the evidence shows it.

Loading validates a rule by this table; matching checks its conditions in the table's order, which is the
order evidence names the facts in. What each key means is documented in `attn_doctor.known_defects`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from attn_doctor.backends import path_names, without_build
from attn_doctor.backends.te import FUSED_SUB_BACKENDS
from attn_doctor.core.case import (
    BIAS_SHAPES,
    CALL_FORMATS,
    DTYPES,
    MASK_ALIASES,
    MASK_NAMES,
    SOFTMAX_TYPES,
    TE_FP8_RECIPES,
)
from attn_doctor.core.coords import TE_CP_COMM_TYPES
from attn_doctor.core.layouts import CAPTURED, LAYOUTS
from attn_doctor.known_defects.facts import Facts, fact_version, loaded_cudnn, parse_sm, parse_version

if TYPE_CHECKING:
    from attn_doctor.machine.fingerprint import EnvReport, Fact

# What a condition is about: the machine, how the attention is run, the path that ran it, or the case.
Scope = Literal["environment", "run", "path", "case"]
# The value a condition takes, as loading validates it: a PEP 440 specifier, a list of exact versions, true
# or false, a whole number (>= 0; "positive": >= 1), a list of positive whole numbers, a list of TE's
# FusedAttention sub-backends, a list of names from the condition's choices, a list of [d_qk, d_v] pairs,
# or [m, r] with 0 <= r < m.
Kind = Literal["specifier", "versions", "bool", "count", "positive", "ints", "sub_backends", "names", "pairs",
               "modulus"]

# TE's FusedAttention sub-backends by number, as TE reports them.
SUB_BACKENDS = {int(number): name for number, name in FUSED_SUB_BACKENDS.items()}


@dataclass(frozen=True)
class Outcome:
    """One condition checked: whether it holds and, when it does, the fact that made it hold as evidence
    shows it ("" when it names none)."""

    matched: bool
    label: str = ""


_FAILED = Outcome(False)

# A condition's check: its value in the rule and the facts -> whether it holds, and the evidence.
Check = Callable[[Any, Facts], Outcome]


@dataclass(frozen=True)
class Condition:
    """One key of ``[bug.when]``."""

    key: str
    scope: Scope
    kind: Kind
    check: Check  # keys read together share one check, which matching runs once (cudnn/cudnn_in, sm/sm_in)
    choices: tuple[str | int, ...] = ()  # what a "names" or "sub_backends" condition may list
    # A path condition that, in a rule about the machine alone, says what it affects instead of being checked.
    affected_path: bool = False

    @property
    def machine_level(self) -> bool:
        """Whether a rule holding it can still be about the machine alone (`attn-doctor env`)."""
        return self.scope in ("environment", "run") or self.affected_path


# --------------------------------------------------------------------------- checks


def _holds(matched: bool, label: str = "") -> Outcome:
    return Outcome(True, label) if matched else _FAILED


def _as_wanted(wanted: bool, actual: bool, yes: str, no: str) -> Outcome:
    """A true-or-false condition: it holds when the fact is as the rule wants, worded as the fact is."""
    return _holds(actual == wanted, yes if actual else no)


@functools.lru_cache(maxsize=1024)  # each (version, rule's range) pair is checked once per row otherwise
def _in_spec(version: Version, spec: str) -> bool:
    return SpecifierSet(spec).contains(version, prereleases=True)


def _version_of(fact: Callable[[EnvReport], Fact], shown: str) -> Check:
    """A specifier on an installed version, e.g. "TE 2.20.2"."""

    def check(spec: str, facts: Facts) -> Outcome:
        version = fact_version(fact(facts.env))
        return _holds(version is not None and _in_spec(version, spec), f"{shown} {version}")

    return check


def _te(spec: str, facts: Facts) -> Outcome:
    """A specifier on the TE the path ran: the release its process imported (`--te`, read back), else the
    machine's."""
    if facts.context.te is not None:
        version = parse_version(facts.context.te)
        return _holds(version is not None and _in_spec(version, spec), f"TE {version} (the path's own)")
    return _version_of(lambda env: env.te, "TE")(spec, facts)


def _sdpa_path(facts: Facts) -> bool:
    """Whether the cuDNN that counts is torch's: the path is an SDPA kernel (or, at machine level, every
    path the rule names is)."""
    if facts.context.backend is not None:
        return facts.context.backend.startswith("sdpa")
    backends = facts.rule.get("backend", [])
    return bool(backends) and all(b.startswith("sdpa") for b in backends)


def _cudnn(_value: object, facts: Facts) -> Outcome:
    """``cudnn`` and ``cudnn_in`` together, on the cuDNN the path loads: "cuDNN 9.14.0 (TE's)"."""
    version, whose = loaded_cudnn(facts.env, _sdpa_path(facts), facts.context.cudnn)
    if version is None:
        return _FAILED
    if "cudnn" in facts.rule and not _in_spec(version, facts.rule["cudnn"]):
        return _FAILED
    if "cudnn_in" in facts.rule and not any(version == Version(v) for v in facts.rule["cudnn_in"]):
        return _FAILED
    return Outcome(True, f"cuDNN {version} ({whose})")


def _flash_attn(spec: str, facts: Facts) -> Outcome:
    """A specifier on any installed flash-attn (v2, v3 or v4)."""
    installed = [v for v in map(fact_version, (facts.env.flash_attn or {}).values()) if v is not None]
    hit = next((v for v in installed if _in_spec(v, spec)), None)
    return _holds(hit is not None, f"flash-attn {hit}")


def _gpus(_value: object, facts: Facts) -> Outcome:
    """``sm`` and ``sm_in`` together: some GPU satisfies both. "sm_120" when every GPU does and all are the
    same; else the GPUs that do, "sm_120 (GPU 1)"."""
    rule, gpus = facts.rule, facts.env.gpus or ()
    known = [(gpu.index, sm) for gpu in gpus if (sm := parse_sm(gpu.sm)) is not None]
    hits = [(i, sm) for i, sm in known
            if ("sm" not in rule or _in_spec(Version(str(sm)), rule["sm"]))
            and ("sm_in" not in rule or sm in rule["sm_in"])]
    if not hits:
        return _FAILED
    if len(hits) == len(gpus) and len({sm for _, sm in hits}) == 1:
        return Outcome(True, f"sm_{hits[0][1]}")
    return Outcome(True, " / ".join(f"sm_{sm} (GPU {i})" for i, sm in hits))


def _flag(read: Callable[[Facts], bool], yes: str, no: str) -> Check:
    """A true-or-false fact, worded one way or the other."""
    return lambda wanted, facts: _as_wanted(wanted, bool(read(facts)), yes, no)


def _listed(read: Callable[[Facts], Any], shown: str) -> Check:
    """The fact is one of the rule's list (an unknown fact, None, is in none): "layout transposed"."""

    def check(allowed: list, facts: Facts) -> Outcome:
        actual = read(facts)
        return _holds(actual in allowed, f"{shown} {actual}")

    return check


def _backend_matches(name: str, wanted: Iterable[str]) -> bool:
    """A rule's path name matches itself and the paths under it ("te.fused" also "te.fused.det"), on whatever
    cuDNN build it ran ("te.fused@cudnn-9.19.0")."""
    name = without_build(name)
    return any(name == w or name.startswith(w + ".") for w in wanted)


def _backend(wanted: list[str], facts: Facts) -> Outcome:
    name = facts.context.backend
    return _holds(name is not None and _backend_matches(name, wanted), name or "")


def _sub_backend(wanted: list[int], facts: Facts) -> Outcome:
    number = facts.context.sub_backend
    if number not in wanted:
        return _FAILED
    return Outcome(True, f"sub-backend {number} ({SUB_BACKENDS[number]})")


def _dtype(wanted: list[str], facts: Facts) -> Outcome:
    """The case's dtype, or fp8 for an FP8 run."""
    dtypes = [facts.case.dtype] + (["fp8"] if facts.context.fp8 else [])
    hit = next((d for d in dtypes if d in wanted), None)
    return _holds(hit is not None, hit or "")


def _mask(wanted: list[str], facts: Facts) -> Outcome:
    mask = facts.case.mask
    return _holds(mask in [MASK_ALIASES.get(m, m) for m in wanted], f"mask {mask}")


def _window(wanted: bool, facts: Facts) -> Outcome:
    window = facts.case.window
    sliding = window is not None and window[0] != -1
    return _as_wanted(wanted, sliding, f"sliding window {window}", "no sliding window")


def _cross_attention(wanted: bool, facts: Facts) -> Outcome:
    case = facts.case
    return _as_wanted(wanted, case.seq != case.seq_kv, f"cross-attention (seq {case.seq} != seq_kv {case.seq_kv})",
                      "self-attention")


def _kv_shorter(wanted: bool, facts: Facts) -> Outcome:
    case = facts.case
    shorter = any(kv < q for q, kv in zip(case.lengths_q(), case.lengths_kv()))
    return _as_wanted(wanted, shorter, f"fewer keys than queries (seq {case.seq}, seq_kv {case.seq_kv})",
                      "no sequence with fewer keys than queries")


def _ragged(wanted: bool, facts: Facts) -> Outcome:
    case = facts.case
    ragged = any(n < case.seq for n in case.lengths_q()) or any(n < case.seq_kv for n in case.lengths_kv())
    return _as_wanted(wanted, ragged, "ragged sequence lengths", "full-length sequences")


def _not_multiple_of_2cp(wanted: bool, facts: Facts) -> Outcome:
    cp = facts.context.cp_size
    if cp <= 1:  # a condition about CP shards: without CP it cannot hold
        return _FAILED
    odd = [n for n in facts.case.lengths_q() if n % (2 * cp)]
    return _as_wanted(wanted, bool(odd), f"sequence length {odd[0] if odd else ''} not a multiple of 2 x CP {cp}",
                      f"every sequence length a multiple of 2 x CP {cp}")


_COMPARISONS: dict[str, Callable[[int, int], bool]] = {">": operator.gt, ">=": operator.ge, "<=": operator.le}


def _compare(read: Callable[[Facts], int], symbol: str, shown: str) -> Check:
    """A number of the case against the rule's bound: "seq_kv 2048 > 1024"."""
    compare = _COMPARISONS[symbol]

    def check(bound: int, facts: Facts) -> Outcome:
        number = read(facts)
        return _holds(compare(number, bound), f"{shown} {number} {symbol} {bound}")

    return check


def _not_multiple_of(read: Callable[[Facts], int], shown: str) -> Check:
    def check(step: int, facts: Facts) -> Outcome:
        number = read(facts)
        return _holds(number % step != 0, f"{shown} {number} not a multiple of {step}")

    return check


def _gqa(wanted: bool, facts: Facts) -> Outcome:
    case = facts.case
    return _as_wanted(wanted, case.kv_heads < case.heads, f"GQA ({case.heads}/{case.kv_heads} heads)", "no GQA")


def _head_dims_differ(wanted: bool, facts: Facts) -> Outcome:
    qk, v = facts.case.head_dim, facts.case.head_dim_v
    return _as_wanted(wanted, qk != v, f"d_qk {qk} != d_v {v}", f"d_qk == d_v == {qk}")


def _head_dim_v_not_in(excluded: list[int], facts: Facts) -> Outcome:
    v = facts.case.head_dim_v
    return _holds(v not in excluded, f"d_v {v} not in {{{', '.join(map(str, excluded))}}}")


# --------------------------------------------------------------------------- the table

# In the order evidence names the facts: the machine, the run, the path, the case.
CONDITIONS: tuple[Condition, ...] = (
    Condition("te", "environment", "specifier", _te),
    Condition("torch", "environment", "specifier", _version_of(lambda env: env.torch, "torch")),
    Condition("cudnn", "environment", "specifier", _cudnn),
    Condition("cudnn_in", "environment", "versions", _cudnn),
    Condition("flash_attn", "environment", "specifier", _flash_attn),
    Condition("sm", "environment", "specifier", _gpus),
    Condition("sm_in", "environment", "ints", _gpus),
    Condition("training", "run", "bool", _flag(lambda f: f.context.training, "training", "inference")),
    Condition("deterministic", "run", "bool", _flag(lambda f: f.context.deterministic,
                                                    "deterministic (NVTE_ALLOW_NONDETERMINISTIC_ALGO=0)",
                                                    "non-deterministic")),
    Condition("cuda_graph", "run", "bool", _flag(lambda f: f.context.cuda_graph, "CUDA-graph capture",
                                                 "no CUDA graphs")),
    Condition("fp8", "run", "bool", _flag(lambda f: f.context.fp8, "FP8", "no FP8")),
    Condition("context_parallel", "run", "bool", _flag(lambda f: f.context.context_parallel, "context parallelism",
                                                       "no context parallelism")),
    Condition("kv_cache", "run", "bool", _flag(lambda f: f.context.kv_cache, "KV cache", "no KV cache")),
    Condition("softmax_sink", "run", "bool", _flag(lambda f: f.context.softmax_sink,
                                                   "softmax sink (off-by-one/learnable)", "vanilla softmax")),
    Condition("bias", "run", "bool", _flag(lambda f: f.context.bias, "attention bias", "no bias")),
    Condition("dout_strided", "run", "bool", _flag(lambda f: f.context.dout_strided,
                                                   "output gradient strided unlike the output",
                                                   "output gradient strided like the output")),
    Condition("causal_with_explicit_mask", "run", "bool", _flag(lambda f: f.context.causal_with_explicit_mask,
                                                                "attention_mask with a causal mask type",
                                                                "no attention_mask beside causal")),
    Condition("varying_cu_seqlens", "run", "bool", _flag(lambda f: f.context.varying_cu_seqlens,
                                                         "calls with varying cu_seqlens", "fixed cu_seqlens")),
    Condition("recompute", "run", "bool", _flag(lambda f: f.context.recompute, "activation recompute", "no recompute")),
    Condition("cp_comm_type", "run", "names", _listed(lambda f: f.context.cp_comm_type, "cp_comm_type"),
              choices=TE_CP_COMM_TYPES),
    Condition("backend", "path", "names", _backend, choices=path_names(), affected_path=True),
    Condition("sub_backend", "path", "sub_backends", _sub_backend, choices=tuple(SUB_BACKENDS), affected_path=True),
    Condition("layout", "path", "names", _listed(lambda f: f.context.layout, "layout"), choices=LAYOUTS + (CAPTURED,)),
    Condition("dtype", "case", "names", _dtype, choices=DTYPES + ("fp8",)),
    Condition("qkv_format", "case", "names", _listed(lambda f: f.context.qkv_format, "qkv_format"),
              choices=CALL_FORMATS),
    Condition("mask", "case", "names", _mask, choices=MASK_NAMES),
    Condition("causal", "case", "bool", _flag(lambda f: f.case.causal, "causal", "non-causal")),
    Condition("window", "case", "bool", _window),
    Condition("cross_attention", "case", "bool", _cross_attention),
    Condition("seq_kv_shorter", "case", "bool", _kv_shorter),
    Condition("ragged", "case", "bool", _ragged),
    Condition("seq_kv_gt", "case", "count", _compare(lambda f: f.case.seq_kv, ">", "seq_kv")),
    Condition("seq_q_gt", "case", "count", _compare(lambda f: f.case.seq, ">", "seq")),
    Condition("seq_q_le", "case", "count", _compare(lambda f: f.case.seq, "<=", "seq")),
    Condition("seq_kv_not_multiple_of", "case", "positive", _not_multiple_of(lambda f: f.case.seq_kv, "seq_kv")),
    Condition("seq_kv_mod", "case", "modulus",
              lambda v, f: _holds(f.case.seq_kv % v[0] == v[1], f"seq_kv {f.case.seq_kv} = {v[1]} mod {v[0]}")),
    Condition("seqlens_not_multiple_of_2cp", "case", "bool", _not_multiple_of_2cp),
    Condition("batch_ge", "case", "count", _compare(lambda f: f.case.batch, ">=", "batch")),
    Condition("gqa", "case", "bool", _gqa),
    Condition("kv_heads_lt", "case", "positive",
              lambda v, f: _holds(f.case.kv_heads < v, f"{f.case.kv_heads} kv heads < {v}")),
    Condition("head_dim_qk_ge", "case", "count", _compare(lambda f: f.case.head_dim, ">=", "d_qk")),
    Condition("head_dim_v_ge", "case", "count", _compare(lambda f: f.case.head_dim_v, ">=", "d_v")),
    Condition("head_dim_in", "case", "ints", _listed(lambda f: f.case.head_dim, "d_qk")),
    Condition("head_dims_differ", "case", "bool", _head_dims_differ),
    Condition("head_dims_not_in", "case", "pairs",
              lambda v, f: _holds((f.case.head_dim, f.case.head_dim_v) not in v)),
    Condition("head_dim_v_not_in", "case", "ints", _head_dim_v_not_in),
    Condition("head_dim_v_not_multiple_of", "case", "positive", _not_multiple_of(lambda f: f.case.head_dim_v, "d_v")),
    Condition("fp8_recipe", "case", "names", _listed(lambda f: f.case.fp8, "FP8 recipe"), choices=TE_FP8_RECIPES),
    Condition("bias_shape", "case", "names", _listed(lambda f: f.case.bias.removeprefix("post_scale_bias:"), "bias"),
              choices=BIAS_SHAPES + ("alibi",)),
    Condition("softmax_type", "case", "names", _listed(lambda f: f.case.softmax, "softmax"), choices=SOFTMAX_TYPES),
    Condition("pad_between_seqs", "case", "bool", _flag(lambda f: f.case.pad_between_seqs, "pad_between_seqs",
                                                        "no padding between sequences")),
)

CONDITION_BY_KEY = {condition.key: condition for condition in CONDITIONS}
CONDITION_KEYS = tuple(CONDITION_BY_KEY)
# The keys by scope (the documentation's four groups).
ENV_KEYS, CONTEXT_KEYS, PATH_KEYS, CASE_KEYS = (
    tuple(c.key for c in CONDITIONS if c.scope == scope) for scope in ("environment", "run", "path", "case"))
# A rule whose keys are all among these is about the machine alone: it is matched without a probe.
MACHINE_LEVEL_KEYS = frozenset(c.key for c in CONDITIONS if c.machine_level)
