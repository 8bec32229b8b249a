"""The contract every attention implementation meets: TE's paths, PyTorch's SDPA kernels, Megatron's local
attention and a user's own kernel are each a `Backend` subclass in a module of this package, listed in the
registry (`attn_doctor.backends.REGISTRY`). Nothing outside this package knows a backend by its family.

Two halves, like pytest's hookspecs, each hook small and optional unless marked:

In the parent process (class methods; no worker is started, nothing heavy is imported):
  `paths()`            the rows the family offers without user input: its `fixed_paths` (TE works them out)
  `static_skip()`      why a spec cannot run a case on a device, known before starting anything
  `memory()`           the working memory one call needs beyond its inputs, outputs and gradients
  `selector()`         the command-line option that picks a spec (`--backend NAME`, `--kernel SPEC`)
  `repro_source()`     the kernel part of the full standalone repro script (see `attn_doctor.bisect.repro`)
  `short_call()`       the kernel part of the short repro, written for one case (`ShortCall`; None: the full
                       form is written for this path)
  `match_format`       not None for a path known-defect rules are written for (TE's): they are matched with
                       the format it runs a case in (`format_for`)
  `match_context()`    how a spec runs beyond the machine's defaults, for those rules (TE's deterministic path:
                       {"deterministic": True})
  `probe_seconds`      per path, about how long one probe takes its worker on a GPU (a path not listed:
                       `DEFAULT_PROBE_SECONDS`): the cores a sweep gives each family
  `flash_style()`      whether the spec's backward takes the softmax backward's D = rowsum(dO * O) from the
                       output it returned, rounded (FlashAttention's way): its dQ and dK are then judged with what
                       that rounding makes (`attn_doctor.numerics.rounded_output`); False by default

In a worker process (an instance per spec, built after `prepare_process()` ran first in that process):
  `forward()`          required: out for q, k, v in `format_for(case)`, possibly non-contiguous views, and
                       the case's `Semantics` (explicit mask, bias, sink logits: `attn_doctor.numerics.masks`;
                       None for the dense probes). A path that is not TE's takes a thd case as padded tensors
                       and gets the lengths from the case.
  `sink_leaf()`        the tensor whose gradient is the learnable sink's (default: the semantics' sink logits,
                       which the forward must use through autograd; TE: its own `softmax_offset` parameter)
  `max_logit()`        the last forward's largest attention score per head ([heads]) where the case asks for it
                       (TE's return_max_logit) and the path computes one; None by default (not judged)
  `ran()`              what really ran for the last forward, read back from the library's own state
  `facts()`            the same readback as structured facts for the row's extra (TE: whether deterministic
                       mode was honoured); {} by default
  `attend_at()`        queries at given global positions against full keys: context parallelism done by
                       attn-doctor (each rank attends its sequence chunks)
  `run_parallel()`     a library that does tensor/context parallelism itself (`own_parallelism`: TE) runs
                       a rank's shard here

A backend refuses a case by raising `Unsupported` (a SKIP row with its reason), from its constructor or its
forward, when it can only tell once its library is loaded; anything else it raises is the kernel's error (an
ERROR row), never attn-doctor's.
"""

from __future__ import annotations

import shlex
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from attn_doctor.core.case import Case
from attn_doctor.core.coords import BackendSpec

if TYPE_CHECKING:
    import torch

    from attn_doctor.numerics.masks import Semantics

__all__ = ["Backend", "BackendSpec", "ParallelGroups", "PathMemory", "ShortCall", "Unsupported"]


@dataclass(frozen=True)
class ShortCall:
    """A path's part of the short repro (`attn_doctor.bisect.short_repro`). `fmt`: the format its kernel takes
    ("bshd", "sbhd", "thd"); `setup`: lines run before the script's functions (imports, the flags a library reads
    at import); `kernel`: the source of `kernel(q, k, v) -> out` on views in `fmt`, written for the case. It may use
    torch, math, os, DEVICE, DTYPE, B, S, SKV, H, HKV, D, DV, SCALE, the case's VISIBLE (None: all visible), BIAS
    (float64), BIAS_IN (as drawn), EXPLICIT, SINK, LENS_Q, LENS_KV and CU where the case has them, and `local`."""
    fmt: str
    setup: str
    kernel: str


def short_mask_code(case: dict[str, Any]) -> str:
    """The short repro's code for the boolean mask attn-doctor hands a kernel (`standalone.dense_allowed`):
    "None", "VISIBLE", or an all-True tensor of its shape where the script's VISIBLE is None because every query
    sees every key (the kernel still gets the tensor attn-doctor gives it)."""
    from attn_doctor.numerics import standalone

    explicit = standalone.draw_side_inputs(case, "cpu")[0]
    allowed = standalone.dense_allowed(case, explicit, "cpu")
    if allowed is None:
        return "None"
    if bool(allowed.all()):
        return f"torch.ones({tuple(allowed.shape)}, dtype=torch.bool, device=DEVICE)"
    return "VISIBLE"


class Unsupported(Exception):
    """The kernel path refuses this case here (a SKIP row with this reason), as opposed to crashing."""


@dataclass(frozen=True)
class PathMemory:
    """Bytes one call needs beyond its inputs, outputs and gradients: kept from the forward for the backward
    (`saved`, what a stack of L layers holds L times) and the peak of the scratch on top (`transient`)."""

    saved: int = 0
    transient: int = 0


@dataclass
class ParallelGroups:
    """What a rank of a distributed probe hands a backend that does its own parallelism (`run_parallel`)."""

    tp: int
    tp_group: Any
    cp: int
    cp_group: Any
    cp_ranks: list[int]
    cp_comm_type: str | None


DEFAULT_PROBE_SECONDS = 0.1  # a probe of a path whose family does not say (`Backend.probe_seconds`)


class Backend(ABC):
    """An attention forward whose backward comes from autograd. See the module docstring for the hooks."""

    family: ClassVar[str]  # the registry key: one worker process per family runs its specs
    qkv_format: ClassVar[str] = "bshd"  # the format forward receives and returns: "bshd" or "sbhd"
    match_format: ClassVar[str | None] = None
    # How `attend_at` computes a CP rank's queries (shown with distributed results).
    cp_method: ClassVar[str] = "queries at their global positions in a zero-padded causal sequence"
    own_parallelism: ClassVar[bool] = False  # the library splits heads and sequence itself (`run_parallel`)
    loads_cudnn: ClassVar[bool] = False  # `--cudnn` picks the cuDNN build its process loads (`process_environment`)
    # The paths a family always offers, (name, options) each; `paths` may work out others at run time.
    fixed_paths: ClassVar[tuple[tuple[str, dict[str, Any]], ...]] = ()
    # A whole layer around the attention (TE's MultiheadAttention, TransformerLayer): its single call is a layer
    # probe (`attn_doctor.probes.module`) on the layout `own_layout` names, judged against its own yardsticks.
    layer_path: ClassVar[bool] = False
    # Run only when named (--backend NAME or its family), not by a run that names no backend.
    opt_in: ClassVar[bool] = False
    # The options a spec of this family cannot be rebuilt without (text each): a results row read back must have them.
    required_options: ClassVar[tuple[str, ...]] = ()
    # Per path name, about how many seconds of its worker's time one probe takes on a GPU, mostly its library's first
    # calls (building kernels): a sweep's cores are shared among the families in proportion (`execution.concurrency`).
    probe_seconds: ClassVar[dict[str, float]] = {}

    # -- in the parent ----------------------------------------------------------------------------------

    @classmethod
    def paths(cls) -> list[BackendSpec]:
        return [BackendSpec(name, cls.family, dict(options)) for name, options in cls.fixed_paths]

    @classmethod
    def format_for(cls, case: Case) -> str:
        """The format forward receives q, k, v in for this case: the family's own by default (TE: the case's
        qkv_format, thd included)."""
        return cls.qkv_format

    @classmethod
    def static_skip(cls, spec: BackendSpec, case: Case, device: str) -> str | None:
        return None

    @classmethod
    def own_layout(cls, spec: BackendSpec) -> str | None:
        """The one layout a path that makes its own q, k, v (a layer path) is planned on; None: the run's layouts."""
        return None

    @classmethod
    def memory(cls, spec: BackendSpec, case: Case) -> PathMemory:
        """Linear-memory kernels need nothing worth counting; one that materialises the scores says so."""
        return PathMemory()

    @classmethod
    def selector(cls, spec: BackendSpec) -> str:
        return f"--backend {shlex.quote(spec.name)}"

    @classmethod
    def process_environment(cls, spec: BackendSpec) -> dict[str, str]:
        """Variables the process that runs `spec` must start with (a cuDNN build TE is to load); {} for none.
        Specs that need different ones run in different worker processes."""
        return {}

    @classmethod
    def match_context(cls, spec: BackendSpec) -> dict[str, Any]:
        """Known-defect context fields (`attn_doctor.known_defects.MatchContext`) this spec sets
        whatever the machine's environment says; {} when it runs as the environment has it."""
        return {}

    @classmethod
    def flash_style(cls, spec: BackendSpec) -> bool:
        return False

    @classmethod
    @abstractmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        """Python source defining FORMAT ("bshd", "sbhd" or "thd") and `kernel(q, k, v, case) -> out` for the
        standalone repro; it may use what the script defines before it (`attn_doctor.numerics.standalone`'s
        functions, `visible`, `added_bias`, `megatron_local`, EXPLICIT, BIAS, CU_SEQLENS, DEVICE, torch, F, os;
        `case` is `Case.plain()` with the call's `sink`)."""

    @classmethod
    def short_call(cls, spec: BackendSpec, case: Case) -> ShortCall | None:
        """The short repro's call for `case`; None where only the full form reproduces it."""
        return None

    @classmethod
    def prepare_process(cls) -> dict[str, Any]:
        """Runs first in a worker or rank process, before torch touches cuDNN; returns facts about the
        library it loaded for the machine fingerprint (e.g. {"te_facts": ...})."""
        return {}

    # -- in a worker process ----------------------------------------------------------------------------

    def __init__(self, spec: BackendSpec):
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor: ...

    def sink_leaf(self, semantics: Semantics) -> torch.Tensor | None:
        """The tensor the learnable sink's gradient is taken with respect to, after a forward."""
        return semantics.sink

    def max_logit(self) -> torch.Tensor | None:
        """The last forward's max logit per head ([heads]), or None where this path returns none."""
        return None

    def ran(self, out: torch.Tensor) -> str:
        return self.name

    def facts(self) -> dict[str, Any]:
        """What the library reported about the last forward beyond `ran`, as plain JSON values for the
        row's extra; read back, never assumed from what was asked."""
        return {}

    def attend_at(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                  case: Case) -> torch.Tensor:
        """out [b, len(positions), h, d] for queries q at global `positions` against the full k, v (all bshd),
        under the case's mask. The default serves a kernel that takes no mask: the queries are placed at
        their positions in an otherwise zero query sequence and the kernel runs on the full length; the
        padded rows get zero output gradient, so they add nothing to dk, dv."""
        import dataclasses

        from attn_doctor.numerics import views

        fmt = self.format_for(case)
        full_case = dataclasses.replace(case, seq=k.shape[1])
        full = q.new_zeros(q.shape[0], k.shape[1], *q.shape[2:]).index_copy(1, positions, q)
        out = self.forward(views.to_format(full, fmt), views.to_format(k, fmt), views.to_format(v, fmt),
                           full_case)
        return views.to_bshd(out, fmt).index_select(1, positions)

    def run_parallel(self, groups: ParallelGroups, case: Case, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, dout: torch.Tensor) -> tuple[list[torch.Tensor], str]:
        """With `own_parallelism`: a rank's shard computed by the library's own TP/CP (q, k, v, dout: the
        rank's bshd shards, CP chunks in TE's load-balanced order) -> ([out, dq, dk, dv] bshd, what ran).
        Without it, attn-doctor splits the work itself (`attend_at`)."""
        raise NotImplementedError(f"{type(self).__name__} does no tensor/context parallelism of its own")
