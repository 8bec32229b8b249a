"""The facts known-defect rules are checked against, and reading them off a machine and a results row.

A rule reads the machine (an `EnvReport`), how the attention ran (`MatchContext`: the run, and the path that
ran it) and the case; a run's rows become `Probe`s (`row_probe`), which add what each row showed. A fact that
is unknown is None, and the condition that needs it fails.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from packaging.version import InvalidVersion, Version

from attn_doctor.backends import match_context, match_format

if TYPE_CHECKING:
    from attn_doctor.core.case import Case
    from attn_doctor.machine.fingerprint import EnvReport, Fact
    from attn_doctor.results.row import Row


@dataclass(frozen=True)
class MatchContext:
    """How the attention is run, beyond the Case: the run (attn-doctor runs forward + backward, no FP8 etc.)
    and the path that ran it (unknown: None)."""

    # The run (attn-doctor's: forward and backward, eager, no KV cache, no activation recompute).
    training: bool = True
    deterministic: bool = False
    cuda_graph: bool = False
    kv_cache: bool = False
    recompute: bool = False
    # What the case sets about how the attention runs (`for_case`).
    fp8: bool = False
    softmax_sink: bool = False
    bias: bool = False
    # Context parallelism.
    context_parallel: bool = False
    cp_size: int = 1
    cp_comm_type: str | None = None
    # How the calls were made (a replayed call's capture says whether dO was strided unlike out).
    dout_strided: bool = False
    causal_with_explicit_mask: bool = False
    varying_cu_seqlens: bool = False
    # The path that ran it.
    qkv_format: str | None = None  # the backend's format (TE paths: the case's); None = unknown
    backend: str | None = None  # attn-doctor's path name, e.g. "te.fused.det"
    sub_backend: int | None = None  # TE's FusedAttention sub-backend as TE reported it
    layout: str | None = None  # attn-doctor's memory layout
    cudnn: str | None = None  # the cuDNN the path's own process reported loading (a TE row's, read back)
    te: str | None = None  # the TE the path's own process imported (a `--te` row's, read back), else the machine's

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
class Facts:
    """What one rule's conditions are checked against: the machine, the context and, for a probe, its case;
    with the rule's own conditions, which a check that reads two keys together (sm with sm_in, ...) looks at."""

    env: EnvReport
    context: MatchContext
    rule: Mapping[str, Any]
    probed: Case | None = None  # None at machine level (`attn-doctor env`), where no case condition is checked

    @property
    def case(self) -> Case:
        """The probe's case, which every case condition reads."""
        if self.probed is None:
            raise AssertionError("a case condition was checked without a probe")
        return self.probed


@functools.lru_cache(maxsize=256)  # a report's rows repeat the same few version strings thousands of times
def parse_version(text: str | None) -> Version | None:
    """'9.14.0 (91400)' -> Version('9.14.0'); '2.20.0.dev0+abc' as is; None when unreadable."""
    words = str(text).split() if text else []
    if not words:
        return None
    try:
        return Version(words[0])
    except InvalidVersion:
        m = re.match(r"\d+(?:\.\d+)*", words[0])
        return Version(m.group(0)) if m else None


def fact_version(fact: Fact | None) -> Version | None:
    """The version a fingerprint fact holds (None: not installed, not probed or unreadable)."""
    return parse_version(fact.value) if fact is not None else None


def parse_sm(text: str | None) -> int | None:
    """'sm_90' / 'sm90a' -> 90; None when unreadable."""
    m = re.fullmatch(r"\s*sm_?(\d+)[a-z]?\s*", text or "")
    return int(m.group(1)) if m else None


def loaded_cudnn(env: EnvReport, sdpa: bool, reported: str | None = None) -> tuple[Version | None, str]:
    """(version, whose): the cuDNN the path loads. SDPA paths load torch's; TE paths the one their process
    reported (`reported`: a row run on a chosen build), else TE's own, torch's when TE's is unknown."""
    torch_v = fact_version(env.torch_cudnn)
    if sdpa:
        return (torch_v, "torch's") if torch_v is not None else (None, "")
    if parse_version(reported) is not None:
        return parse_version(reported), "TE's, in this path's process"
    te_v = fact_version(env.te_cudnn)
    if te_v is not None:
        return te_v, "TE's"
    if torch_v is not None:
        return torch_v, "torch's; TE's unknown"
    return None, ""


def sub_backend_from_ran(ran: str) -> int | None:
    """TE's FusedAttention sub-backend in what a TE row ran ("FusedAttention (sub-backend 1: ...)")."""
    m = re.search(r"sub-backend (\d+)", ran or "")
    return int(m.group(1)) if m else None


def row_probe(row: Row, env: EnvReport, dout_strided: bool = False) -> Probe:
    """A results row as the rules read it: the case, the context its path ran in (the qkv format the rules
    are written for, what the path sets itself — TE's deterministic path is deterministic whatever the
    environment says —, the sub-backend TE reported, CP), and what it showed.

    ``dout_strided`` (the output gradient was strided unlike the output) is the one fact a row does not hold:
    only a replayed call's capture says it, and the caller reads it there.
    """
    spec, coords = row.coords.backend, row.coords
    context = MatchContext.for_case(
        env, row.case,
        qkv_format=match_format(spec, row.case),
        backend=row.backend,
        sub_backend=sub_backend_from_ran(row.ran),
        layout=row.layout,
        context_parallel=coords.cp > 1,
        cp_size=coords.cp,
        cp_comm_type=coords.cp_comm_type,
        dout_strided=dout_strided,
        cudnn=row.extra.get("cudnn") if isinstance(row.extra.get("cudnn"), str) else None,
        te=row.extra.get("te") if isinstance(row.extra.get("te"), str) else None,
        **match_context(spec),
    )
    return Probe(
        case=row.case,
        context=context,
        verdict=row.verdict,
        ran=row.ran,
        reason=row.reason,
        failing=frozenset(row.failing_tensors),
        nonfinite=frozenset(name for name, t in row.tensors.items() if t.nan or t.inf),
        nondeterministic=bool(row.differing_tensors),
        internal=row.internal,
    )
