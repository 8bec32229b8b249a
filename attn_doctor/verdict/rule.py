"""PASS or FAIL for one tensor: is its error what a correct implementation in this dtype gets?

The error is measured against the scale of the terms the tensor is summed from, not only against the exact
tensor's norm (`attn_doctor.numerics.reference`, "Term magnitudes"): ||x - ref|| / scale, with
scale^2 = ||ref||^2 + the terms' root-sum-square squared. For ordinary inputs the scale is 1.4 to 2.5 times
||ref||, so this is the familiar relative error over a constant; where the exact tensor cancels (one key,
window 0,0, a saturated softmax, equal keys or values: dQ and dK are ~0) the relative error of every
correct kernel explodes (1e8 and more, measured) while the scaled error stays ~u, because a correct kernel's
rounding noise there is u times the terms, not u times their cancelled sum.

The rule, per tensor, on the scaled error, for the whole tensor and for its worst (batch, head) slice:

    err(candidate) <= MULTIPLE * yardstick,   yardstick = max(err(baseline), NOISE_EPS[dtype] * eps * g)

The yardstick is the local baseline's error on the same inputs: a trusted same-dtype implementation, the
one the bug reports compared against (Megatron's `local` core attention: bf16/fp16 matmuls, fp32 softmax,
probabilities rounded to the input dtype; on the H200 the least accurate correct path measured). It is
never below NOISE_EPS * eps * g (g >= 1: the noise's scale over the terms', larger where fp32 scores and
log-sum-exp round P, i.e. in fp32 with large logits; ~1 in bf16/fp16; see the reference's "Term
magnitudes"): where the exact result cancels, the baseline can be exact by luck (an fp32
autograd softmax backward returns 0 on a one-hot row) while a correct flash-style kernel returns rounding
noise, so a ratio to the baseline alone would call that noise a fault.

Why MULTIPLE = 3: FlashAttention asserts dq/dk/dv errors <= 3x a same-dtype PyTorch reference and out
<= 2x (tests/test_flash_attn.py); dynamo uses 2x, raised to 3x for bf16. Correct kernels measured on the
H200 stay within 1.1x of the baseline. A gradient that is 2% wrong in bf16 is about 5x the baseline.

Why NOISE_EPS: measured on correct CPU kernels (sdpa.math, sdpa.flash, local; benchmarks/
verdict_calibration.py), the scaled error is 0.1 to 0.4 eps in
bf16/fp16 on Gaussian inputs, and on the cancelling cases (one key, window 0,0, equal keys or values, huge
logits) at most 0.52 eps for the worst (batch, head) slice in bf16/fp16 and 1.62 eps in fp32, where the
baseline's own can be 0. So 3 x 0.25 eps (bf16/fp16) and 3 x 1 eps x g (fp32) cover every correct kernel's
noise with a margin of 1.4x and more, while staying at or below the baseline's own error on ordinary
bf16/fp16 inputs, where the rule is then a ratio to the baseline as before. In fp32, g (5 to 20 on
Gaussian inputs) makes the floor the yardstick: a fault must exceed a few 1e-6 of the terms' scale there,
still thousands of times below any fault worth reporting. A fault of 2% in bf16 is 1 to 1.7 eps of the
scale, above the 0.75 eps floor. Measured false alarms: none in 1,996 tensor verdicts of correct paths on
210 seeded cases over dtypes, shapes, masks, windows and input distributions, against 157 under the previous
rule (3x the baseline's relative error plus 0.1 eps / 1 eps); since the rules below, the same cases judged as a
run judges them (the baseline's own row and the other paths too: 3,360 verdicts) give no FAIL and no
INCONCLUSIVE (tests/test_verdict.py).

Systematic error: a correct kernel's rounding is uncorrelated with the exact result; a wrong scale, a
missing term or a biased conversion is not, and it can hide under the noise threshold (a dQ 1.01 times the
truth is 2.8x the baseline's error in bf16). `attn_doctor.numerics.metrics` measures the projection of the
error on the exact tensor, bias = <e, r>/<r, r>, and its significance bias_z (a self-normalised sum over
rows: for zero-mean rounding P(|z| >= t) <= 2 exp(-t^2/2)). A tensor FAILs for bias when all hold:
|bias_z| >= BIAS_Z (8: ~1e-14 by that bound), |bias| >= BIAS_EPS[dtype] * eps (one eps = two units of
roundoff: the most that rounding a value twice can bias it, so equal rows rounded alike cannot trip it;
fp32 accumulation-order effects reach a few eps, hence 8 there), |bias| >= MULTIPLE x the baseline's own
bias in that tensor, and the tensor does not cancel (cancellation >= CANCELLED: a bias relative to a
vanishing exact tensor means nothing). Checked for the whole tensor and for the (batch, head) slice with
the most significant bias, so a bias confined to one head is not diluted.

Flash-style paths: a backward that takes the softmax backward's row term D = rowsum(dO * O) from the output it
returned, rounded to the input dtype (FlashAttention's, cuDNN's fused attention, PyTorch's memory-efficient
kernel: `Backend.flash_style` declares which), makes an error in dQ and dK that an unfused backward such as the
baseline's does not: where keys and values share a large common direction, as a deep layer's do, it is several
times the baseline's error, in every correct flash-style kernel alike (`attn_doctor.numerics.rounded_output`;
on the H200, a Megatron GPT's 4th layer: dQ 1.2e-2 from float64 for TE's cuDNN path and PyTorch's flash,
efficient and cuDNN kernels, 2.1e-3 for the unfused ones; their worst head at 0.76-0.78 eps of the terms'
scale, over the 0.75 eps limit above, so every correct flash-style path FAILed there). So for a flash-style
path's dQ and dK, what a correct implementation gets is the baseline's error and that part together,
sqrt(err(baseline)^2 + err(part)^2), whole tensor and worst head: the two are independent roundings (and even
aligned they would stay within sqrt(2) of it, far inside MULTIPLE). The part is measured once per case, in
float64, from the exact output rounded to the dtype, as any kernel's error is; its systematic part joins the
baseline's in the bias limit. A wrong output never widens its own yardstick this way (the part is the case's, not
the kernel's), and out and dV, which D does not reach, are judged as before. Measured on the CPU (`--inputs
deep-layer`, b4 s1024 h16 d64 bf16 causal): PyTorch's flash kernel's dQ at 0.73 eps (worst head 0.79), the part
0.73 (0.79), the baseline 0.08: a limit of 2.2 eps instead of 0.75, while a dQ 1% or 5% too large still fails on
its systematic error, a D 1% off at 6x its yardstick (b2 h4), and on ordinary inputs the part is a fifth of the
baseline's error (the yardstick moves by 2%). On an H100, a Megatron GPT's captured 4th layer: TE's cuDNN path
and PyTorch's flash, efficient and cuDNN kernels at 0.695 eps, the part 0.695 (reports/h200/megatron/run-2).
The price: a flash-style dQ error that is not systematic and stays under MULTIPLE x the part is not told from
that rounding (on those inputs, a few percent of a dQ that cancels to a tenth of its terms).

Near the threshold: a verdict whose deciding quantity is within BORDERLINE (1.5x) of its threshold, on
either side, is borderline; reports say so and suggest the confirming check.

NaN or Inf in a tensor whose reference is finite fails outright (as PyTorch's SDPA tests do).

Rows that see no key (a bottom-right causal mask with more queries than keys, a window or an explicit mask
that hides a whole row) are not in any figure above: their exact output is an empty sum, and conventions
differ (TE and FlashAttention write 0, Megatron's -10000 fill writes the mean of v, a plain softmax NaN).
They have a rule of their own, TE's convention, which the float64 reference computes: out and dQ are 0 there
(they see nothing, so nothing flows back to them). A correct kernel writes exact zeros (no term is summed, so
nothing is rounded); the tensor FAILs when a value there exceeds EMPTY_ROW_EPS eps of the size of a compared
row (the RMS row norm of the exact tensor), or is NaN/Inf. Their effect on dK and dV (a kernel that lets an
empty row attend leaks gradient into keys) is in dK's and dV's ordinary comparison.

Padding (positions beyond a sequence's length) is never compared either; where a kernel writes non-zero
values into it (TE's kernels write zeros) the row is flagged, not failed: the values are garbage by
definition and nothing downstream reads them, but a user who does should know.

The learnable softmax sink's gradient (`dsink`, one value per head) is judged like any tensor, against
the baseline's error on it.

Cannot tell (INCONCLUSIVE): a verdict is only as good as its two yardsticks, the float64 reference and the
same-dtype baseline. Where either is not trustworthy for the inputs, the tensor is INCONCLUSIVE, with the
reason and the check that would decide, never PASS or FAIL, and the run exits 1 (a path that could not be
judged is not a success):
- The float64 reference holds NaN/Inf (the inputs are not finite, or overflow float64): the exact values are
  unknown there, so neither a NaN in the candidate nor its error on the rest can be judged. The same where the
  terms' scale itself is not finite, so no error can be measured against it (attn-doctor's limit, said so).
- float64's own rounding approaches the limit: a sum of n terms in float64 is off by at most n * 2^-53 of its
  terms' scale (the worst case of the textbook bound), and that must stay REFERENCE_HEADROOM (10x) below the
  largest error that passes. n is the longest sum a tensor is built from (`accumulation`); in fp32 it takes
  sums of some 3e8 terms to get there (3 x 2^-23 / (10 x 2^-53)), in bf16/fp16 far more.
- The baseline fails too: it returned NaN/Inf where float64 has none (its own row FAILs), so its error, taken
  over its finite entries, is no yardstick. A candidate's own NaN/Inf or writes into empty rows need none and
  still FAIL.
- The baseline is out of line with the other paths run on the same inputs (`attn_doctor.verdict.judge`): a
  tensor that FAILs against the baseline (or the noise floor under it) but passes against the median error of
  at least PEERS (2) paths of other families. A baseline far more accurate than every other implementation
  makes the ratio to it the baseline's story, not the kernel's; the paths of the judged one's own family are
  left out, so a fault shared by TE's paths is not vouched for by TE's paths. Only this direction: a tensor
  within MULTIPLE x the baseline's error passes, whatever the others get, as the rule promises; and a fixed limit
  on the baseline's own error cannot tell an inflated baseline from a correct one, measured: local rounds P to
  the input dtype, and its error reaches 4.2 eps of the terms' scale on the seeded "outliers" and "large-logits"
  cases (32 of 840 tensors beyond 3x the noise floor) while it is correct.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from attn_doctor.core.case import Case
from attn_doctor.numerics.metrics import TensorMetrics

# The rule's constants and checks are `standalone.judge_figures`'s, which the standalone repro scripts hold.
from attn_doctor.numerics.standalone import (
    BIAS_EPS,
    CANCELLED,
    EMPTY_ROW_EPS,
    EPS,
    FLOAT64_U,
    MULTIPLE,
    NOISE_EPS,
    judge_figures,
    tensor_kind,
)

PASS, FAIL, SKIP, ERROR, INCONCLUSIVE = "PASS", "FAIL", "SKIP", "ERROR", "INCONCLUSIVE"
# A probe that ran out of memory alone, within the memory budget (`attn_doctor.execution.session`): not judged, and
# no one's fault, the kernel's nor attn-doctor's; like SKIP, a request that cannot run here.
TOO_BIG = "TOO-BIG"
NOT_RUN = (SKIP, TOO_BIG)  # verdicts of probes that did not run here
CORE_TENSORS = ("out", "dq", "dk", "dv")  # what every call is judged on
TENSORS = CORE_TENSORS + ("dsink", "max_logit")  # with the learnable sink's gradient and TE's max logit where asked
BORDERLINE = 1.5
NOISE_YARDSTICK, BASELINE_YARDSTICK, FLASH_YARDSTICK = "rounding noise", "baseline", "flash-style backward"


@dataclass(frozen=True)
class TensorVerdict:
    rel_err: float  # ||x - ref|| / ||ref||: the familiar figure (meaningless where the tensor cancels)
    max_abs_err: float
    cosine: float
    worst_head_rel_err: float
    nan: int
    inf: int
    baseline_rel_err: float
    baseline_worst_head_rel_err: float
    ratio: float  # the deciding error over its yardstick: FAIL above MULTIPLE
    threshold: float  # the largest error that passes, in the units `shown_err` is in
    err_in_eps: float  # the scaled error in units of the dtype's machine epsilon
    verdict: str
    why: str
    # Defaults: what verdicts stored before these existed read as.
    scaled_err: float = math.nan  # ||x - ref|| / scale (see the module docstring)
    baseline_scaled_err: float = math.nan
    yardstick: float = math.nan  # the scaled error the ratio is taken to
    yardstick_kind: str = BASELINE_YARDSTICK
    cancellation: float = 1.0  # ||ref|| / scale
    worst_row_err: float | None = None  # the worst row's error over its own terms' scale (None: not measured)
    bias: float = 0.0
    bias_z: float = 0.0
    bias_failed: bool = False
    borderline: bool = False
    empty_rows: int = 0  # rows that see no key, judged on their own (see the module docstring)
    empty_rows_max: float = 0.0
    padding_nonzero: int = 0  # non-zero values written into padding (flagged, not failed)
    padding_values: int = 0
    # A flash-style path's dQ and dK: what a correct flash-style backward gets on these inputs, scaled like
    # `scaled_err` (the baseline's error and its output rounding's part together; None: not judged so)
    flash_style_err: float | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancellation < CANCELLED

    @property
    def shown_err(self) -> float:
        """The error a table shows: relative to the exact tensor, or to its terms' scale where it cancels."""
        return self.scaled_err if self.cancelled else self.rel_err

    def shown(self, scaled: float) -> float:
        """A figure on the terms' scale in the units `shown_err` is in."""
        return scaled if self.cancelled or math.isnan(self.scaled_err) else scaled / self.cancellation

    def to_dict(self) -> dict:
        d = asdict(self)
        for name in ("worst_row_err", "flash_style_err"):
            if d[name] is None:
                del d[name]  # not measured, or not judged so: as documents written before either had it
        return d


def figures_of(m: TensorMetrics) -> dict[str, float | int]:
    """m's figures as `judge_figures` reads them; metrics stored before the scaled errors existed are judged on
    their relative ones."""
    figures = m.figures()
    if math.isnan(m.scaled_err):
        figures.update(scaled=m.rel_err, worst=m.worst_head_rel_err)
    return figures


def accumulation(case: Case, name: str) -> int:
    """The longest sum a tensor is built from, in terms (what float64's own rounding grows with): the scores
    over the head dims, the softmax and the products over both lengths; the sink's gradient over every row."""
    terms = case.seq + case.seq_kv + case.head_dim + case.head_dim_v
    return terms + case.batch * case.seq if tensor_kind(name) == "dsink" else terms


def judge_tensor(name: str, candidate: TensorMetrics, baseline: TensorMetrics, dtype: str,
                 terms: int = 0, flash_style: TensorMetrics | None = None) -> TensorVerdict:
    """`terms`: the tensor's `accumulation` (0: not known). `flash_style`: for a flash-style path's dQ and dK,
    the error its output rounding makes on these inputs (see the module docstring); None otherwise."""
    kind = tensor_kind(name)
    multiple = MULTIPLE[kind]
    figures, base = figures_of(candidate), figures_of(baseline)
    flash = figures_of(flash_style) if flash_style is not None else None
    found = judge_figures(figures, base, dtype, multiple, terms, flash)
    err, head_err, noise, yardstick = figures["scaled"], figures["worst"], found["noise"], found["yardstick"]
    correct = found["correct"]
    yardstick_kind = _kind(base["scaled"], correct["scaled"], noise)
    cancellation = candidate.cancellation if not math.isnan(candidate.scaled_err) else 1.0
    # Display units: relative to ||ref||, or to the terms' scale where the tensor cancels.
    to_shown = 1.0 if cancellation < CANCELLED or math.isnan(candidate.scaled_err) else 1 / cancellation
    failed = found["failed"]
    if failed == "nonfinite":
        why = f"{candidate.nan} NaN and {candidate.inf} Inf where float64 has none"
    elif failed == "empty rows":
        values = (f"{candidate.empty_rows_nonfinite} NaN/Inf" if candidate.empty_rows_nonfinite
                  else f"values up to {candidate.empty_rows_max:.3g} of a row's size")
        why = (f"{values} on the {candidate.empty_rows} rows that see no key, where TE's convention (and "
               f"float64) is 0 (limit {EMPTY_ROW_EPS:g} eps)")
    elif failed == "error":
        why = _error_why("error", err, yardstick, multiple, yardstick_kind, to_shown, cancellation < CANCELLED,
                         noise, dtype, base["scaled"])
    elif failed == "worst head":
        head_noise = found["head_noise"]
        head_kind = _kind(base["worst"], correct["worst"], head_noise)
        # Per-head figures are on the scaled footing (each head cancels, or not, on its own).
        why = _error_why("worst head's error", head_err, found["head_yardstick"], multiple, head_kind,
                         1.0 if math.isnan(candidate.scaled_err) else None, cancellation < CANCELLED, head_noise,
                         dtype, base["worst"])
    elif failed:  # the error alone passes: the failure is the systematic error
        where = " in one (batch, head) slice" if failed == "head bias" else ""
        why = (f"systematic error{where}: {1 + found['bias']:.4f}x the exact values (z = {found['bias_z']:.0f}), "
               f"beyond the {found['bias_limit']:.2g} a correct {dtype} kernel's rounding can bias it (the larger "
               f"of {BIAS_EPS[dtype]:g} eps and {multiple:g}x the baseline's own bias)")
    else:
        why = ""
    undecided = found["inconclusive"]
    if undecided:
        why = _inconclusive_why(undecided, found, figures, base, multiple, terms)
    return TensorVerdict(
        rel_err=candidate.rel_err,
        max_abs_err=candidate.max_abs_err,
        cosine=candidate.cosine,
        worst_head_rel_err=candidate.worst_head_rel_err,
        nan=candidate.nan,
        inf=candidate.inf,
        baseline_rel_err=baseline.rel_err,
        baseline_worst_head_rel_err=baseline.worst_head_rel_err,
        ratio=found["ratio"],
        threshold=multiple * yardstick * to_shown,
        err_in_eps=err / EPS[dtype],
        verdict=INCONCLUSIVE if undecided else FAIL if failed else PASS,
        why=why,
        scaled_err=err,
        baseline_scaled_err=base["scaled"],
        yardstick=yardstick,
        yardstick_kind=yardstick_kind,
        cancellation=cancellation,
        worst_row_err=None if math.isnan(candidate.worst_row_scaled_err) else candidate.worst_row_scaled_err,
        bias=candidate.bias,
        bias_z=candidate.bias_z,
        bias_failed=failed in ("bias", "head bias"),
        borderline=1 / BORDERLINE <= found["margin"] <= BORDERLINE,
        empty_rows=candidate.empty_rows,
        empty_rows_max=candidate.empty_rows_max,
        padding_nonzero=candidate.padding_nonzero,
        padding_values=candidate.padding_values,
        flash_style_err=correct["scaled"] if flash is not None else None,
    )


def _kind(baseline: float, correct: float, noise: float) -> str:
    """What a yardstick rests on: rounding noise where it is the larger, else the flash-style backward's own
    rounding where its part exceeds the baseline's error (`correct` > sqrt(2) x `baseline`), else the baseline."""
    if correct < noise:
        return NOISE_YARDSTICK
    return FLASH_YARDSTICK if correct > math.sqrt(2) * baseline else BASELINE_YARDSTICK


def _inconclusive_why(reason: str, found: dict, figures: dict, base: dict, multiple: float, terms: int) -> str:
    """Why no verdict can be given, and the check that would decide (see the module docstring)."""
    nonfinite = max(figures["ref_nonfinite"], base["ref_nonfinite"])
    if reason == "reference" and nonfinite:
        return (f"cannot tell: the float64 reference holds {nonfinite} NaN/Inf values (the inputs are "
                "not finite, or overflow float64), so the exact values are unknown there; check: run it on finite "
                "inputs (replay a call from before the values diverged)")
    if reason == "reference":
        return ("cannot tell: attn-doctor's float64 reference could not size this tensor's terms on these inputs "
                "(their scale is not finite), so its error has no yardstick: a limit of attn-doctor's, not the "
                "kernel's; check: report it to attn-doctor with the case, and compare the relative errors meanwhile")
    if reason == "float64":
        bound = terms * FLOAT64_U
        return (f"cannot tell: float64's own rounding over sums of {terms} terms (up to {bound:.2g} of their scale) "
                f"approaches the largest error that passes ({multiple * found['yardstick']:.2g}); check: bisect to a "
                "shorter case, where float64 is exact enough")
    return (f"cannot tell: the local baseline itself returned {base['nan']} NaN and {base['inf']} Inf where float64 "
            "has none, so its error is no yardstick here; check: the baseline's own row, and another correct path "
            "on the same inputs (--backend sdpa.math)")


def _error_why(what: str, err: float, yardstick: float, multiple: float, kind: str, to_shown: float | None,
               cancelled: bool, noise: float, dtype: str, baseline: float = math.nan) -> str:
    """One line: the error, the yardstick it was compared with, and why that yardstick. `to_shown` converts
    scaled figures into the ones tables show; None: give them on the terms' scale."""
    units = "relative" if to_shown is not None and not cancelled else "of its terms' scale"
    to_shown = 1.0 if to_shown is None else to_shown
    if kind == BASELINE_YARDSTICK:
        because = "the local baseline's own error on these inputs"
    elif kind == FLASH_YARDSTICK:
        because = (f"what a correct flash-style backward gets on these inputs: the baseline's error, "
                   f"{baseline * to_shown:.2g}, and what taking D from its output rounded to {dtype} adds")
    else:
        because = (f"rounding noise, {noise / EPS[dtype]:.2g} eps of the terms' scale: the baseline's own error "
                   "is below it" + (", as the exact tensor cancels here" if cancelled else ""))
    return (f"{what} {err * to_shown:.3g} ({units}) > {multiple:g} x {yardstick * to_shown:.3g} "
            f"({because})")


def flash_style_note(name: str, t: TensorVerdict) -> str:
    """For a passing flash-style tensor whose yardstick rested on the flash-style backward's own rounding: its
    error, what a correct flash-style backward gets here and what the (unfused) baseline gets ("" otherwise)."""
    if t.verdict != PASS or t.yardstick_kind != FLASH_YARDSTICK or t.flash_style_err is None:
        return ""
    return (f"{name} {t.shown_err:.2g}: within what a correct flash-style backward gets here, "
            f"{t.shown(t.flash_style_err):.2g}; the unfused baseline gets {t.shown(t.baseline_scaled_err):.2g}")


def combine(verdicts: list[str]) -> str:
    """One verdict for several: ERROR beats FAIL beats INCONCLUSIVE beats PASS; all SKIP is SKIP."""
    for v in (ERROR, FAIL, INCONCLUSIVE, PASS):
        if v in verdicts:
            return v
    return SKIP


def multiple_text() -> str:
    """The baseline multiple as a caption writes it: "3×" (or per tensor, should they ever differ)."""
    values = set(MULTIPLE.values())
    if len(values) == 1:
        return f"{values.pop():g}×"
    return ", ".join(f"{value:g}× for {name}" for name, value in MULTIPLE.items())


def floor_text() -> str:
    """The rounding-noise floors as a caption writes them: "0.25 ε in bf16/fp16, 1 ε in fp32"."""
    by_floor: dict[float, list[str]] = {}
    for dtype, floor in NOISE_EPS.items():
        by_floor.setdefault(floor, []).append(dtype)
    return ", ".join(f"{floor:g} ε in {'/'.join(dtypes)}" for floor, dtypes in by_floor.items())


def rule_sentence() -> str:
    """The FAIL rule in one sentence, for reports and captions."""
    return (f"A tensor FAILs above {multiple_text()} the baseline's error (never less than rounding noise: "
            f"{floor_text()} of its terms' scale), on a systematic error beyond rounding, or on NaN/Inf.")
