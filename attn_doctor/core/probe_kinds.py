"""What each kind of probe accepts, in one table, with the words of its refusals.

A probe runs its backend in one of four ways (`ProbeKind`), and a single call of a replayed case (`attn-doctor
replay`, `run --replay`) is a fifth entry of the table: it is fed the captured call's own views. For each, the
table says whether it takes --repeats N > 1, which layouts it is fed and whether --layout chooses them, whether
q, k, v may come from another --inputs distribution, whether it models TE's API beyond the dense call
(`Case.api_features()`), and what else it needs of a case (heads that split into TP shards, self-attention, a
sequence that splits into CP chunks).

The request checks of run, sweep and bisect and `Coords.unsupported` read the table: a request's refusal is
the entry's words with the command's own fix-it suffix, a coordinate's SKIP reason the entry's words.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from attn_doctor.core.case import Case
from attn_doctor.core.layouts import CAPTURED, LAYOUTS, layout_unsupported


DEPTH_LAYOUT = "sbh3d_packed"  # the stack feeds attention Megatron's split of the mixed qkv tensor


class ProbeKind(str, Enum):
    """How a probe runs its backend. The values are what results files have always stored."""

    CALL = "layout"  # one call on one memory layout
    TP = "tp"
    DEPTH = "depth"
    DISTRIBUTED = "distributed"


@dataclass(frozen=True)
class KindRules:
    """What probes of one kind accept, and the words their refusals use."""

    kind: ProbeKind
    replayed: bool  # the single calls of a replayed case (`Case.replay`)
    name: str  # how a refusal names the kind, with the option that asks for it
    flag: str  # that option ("" where none does)
    repeats: bool  # --repeats N > 1: the call run N times on the same inputs, judged on the worst
    layouts: tuple[str, ...]  # the layouts its probes may be fed
    takes_layout: bool  # --layout chooses among `layouts` (each checked against the case)
    inputs: bool  # q, k, v drawn from any --inputs distribution
    te_api: bool  # TE's API beyond a dense sbhd/bshd call with a causal or no mask (`Case.api_features()`)
    splits_heads: bool = False  # the heads are split into --tp shards: heads and kv heads divide by the degree
    context_parallel: bool = False  # --cp > 1 splits the sequence over ranks (`context_parallel_unsupported`)
    layout_fed: str | None = None  # without `takes_layout`: what it is fed instead, as `run` refuses --layout
    off_layout: str | None = None  # the SKIP reason of coordinates at a layout not in `layouts`
    inputs_reason: str | None = None  # without `inputs`: why q, k, v are the kind's own
    inputs_skip: str | None = None  # without `inputs`: the SKIP reason of a case on {inputs}, not normal
    self_attention: str | None = None  # why it needs seq_kv == seq (the SKIP reason), or None

    def repeats_refusal(self, *, without: str) -> str:
        """Why --repeats N > 1 is refused for this kind (it would be silently ignored); `without` names the
        options to run the layouts without."""
        return (f"--repeats applies to single calls (the layouts); {self.name} run once: drop --repeats, or run the "
                f"layouts without {without}")

    def layout_refusal(self, *, explained: bool) -> str:
        """Why --layout is refused for this kind, naming it, or `explained`, saying what it is fed instead (its
        name where nothing more is said); the caller adds how to fix it."""
        return f"--layout does not apply to {self.layout_fed if explained and self.layout_fed else self.name}"

    def inputs_refusal(self) -> str:
        """Why --inputs is refused for this kind; the caller adds how to fix it."""
        return f"--inputs does not apply to {self.name}: {self.inputs_reason}"

    def unsupported(self, case: Case, layout: str, tp: int = 1, cp: int = 1, cp_comm_type: str | None = None
                    ) -> str | None:
        """Why a probe of this kind at these coordinates cannot hold its case (a SKIP reason, whatever the
        backend), or None."""
        if self.takes_layout and (why := layout_unsupported(layout, case)):
            return why
        if not self.te_api and case.api_features():
            return dense_api_skip(case)
        if self.splits_heads and (case.heads % tp or case.kv_heads % tp):
            return f"TP={tp} needs heads ({case.heads}) and kv heads ({case.kv_heads}) divisible by {tp}"
        if self.off_layout and layout not in self.layouts:
            return self.off_layout
        if self.self_attention and case.seq_kv != case.seq:
            return self.self_attention
        if not self.inputs and case.inputs != "normal":
            return self.inputs_skip.format(inputs=case.inputs)
        if self.context_parallel and cp > 1:
            return context_parallel_unsupported(case, tp, cp, cp_comm_type)
        return None


KIND_RULES: tuple[KindRules, ...] = (
    KindRules(ProbeKind.CALL, replayed=False, name="single calls", flag="", repeats=True,
              layouts=LAYOUTS, takes_layout=True, inputs=True, te_api=True),
    KindRules(ProbeKind.CALL, replayed=True, name="replayed calls (--replay)", flag="--replay", repeats=True,
              layouts=(CAPTURED, *LAYOUTS), takes_layout=True, inputs=True, te_api=True),
    KindRules(ProbeKind.TP, replayed=False, name="TP shards (--tp)", flag="--tp", repeats=False,
              layouts=("head_slice", "contiguous"), takes_layout=False, inputs=True, te_api=False, splits_heads=True,
              layout_fed="TP shards (they are fed as head-sliced views and as contiguous copies)",
              off_layout="TP shards are head-sliced views (layout head_slice) or contiguous copies (contiguous)"),
    KindRules(ProbeKind.DEPTH, replayed=False, name="depth stacks (--layers)", flag="--layers", repeats=False,
              layouts=(DEPTH_LAYOUT,), takes_layout=False, inputs=False, te_api=False, splits_heads=True,
              inputs_reason="each layer's q, k, v come from the stack's seeded weights",
              inputs_skip="the depth stack's q, k, v come from its seeded weights: inputs {inputs} applies to one "
                          "attention call, TP shards and ranks, not to --layers",
              self_attention="the depth stack is self-attention: it needs seq_kv == seq"),
    KindRules(ProbeKind.DISTRIBUTED, replayed=False, name="--nproc ranks", flag="--nproc", repeats=False,
              layouts=("contiguous",), takes_layout=False, inputs=True, te_api=False, splits_heads=True,
              context_parallel=True,
              layout_fed="--nproc runs (every rank gets its shard as a contiguous copy)"),
)

_BY_KIND = {(rules.kind, rules.replayed): rules for rules in KIND_RULES}


def rules_for(kind: ProbeKind, case: Case) -> KindRules:
    """The table's entry for probes of `kind` on `case` (a replayed case's single calls have their own)."""
    return _BY_KIND[(kind, kind is ProbeKind.CALL and case.replay is not None)]


def layout_choices() -> tuple[str, ...]:
    """Every layout --layout may name: those of the kinds it chooses for, in table order."""
    return tuple(dict.fromkeys(layout for rules in KIND_RULES if rules.takes_layout for layout in rules.layouts))


def dense_api_refusal(options: str, case: Case) -> str:
    """Why `options` (those asking for kinds of the dense API only) cannot take the case; the caller adds how
    to fix it."""
    return f"{options} model the dense API; this case uses {', '.join(case.api_features())}"


def dense_api_skip(case: Case) -> str:
    """The SKIP reason of a probe of the dense API only on a case that uses more of TE's API."""
    return (f"TP shards, depth stacks and ranks model the dense API only; this case uses "
            f"{', '.join(case.api_features())} (check it as a single call)")


def context_parallel_unsupported(case: Case, tp: int, cp: int, cp_comm_type: str | None) -> str | None:
    """Why CP ranks cannot split the case's sequence (a SKIP reason), or None."""
    if case.seq_kv != case.seq:
        return f"CP={cp} splits one sequence for q, k and v: it needs self-attention (seq_kv == seq)"
    if case.seq % (2 * cp):
        return (f"CP={cp} splits the sequence into {2 * cp} equal chunks: seq ({case.seq}) must be "
                f"divisible by {2 * cp}")
    if cp_comm_type == "a2a" and ((case.heads // tp) % cp or (case.kv_heads // tp) % cp):
        return (f"CP a2a regroups heads over {cp} ranks: heads per TP rank ({case.heads // tp}) and kv "
                f"heads per TP rank ({case.kv_heads // tp}) must be divisible by {cp}")
    return None
