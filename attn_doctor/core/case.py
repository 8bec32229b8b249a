"""The attention problem to check, in TE's vocabulary: shapes, dtype, qkv format, mask type, sequence
lengths, window, bias, softmax type, MLA head dims, FP8, seed and input distribution, validated; and grids
of them.

Which (query, key) pairs a mask type lets through, and the side inputs (bias, explicit mask, sink logits)
drawn for a case, are in `attn_doctor.numerics.masks`. Dropout is always 0: attn-doctor compares
deterministic functions.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import shlex
from dataclasses import dataclass
from typing import Any

from attn_doctor.core.errors import BadInput

DTYPES = ("bf16", "fp16", "fp32")
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# TE's attn_mask_type names; "none" is accepted for "no_mask" (what attn-doctor called it before).
MASKS = ("no_mask", "causal", "causal_bottom_right", "padding", "padding_causal", "padding_causal_bottom_right",
         "arbitrary")
MASK_ALIASES = {"none": "no_mask"}
MASK_NAMES = MASKS + tuple(MASK_ALIASES)  # every name a mask may be given by
QKV_FORMATS = ("sbhd", "bshd", "thd")
# The formats an attention call takes q, k, v in: TE's, and a captured SDPA call's [b, h, s, d]
# (`attn_doctor.tracing.replay_case`), which is what a known-defect rule's qkv_format may name.
CALL_FORMATS = QKV_FORMATS + ("bhsd",)
# TE's core_attention_bias_type, with post_scale_bias's shape: "post_scale_bias:1hss" etc.
BIAS_SHAPES = ("1hss", "11ss", "b1ss", "bhss", "111s")
BIASES = ("no_bias", "alibi") + tuple(f"post_scale_bias:{shape}" for shape in BIAS_SHAPES)
SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")
# TE's FP8 attention recipes attn-doctor runs: delayed and current (per-tensor) scaling, and MXFP8 (blocks of 32
# values along the head dim with a power-of-two scale each; Blackwell only, a SKIP with its reason elsewhere).
FP8_RECIPES = ("none", "delayed", "current", "mxfp8")
# TE's FP8 attention recipes: those attn-doctor runs (FP8_RECIPES but "none") and one it does not.
TE_FP8_RECIPES = FP8_RECIPES[1:] + ("blockwise",)
# The backward of FP8 attention: in FP8 (TE's default), or in F16/BF16 from the FP8 forward (NVTE_FP8_DPA_BWD=0).
FP8_BACKWARDS = ("fp8", "f16")
# Custom ALiBi slopes (TE's forward `alibi_slopes`): seeded per head ([heads]) or per sequence and head
# ([batch, heads]), as TE's custom-slopes tests draw them; or the user's own, one per head.
ALIBI_SLOPES = ("random", "random-batch")
# The explicit mask of mask "arbitrary": "random:P" masks each (query, key) pair out with probability P.
DEFAULT_MASKED_FRACTION = 0.25
# Case fields added with TE's whole API, and their defaults: a field at its default is left out of a case's
# dict, short form and flags, so cases, documents and point ids of the dense API read as they always did.
API_DEFAULTS: dict[str, Any] = {"qkv_format": "sbhd", "seqlens": None, "seqlens_kv": None,
                                "pad_between_seqs": False, "head_dim_v": None, "bias": "no_bias",
                                "softmax": "vanilla", "fp8": "none", "mask_source": None, "scale": None,
                                "replay": None, "alibi_slopes": None, "return_max_logit": False, "num_splits": 1,
                                "padding_mask": False, "forward_only": False, "fp8_backward": "fp8"}
# The distributions of q, k, v (`attn_doctor.numerics.inputs` says what each is and why), plainest first.
INPUTS = ("normal", "uniform", "outliers", "large-logits", "structured", "deep-layer")


@dataclass(frozen=True)
class Case:
    """One attention call. Defaults are the case of TE#1615 / Megatron-LM#1503 (GPT, 16 heads of 64)."""

    batch: int = 4
    seq: int = 1024
    heads: int = 16
    head_dim: int = 64
    kv_heads: int | None = None  # None at construction: same as heads (no GQA); always a number after it
    seq_kv: int | None = None  # None at construction: same as seq (self-attention); always a number after it
    dtype: str = "bf16"
    mask: str = "causal"
    # Sliding window (left, right) in TE's convention: query i sees keys [i-left, i+right]; -1 = unbounded.
    window: tuple[int, int] | None = None
    seed: int = 1234
    # The distribution q, k, v are drawn from (one of INPUTS). Shown, written and keyed only when it is not
    # "normal", so every case, document and point id of the plain distribution reads as it always did.
    inputs: str = "normal"
    # TE's qkv_format: how TE paths receive q, k, v (the other paths take their own format, thd as padded).
    qkv_format: str = "sbhd"
    # Per-sequence query / key-value lengths (TE's cu_seqlens); None: every sequence is seq / seq_kv long.
    seqlens: tuple[int, ...] | None = None
    seqlens_kv: tuple[int, ...] | None = None
    # thd only: each sequence's slot in the packed tensor has padding after it (cu_seqlens_*_padded).
    pad_between_seqs: bool = False
    head_dim_v: int | None = None  # MLA: v's (and out's) head dim; None at construction: head_dim
    bias: str = "no_bias"  # one of BIASES
    softmax: str = "vanilla"  # TE's softmax_type: one of SOFTMAX_TYPES (sinks)
    fp8: str = "none"  # TE's FP8 attention recipe: one of FP8_RECIPES
    mask_source: str | None = None  # mask "arbitrary": "random:P"
    scale: float | None = None  # TE's softmax_scale; None: 1/sqrt(head_dim)
    # A captured call this case replays (`attn_doctor.tracing.replay_case`): DIR@RANK.PID.INDEX. Its values (when
    # recorded) replace the seeded ones, and the `captured` layout rebuilds its exact views; both come from the
    # case's source (`attn_doctor.numerics.source`), so a case that names a call never reads its capture itself.
    replay: str | None = None
    # bias "alibi" with custom slopes (one of ALIBI_SLOPES, or one float per head); None: TE's own slopes.
    alibi_slopes: str | tuple[float, ...] | None = None
    # TE's return_max_logit: the forward also returns each head's largest attention score, judged like any output.
    return_max_logit: bool = False
    num_splits: int = 1  # TE's forward num_splits (FlashAttention 3's split control; other paths refuse it)
    # Padding masks: also pass TE's boolean attention_mask (True = padding) alongside cu_seqlens, as TE's tests do.
    padding_mask: bool = False
    # The forward alone (TE runs some of its tests so: biases without a backward), judged on out alone.
    forward_only: bool = False
    fp8_backward: str = "fp8"  # one of FP8_BACKWARDS: "f16" runs the backward of FP8 attention in F16/BF16

    def __post_init__(self) -> None:
        # One field each: left out, kv heads, the key length and v's head dim are the query side's.
        for name, same_as in (("kv_heads", "heads"), ("seq_kv", "seq"), ("head_dim_v", "head_dim")):
            if getattr(self, name) is None:
                object.__setattr__(self, name, getattr(self, same_as))
        for name in ("window", "alibi_slopes"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (tuple, str)):
                object.__setattr__(self, name, tuple(value))

    @property
    def mla(self) -> bool:
        """v's head dim differs from q's and k's (TE's MLA)."""
        return self.head_dim_v != self.head_dim

    @property
    def causal(self) -> bool:
        """A causal mask of either alignment, with or without padding."""
        return "causal" in self.mask

    @property
    def bottom_right(self) -> bool:
        """The causal diagonal is aligned to the bottom-right corner of each sequence's (seq_q, seq_kv)."""
        return self.mask.endswith("bottom_right")

    @property
    def padded(self) -> bool:
        """The mask has TE's padding part: sequences have their own lengths."""
        return self.mask.startswith("padding")

    def lengths_q(self) -> tuple[int, ...]:
        return self.seqlens if self.seqlens is not None else (self.seq,) * self.batch

    def lengths_kv(self) -> tuple[int, ...]:
        """The key/value lengths: their own, or under self-attention the queries' (TE's single cu_seqlens)."""
        if self.seqlens_kv is not None:
            return self.seqlens_kv
        if self.seqlens is not None and self.seq_kv == self.seq:
            return self.seqlens
        return (self.seq_kv,) * self.batch

    @property
    def masked_fraction(self) -> float:
        """mask "arbitrary": the fraction of (query, key) pairs its random mask hides."""
        if self.mask_source is None:
            return 0.0
        _, _, fraction = self.mask_source.partition(":")
        return float(fraction) if fraction else DEFAULT_MASKED_FRACTION

    def api_features(self) -> list[str]:
        """The parts of TE's API beyond a dense sbhd/bshd call with a causal or no mask: what the single-call
        probes cover and the TP, depth and distributed probes do not model."""
        return [name for name in API_DEFAULTS
                if name not in ("qkv_format", "mask_source") and not self.at_default(name)] + (
            [f"mask {self.mask}"] if self.mask not in ("no_mask", "causal") else []) + (
            ["thd"] if self.qkv_format == "thd" else [])

    def at_default(self, name: str) -> bool:
        """Whether an API field has its default (v's head dim: q's)."""
        return getattr(self, name) == (self.head_dim if name == "head_dim_v" else API_DEFAULTS[name])

    @property
    def score_elements(self) -> int:
        """How many (query, key) scores one attention call has: what a path that materialises them holds."""
        return self.batch * self.heads * self.seq * self.seq_kv

    @property
    def softmax_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim) if self.scale is None else self.scale

    @property
    def bias_shape(self) -> tuple[int, int, int, int]:
        """A post_scale_bias's tensor shape from its code (e.g. "1hss"): batch or 1, heads or 1, then the query
        length or 1, and the key length."""
        code = self.bias.partition(":")[2]
        sizes = {"1": 1, "b": self.batch, "h": self.heads}
        return sizes[code[0]], sizes[code[1]], self.seq if code[2] == "s" else 1, self.seq_kv

    def key(self) -> tuple:
        """Identity of the inputs: cases with equal keys get bitwise-equal q, k, v, dout. Kept once made (the case
        is frozen): a sweep's planning asks for it per probe, and `astuple` copies every field."""
        made = self.__dict__.get("_key")
        if made is None:
            made = dataclasses.astuple(self)
            object.__setattr__(self, "_key", made)
        return made

    def plain(self) -> dict[str, Any]:
        """Every field as a plain value, the softmax scale resolved, with what follows from the fields (each
        sequence's lengths, the explicit mask's masked fraction, the bias tensor's shape): the case as the
        torch-only numerics (`attn_doctor.numerics.standalone`) and the standalone repro's CASE take it."""
        return {**dataclasses.asdict(self), "scale": self.softmax_scale, "lengths_q": list(self.lengths_q()),
                "lengths_kv": list(self.lengths_kv()), "masked_fraction": self.masked_fraction,
                "bias_shape": list(self.bias_shape) if self.bias.startswith("post_scale_bias") else None}

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["window"] = list(self.window) if self.window is not None else None
        if self.inputs == "normal":  # absent means normal: documents written before --inputs read the same
            del d["inputs"]
        for name in API_DEFAULTS:
            if self.at_default(name):
                del d[name]
            elif isinstance(d[name], tuple):
                d[name] = list(d[name])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Case:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise BadInput(f"unknown case field(s) {', '.join(unknown)}; known fields: {', '.join(sorted(known))}")
        d = dict(d)
        if d.get("window") is not None:
            d["window"] = tuple(d["window"])
        return make_case(**d)

    def _api_parts(self) -> list[tuple[str, str]]:
        """(short form, `run` flag) of each API field not at its default, in table order."""
        parts = []
        if self.qkv_format != "sbhd":
            parts.append((self.qkv_format, f"--qkv-format {self.qkv_format}"))
        if self.seqlens is not None:
            lengths = ",".join(map(str, self.seqlens))
            parts.append((f"lens {lengths}", f"--seqlens {lengths}"))
        if self.seqlens_kv is not None and self.seqlens_kv != self.seqlens:
            lengths = ",".join(map(str, self.seqlens_kv))
            parts.append((f"kvlens {lengths}", f"--seqlens-kv {lengths}"))
        if self.pad_between_seqs:
            parts.append(("pad-between", "--pad-between-seqs"))
        if self.mla:
            parts.append((f"dv{self.head_dim_v}", f"--head-dim-v {self.head_dim_v}"))
        if self.bias != "no_bias":
            parts.append((self.bias.replace("post_scale_bias:", "bias:"), f"--bias {self.bias}"))
        if self.softmax != "vanilla":
            parts.append((f"softmax:{self.softmax}", f"--softmax {self.softmax}"))
        if self.fp8 != "none":
            parts.append((f"fp8:{self.fp8}", f"--fp8 {self.fp8}"))
        if self.mask_source is not None:
            parts.append((self.mask_source, f"--mask-source {self.mask_source}"))
        if self.scale is not None:
            parts.append((f"scale {self.scale:.6g}", f"--softmax-scale {self.scale!r}"))
        if self.replay is not None:
            parts.append((f"call {self.replay.rpartition('@')[2]}", f"--replay {shlex.quote(self.replay)}"))
        if self.alibi_slopes is not None:
            slopes = (self.alibi_slopes if isinstance(self.alibi_slopes, str)
                      else ",".join(f"{s:g}" for s in self.alibi_slopes))
            parts.append((f"slopes:{slopes}", f"--alibi-slopes {slopes}"))
        if self.return_max_logit:
            parts.append(("max-logit", "--max-logit"))
        if self.num_splits != 1:
            parts.append((f"splits {self.num_splits}", f"--num-splits {self.num_splits}"))
        if self.padding_mask:
            parts.append(("bool-mask", "--padding-mask"))
        if self.fp8_backward != "fp8":
            parts.append((f"bwd:{self.fp8_backward}", f"--fp8-backward {self.fp8_backward}"))
        if self.forward_only:
            parts.append(("fwd-only", "--forward-only"))
        return parts

    def describe_api(self) -> list[str]:
        """The API parts of the case in words, for short() and reports."""
        return [short for short, _ in self._api_parts()]

    def short(self) -> str:
        parts = [f"b{self.batch}", f"s{self.seq}"]
        if self.seq_kv != self.seq:
            parts.append(f"skv{self.seq_kv}")
        parts.append(f"h{self.heads}")
        if self.kv_heads != self.heads:
            parts.append(f"kv{self.kv_heads}")
        parts += [f"d{self.head_dim}", self.dtype, self.mask]
        if self.window is not None:
            parts.append(f"win{self.window[0]},{self.window[1]}")
        if self.inputs != "normal":
            parts.append(self.inputs)
        return " ".join(parts + self.describe_api())

    def cli_flags(self) -> str:
        """The `attn-doctor run` flags that rebuild this case."""
        flags = [
            f"--batch {self.batch}",
            f"--seq {self.seq}",
            f"--heads {self.heads}",
            f"--head-dim {self.head_dim}",
        ]
        if self.kv_heads != self.heads:
            flags.append(f"--kv-heads {self.kv_heads}")
        if self.seq_kv != self.seq:
            flags.append(f"--seq-kv {self.seq_kv}")
        flags += [f"--dtype {self.dtype}", f"--mask {self.mask}"]
        if self.window is not None:
            flags.append(f"--window {self.window[0]},{self.window[1]}")
        if self.inputs != "normal":
            flags.append(f"--inputs {self.inputs}")
        flags += [flag for _, flag in self._api_parts()]
        flags.append(f"--seed {self.seed}")
        return " ".join(flags)


def tp_shard(case: Case, tp: int) -> Case:
    """The case one of `tp` tensor-parallel head shards sees."""
    return dataclasses.replace(case, heads=case.heads // tp, kv_heads=case.kv_heads // tp)


def _positive(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{name} must be a whole number, got {value!r}")
    if value <= 0:
        raise BadInput(f"{name} must be at least 1, got {value}")
    return value


def _lengths(name: str, values: Any, longest: int | None) -> tuple[int, ...]:
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise BadInput(f"{name} must be a list of whole numbers (e.g. 512,387,257), got {values!r}")
    values = tuple(values)
    if not values or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in values):
        raise BadInput(f"{name} must be whole numbers >= 0, one per sequence (e.g. 512,387,257), got {values!r}")
    if longest is not None and max(values) > longest:
        raise BadInput(f"{name} {','.join(map(str, values))}: a sequence is longer than the padded length "
                       f"{longest}; raise --seq/--seq-kv or drop it to use the longest length")
    return values


def make_case(**fields: Any) -> Case:
    """Build a Case, refusing impossible combinations with a message that says how to fix them.

    With `seqlens` and no `batch` or `seq`, the batch is the number of sequences and seq the longest one (the
    same for `seqlens_kv` and `seq_kv`)."""
    fields = dict(fields)
    if fields.get("mask") in MASK_ALIASES:
        fields["mask"] = MASK_ALIASES[fields["mask"]]
    for name, seq_name in (("seqlens", "seq"), ("seqlens_kv", "seq_kv")):
        if fields.get(name) is not None:
            fields[name] = _lengths(name, fields[name], None)  # against the padded length: _check_lengths
            fields.setdefault("batch", len(fields[name]))
            if fields.get(seq_name) is None:
                fields[seq_name] = max(1, max(fields[name]))
    if fields.get("seqlens_kv") is not None and fields.get("seqlens") is None and fields.get("seq") is None:
        raise BadInput("--seqlens-kv needs --seqlens (or --seq): the query side's lengths")
    case = Case(**fields)
    case = _check_scale(case)  # equal cases compare and hash equal however they were spelled (__post_init__)
    for name in ("batch", "seq", "heads", "head_dim", "kv_heads", "seq_kv", "head_dim_v"):
        _positive(name, getattr(case, name))
    if case.heads % case.kv_heads:
        raise BadInput(
            f"heads ({case.heads}) must be divisible by kv-heads ({case.kv_heads}): "
            "each key/value head serves a whole group of query heads"
        )
    if case.dtype not in DTYPES:
        raise BadInput(f"unknown dtype {case.dtype!r}; choose one of {', '.join(DTYPES)}")
    if case.mask not in MASKS:
        raise BadInput(f"unknown mask {case.mask!r}; choose one of {', '.join(MASKS)} (or none = no_mask)")
    case = _check_lengths(case)
    if case.window is not None:
        left, right = case.window
        if any(not isinstance(w, int) or isinstance(w, bool) or w < -1 for w in (left, right)):
            raise BadInput(f"window must be two whole numbers >= -1 (LEFT,RIGHT; -1 = unbounded), got {case.window}")
        if case.causal and right not in (0, -1):
            raise BadInput("a causal mask already fixes the right window to 0; use --window LEFT,0 or --mask no_mask")
        if case.causal and right == -1:
            case = dataclasses.replace(case, window=(left, 0))
        if case.mask == "arbitrary":
            raise BadInput("TE takes no sliding window with an arbitrary mask; put the window into the mask or "
                           "use another mask type")
    if not isinstance(case.seed, int):
        raise BadInput(f"seed must be a whole number, got {case.seed!r}")
    if case.inputs not in INPUTS:
        raise BadInput(f"unknown inputs {case.inputs!r}; choose one of {', '.join(INPUTS)}")
    for name, allowed in (("qkv_format", QKV_FORMATS), ("bias", BIASES), ("softmax", SOFTMAX_TYPES),
                          ("fp8", FP8_RECIPES)):
        if getattr(case, name) not in allowed:
            raise BadInput(f"unknown {name.replace('_', '-')} {getattr(case, name)!r}; choose one of {', '.join(allowed)}")
    if not isinstance(case.pad_between_seqs, bool):
        raise BadInput(f"pad_between_seqs must be true or false, got {case.pad_between_seqs!r}")
    if case.pad_between_seqs and case.qkv_format != "thd":
        raise BadInput("--pad-between-seqs packs padding between sequences of a thd tensor; add --qkv-format thd")
    _check_mask_source(case)
    if case.fp8 != "none" and case.dtype == "fp32":
        raise BadInput("FP8 attention takes bf16 or fp16 inputs (TE quantises them); use --dtype bf16 with --fp8")
    return _check_call_options(case)


def _check_call_options(case: Case) -> Case:
    """The options of TE's call beyond the attention problem itself: custom ALiBi slopes, the max logit, num_splits,
    the boolean padding mask, the FP8 backward and forward-only."""
    slopes = case.alibi_slopes
    if slopes is not None:
        if case.bias != "alibi":
            raise BadInput("--alibi-slopes gives ALiBi's slopes: add --bias alibi")
        if isinstance(slopes, str):
            if slopes not in ALIBI_SLOPES:
                raise BadInput(f"--alibi-slopes {slopes!r}: expected {' or '.join(ALIBI_SLOPES)}, or one number per "
                               f"head (e.g. 0.5,0.25)")
        else:
            if any(isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) for s in slopes):
                raise BadInput(f"--alibi-slopes must be numbers, one per head, got {slopes!r}")
            if len(slopes) != case.heads:
                raise BadInput(f"--alibi-slopes gives {len(slopes)} slopes for {case.heads} heads; give one per head "
                               "(or random)")
            case = dataclasses.replace(case, alibi_slopes=tuple(float(s) for s in slopes))
    for name in ("return_max_logit", "padding_mask", "forward_only"):
        if not isinstance(getattr(case, name), bool):
            raise BadInput(f"{name} must be true or false, got {getattr(case, name)!r}")
    if isinstance(case.num_splits, bool) or not isinstance(case.num_splits, int) or case.num_splits < 1:
        raise BadInput(f"--num-splits must be a whole number >= 1, got {case.num_splits!r}")
    if case.padding_mask and not case.padded:
        raise BadInput("--padding-mask passes TE's boolean padding mask: it needs a padding mask type (e.g. --mask "
                       "padding_causal) and --seqlens")
    if case.padding_mask and case.qkv_format == "thd":
        raise BadInput("--padding-mask is TE's boolean mask of padded sbhd/bshd batches; thd has no padding to mask: "
                       "use --qkv-format bshd")
    if case.fp8_backward not in FP8_BACKWARDS:
        raise BadInput(f"unknown fp8-backward {case.fp8_backward!r}; choose one of {', '.join(FP8_BACKWARDS)}")
    if case.fp8_backward != "fp8" and case.fp8 == "none":
        raise BadInput("--fp8-backward chooses the backward of FP8 attention: add --fp8 delayed (or current)")
    if case.fp8_backward != "fp8" and case.forward_only:
        raise BadInput("--fp8-backward chooses a backward, and --forward-only runs none: drop one of them")
    return case


def _check_lengths(case: Case) -> Case:
    """Sequence lengths against the mask type and the format, as TE needs them."""
    if case.seqlens is not None and len(case.seqlens) != case.batch:
        raise BadInput(f"--seqlens gives {len(case.seqlens)} lengths for a batch of {case.batch}; give one per "
                       "sequence (the batch is their number when --batch is left out)")
    if case.seqlens_kv is not None:
        if len(case.seqlens_kv) != case.batch:
            raise BadInput(f"--seqlens-kv gives {len(case.seqlens_kv)} lengths for a batch of {case.batch}; give "
                           "one per sequence")
        if case.seqlens is not None and case.seqlens_kv == case.seqlens and case.seq_kv == case.seq:
            case = dataclasses.replace(case, seqlens_kv=None)  # self-attention: the kv lengths are the q ones
    elif case.seqlens is not None and case.seq_kv != case.seq:
        raise BadInput("cross-attention with --seqlens needs --seqlens-kv: the key/value sequences' lengths")
    for name in ("seqlens", "seqlens_kv"):
        values, longest = getattr(case, name), (case.seq if name == "seqlens" else case.seq_kv)
        if values is not None:
            _lengths(name, values, longest)
    ragged = case.seqlens is not None or case.seqlens_kv is not None
    if ragged and not case.padded:
        raise BadInput(f"sequence lengths need a padding mask type (TE ignores them otherwise): use --mask "
                       f"{'padding_' + case.mask if case.causal else 'padding'} instead of {case.mask}")
    if case.qkv_format == "thd":
        if not ragged:
            raise BadInput("--qkv-format thd packs sequences of given lengths: add --seqlens (e.g. 512,387,257)")
        if not case.padded:
            raise BadInput(f"thd needs a padding mask type: use --mask "
                           f"{'padding_' + case.mask if case.causal else 'padding'}")
    return case


def _check_scale(case: Case) -> Case:
    """A softmax scale is a positive number; 1/sqrt(head_dim), the default, is spelled None."""
    if case.scale is None:
        return case
    if isinstance(case.scale, bool) or not isinstance(case.scale, (int, float)) or not (
            0 < case.scale < math.inf):
        raise BadInput(f"softmax scale must be a positive number (e.g. 0.125), got {case.scale!r}")
    if math.isclose(case.scale, case.head_dim ** -0.5, rel_tol=1e-9):
        return dataclasses.replace(case, scale=None)
    return dataclasses.replace(case, scale=float(case.scale))


def _check_mask_source(case: Case) -> None:
    if case.mask != "arbitrary":
        if case.mask_source is not None:
            raise BadInput("--mask-source gives the explicit mask of --mask arbitrary; drop it or use that mask")
        return
    if case.mask_source == "captured":  # a replayed call's own mask (its source's)
        if case.replay is None:
            raise BadInput("--mask-source captured is a replayed call's own mask: use attn-doctor replay")
        return
    if case.mask_source is None:
        raise BadInput("--mask arbitrary needs the mask: add --mask-source random:P (each (query, key) pair masked "
                       f"out with probability P, e.g. random:{DEFAULT_MASKED_FRACTION})")
    kind, _, fraction = str(case.mask_source).partition(":")
    try:
        ok = kind == "random" and (not fraction or 0.0 <= float(fraction) <= 1.0)
    except ValueError:
        ok = False
    if not ok:
        raise BadInput(f"--mask-source {case.mask_source!r}: expected random:P with 0 <= P <= 1 (e.g. random:0.25)")
    if case.qkv_format == "thd":
        raise BadInput("TE takes an arbitrary mask for sbhd/bshd only; use --qkv-format bshd")


GRID_FIELDS = ("batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "dtype", "mask", "window", "seed",
               "inputs", "qkv_format", "seqlens", "seqlens_kv", "pad_between_seqs", "head_dim_v", "bias", "softmax",
               "fp8", "mask_source", "scale", "alibi_slopes", "return_max_logit", "num_splits", "padding_mask",
               "forward_only", "fp8_backward")


def expand_grid(base: dict[str, Any], grid: dict[str, list[Any]]) -> list[Case]:
    """The cross product of every gridded case field over the base fields, each validated, duplicates dropped."""
    unknown = sorted(set(grid) - set(GRID_FIELDS))
    if unknown:
        raise BadInput(f"cannot sweep over {', '.join(unknown)}; case fields are {', '.join(GRID_FIELDS)}")
    names = [n for n in GRID_FIELDS if n in grid]
    cases, seen = [], set()
    for values in itertools.product(*(grid[n] for n in names)):
        case = make_case(**{**base, **dict(zip(names, values))})
        if case.key() not in seen:
            seen.add(case.key())
            cases.append(case)
    return cases


def expand_grids(base: dict[str, Any], grids: list[dict[str, list[Any]]], drop_invalid: bool = False
                 ) -> tuple[list[Case], list[str]]:
    """The cases of several grids over one base, joined in order, duplicates dropped; with `drop_invalid`,
    the combinations that are not valid cases are left out and their reasons returned (once each), else the
    first one is refused."""
    cases, seen, dropped = [], set(), []
    for grid in grids or [{}]:
        unknown = sorted(set(grid) - set(GRID_FIELDS))
        if unknown:
            raise BadInput(f"cannot sweep over {', '.join(unknown)}; case fields are {', '.join(GRID_FIELDS)}")
        names = [n for n in GRID_FIELDS if n in grid]
        for values in itertools.product(*(grid[n] for n in names)):
            try:
                case = make_case(**{**base, **dict(zip(names, values))})
            except BadInput as exc:
                if not drop_invalid:
                    raise
                dropped.append(str(exc))
                continue
            if case.key() not in seen:
                seen.add(case.key())
                cases.append(case)
    return cases, dropped
