"""PASS or FAIL for a layer path's row (TE's MultiheadAttention or TransformerLayer: `attn_doctor.probes.module`),
and where in the layer a fault is.

Every tensor is judged by the single-call rule (`attn_doctor.verdict.rule.judge_tensor`, unchanged: 3x a
same-dtype yardstick's error from float64, never below rounding noise, a systematic error, NaN/Inf), each against
the yardstick measured beside it on the very same inputs in the layer probe:
- the core attention in the layer (`out`, `dq`, `dk`, `dv`), on the q, k, v and output gradient it received,
  against Megatron's local core attention on them: exactly what a single call is judged against, on the layer's
  own q, k, v; dQ and dK of a flash-style kernel (read back from TE) with what taking D from the rounded output
  adds (`attn_doctor.numerics.rounded_output`, as for a single call);
- the layer's stages (`layer_q`, `layer_k`, `layer_v`, `layer_dcontext`, `layer_out`, `layer_dx`) against its
  float64 replica, next to the same layer in the module's dtype in plain torch ops with the local attention on the
  same weights: what a correct implementation of the layer in this dtype gets. Forward stages are judged as an
  output (MULTIPLE["out"]), backward ones as a gradient; float64's own rounding is checked over the layer's
  longest sum (its hidden and ffn sizes too).
Why the same rule holds for the stages: the plain layer is a correct implementation of the same arithmetic
(bf16/fp16 GEMMs with fp32 accumulation, fp32 LayerNorm and RoPE rounded once, fp32 softmax), so a correct TE
layer's error stays within a small multiple of its error, as a correct kernel's stays within one of the local
baseline's; the tests hold a correct stand-in to PASS and faulty ones to FAIL at the right stage
(tests/test_te_module.py). fp32 is not judged (the module paths refuse it: TE's GEMMs may run in TF32 there).

Where: the core attention is judged on its own inputs, so its verdict does not depend on the rest of the layer;
a stage that fails while attention passes is a fault outside attention, named by the first failing stage in
the order the layer computes them: before attention (q, k, v as attention received them: QKV projection, its
LayerNorm, the split, RoPE), after it (the layer's output: output projection, residuals, MLP), the backward after
attention (the gradient that reached attention's output), the backward before it (dx). A stage that fails where
a fault of attention's reaches (the output and the layer's later stages) is said to be downstream of it.
"""

from __future__ import annotations

import dataclasses

from attn_doctor.backends import is_layer_path
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.verdict.rule import FAIL, INCONCLUSIVE, accumulation, combine, judge_tensor
from attn_doctor.verdict.view import RowView

ATTENTION = ("out", "dq", "dk", "dv")
FORWARD = ("out", "layer_q", "layer_k", "layer_v", "layer_out")  # a layer row's tensors of its forward
KIND = {"layer_q": "out", "layer_k": "out", "layer_v": "out", "layer_out": "out", "layer_dcontext": "dv",
        "layer_dx": "dv"}


def stage_words(module: str) -> list[tuple[tuple[str, ...], str]]:
    """The layer's stages in the order it computes them: (their tensors, what they cover)."""
    layer = module == "layer"
    return [
        (("layer_q", "layer_k", "layer_v"),
         "before attention: the q, k, v it received (" + ("LayerNorm, " if layer else "")
         + "fused QKV projection, split, RoPE)"),
        (("layer_out",), "after attention: the layer's output (output projection"
         + (", residuals, LayerNorm and MLP)" if layer else ")")),
        (("layer_dcontext",), "in the backward after attention: the gradient that reached attention's output ("
         + ("MLP, LayerNorm, residual and " if layer else "") + "output projection backward)"),
        (("layer_dx",), "in the backward before attention: dx (RoPE, QKV projection"
         + (", LayerNorm and residual" if layer else "") + " backward)"),
    ]


def is_layer_row(row: RowView) -> bool:
    """A layer path's measured row, which carries its own yardsticks."""
    return is_layer_path(row.coords.backend) and isinstance(row.extra.get("layer"), dict)


def reached_by_attention(failing: list[str], module: str) -> set[str]:
    """The layer tensors a fault of the core attention's (those of its tensors in `failing`) reaches: a wrong
    output reaches the layer's output and its whole backward below it (in a TransformerLayer, also the gradient
    reaching attention's output, through the MLP); a wrong dq, dk or dv reaches dx."""
    reached: set[str] = set()
    if "out" in failing:
        reached |= {"layer_out", "layer_dx"} | ({"layer_dcontext"} if module == "layer" else set())
    if any(name in failing for name in ("dq", "dk", "dv")):
        reached.add("layer_dx")
    return reached


def judge_layer_row(row: RowView) -> RowView:
    """Judge every tensor of a layer row against its own yardstick (see the module docstring) and word where the
    fault is."""
    facts = row.extra["layer"]
    yardsticks = {name: TensorMetrics(**d) for name, d in facts.get("yardstick", {}).items()}
    flash = {name: TensorMetrics(**d) for name, d in facts.get("flash_style_part", {}).items()}
    dtype, terms = row.case.dtype, int(facts.get("accumulation", 0))
    row.tensors = {}
    for name, metrics in row.metrics.items():
        if name not in yardsticks:
            continue
        if name in ATTENTION:
            row.tensors[name] = judge_tensor(name, metrics, yardsticks[name], dtype, accumulation(row.case, name),
                                             flash.get(name))
        else:
            verdict = judge_tensor(KIND[name], metrics, yardsticks[name], dtype, terms)
            row.tensors[name] = dataclasses.replace(verdict, why=stage_yardstick_words(verdict.why, row.case.dtype))
    row.verdict = combine([t.verdict for t in row.tensors.values()])
    facts["where"], row.reason = layer_reason(row, facts.get("module", ""))
    return row


def stage_yardstick_words(why: str, dtype: str) -> str:
    """A stage tensor's reason naming its yardstick: the plain same-dtype layer, not the baseline's single call."""
    return (why.replace("the local baseline's own error on these inputs",
                        f"the same layer's own error in {dtype} in plain torch with the local attention, on the same "
                        "weights and input")
            .replace("the baseline's own", "the plain layer's own"))


def layer_reason(row: RowView, module: str) -> tuple[str, str]:
    """(where the fault is, in a few words; the row's reason: that and each failing tensor's why), see the module
    docstring; ("", "") for a PASS."""
    failing = [name for name, t in row.tensors.items() if t.verdict == FAIL]
    if row.verdict == INCONCLUSIVE:
        undecided = [name for name, t in row.tensors.items() if t.verdict == INCONCLUSIVE]
        return "", f"{undecided[0]}: {row.tensors[undecided[0]].why}"
    if row.verdict != FAIL:
        return "", ""
    attention = [name for name in ATTENTION if name in failing]
    stages = [(names, words) for names, words in stage_words(module) if any(n in failing for n in names)]
    reached = reached_by_attention(attention, module)
    if attention:
        where = (f"fault in attention: TE's core attention in the layer fails ({', '.join(attention)}) on the q, k, v "
                 "it received")
        details = "; ".join(f"{name}: {row.tensors[name].why}" for name in attention)
        own = [(names, words) for names, words in stages if not all(n in reached for n in names if n in failing)]
        downstream = [n for names, _ in stages for n in names if n in failing and n in reached]
        if downstream:
            where += f"; {', '.join(downstream)} fail too, downstream of it"
        if own:
            names, words = own[0]
            where += f"; and a fault outside attention, {words}"
            details += "; " + stage_why(row, names, failing)
        return where, f"{where} ({details})"
    names, words = stages[0]
    where = f"fault outside attention in the layer, {words}"
    later = [n for other, _ in stages[1:] for n in other if n in failing]
    if later:
        where += f"; {', '.join(later)} fail too, later in the layer"
    where += "; the core attention passes on the q, k, v it received"
    return where, f"{where} ({stage_why(row, names, failing)})"


def first_wrong(failing: list[str] | tuple[str, ...]) -> str:
    """Where a layer row's fault first shows: the forward when a forward tensor fails, else the backward."""
    forward = [name for name in failing if name in FORWARD]
    if forward:
        return f"forward ({', '.join(forward)} already wrong)"
    return f"backward (the forward is right; {', '.join(failing)} wrong)"


def stage_why(row: RowView, names: tuple[str, ...], failing: list[str]) -> str:
    return "; ".join(f"{name}: {row.tensors[name].why}" for name in names if name in failing)
