"""A standalone repro script for one failing kernel path: torch (and TE for TE paths) only.

The script rebuilds the minimal case's inputs with the same seed and the same views, sets the same TE
flags, runs the kernel, computes the float64 reference and the Megatron-local baseline, prints the
errors and exits 1 while the path is still wrong, 0 once it is fixed. It is what a user attaches to a
bug report, so it is written to be read: a header with the case; attn-doctor's own numerics, the parts of
`attn_doctor.numerics.standalone` it uses, verbatim (one implementation: attn-doctor computes with the same
functions); the case's inputs, reference, baseline and rule through them; the kernel path's call (TE's built
by `attn_doctor.backends.te_call`, verbatim); a short main.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from attn_doctor.core import layouts
from attn_doctor.core.coords import Coords
from attn_doctor.core.source_text import module_body, used_source
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.numerics import standalone
from attn_doctor.numerics.standalone import MULTIPLE

HEADER = '''#!/usr/bin/env python3
"""Repro: {title}

Made by attn-doctor {version} ({command}).
Environment it was made on:
{env}
{launch}Exit code: 1 while the kernel path is still wrong, 0 once it agrees with float64 as closely as
Megatron's local attention, by the same rule as attn-doctor: each tensor's error, measured against the
scale of the terms it is summed from, may be at most {multiple:g} x the baseline's (never less than
rounding noise), whole tensor and worst (batch, head) slice; a systematic error beyond rounding and
NaN/Inf fail too.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F

# The case: every field, resolved (softmax scale, each sequence's lengths, ...), as attn-doctor computes with it.
CASE = {case}
LAYOUT = {layout!r}
TP = {tp}
# The kernel's backward takes D = rowsum(dO * O) from its rounded output: its dQ, dK may hold what that adds.
FLASH_STYLE = {flash_style}
# Padding masks: TE's cu_seqlens (where each sequence starts; _padded: where its slot in a thd tensor starts).
CU_SEQLENS = {cu_seqlens!r}
'''

NUMERICS = '''

# ==== attn-doctor's numerics: the parts of its numerics/standalone.py this script uses, verbatim ============

'''

CASE_INPUTS = '''

# ==== this case, as attn-doctor runs it =====================================================================

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = TORCH_DTYPES[CASE["dtype"]]  # the inputs'
EXPLICIT = BIAS = SINK = None  # the case's explicit mask, bias and sink logits (draw_side_inputs, set in main)
SINK_LEAF = None  # a kernel whose library keeps its own sink parameter (TE) points this at it
WARMUP_DOUT = None  # the output gradient in the kernel's format (FP8 delayed scaling's warm-up step takes it)
MAX_LOGIT = None  # with --max-logit: the max logit per head the last kernel call returned


def inputs():
    """Seeded q, k, v, dout (bshd), exactly as attn-doctor draws them."""
    return draw_inputs(CASE, DEVICE)


def visible():
    """Which keys each query sees: [batch or 1, 1, seq, seq_kv] booleans, None when all."""
    return dense_allowed(CASE, EXPLICIT, DEVICE)


def added_bias(dtype):
    """The bias added to the scaled scores (ALiBi materialised) in `dtype`, None without one."""
    return dense_bias(CASE, BIAS, dtype, DEVICE)


def packed_index(side):
    """thd: where the packed tensor's tokens sit in the padded bshd one."""
    return token_index(CU_SEQLENS[f"cu_seqlens_{side}_padded"], CASE["seq" if side == "q" else "seq_kv"], DEVICE)


def reference(q, k, v, dout):
    """Float64 out, dq, dk, dv (and the learnable sink's dsink; the max logit), each with its squared term sizes,
    by name; out alone (and the max logit) for a forward-only case."""
    exact = dense_reference(q, k, v, dout, CASE["scale"], visible(), added_bias(torch.float64), SINK)
    names = ("out",) if CASE["forward_only"] else ("out", "dq", "dk", "dv") + (
        ("dsink",) if CASE["softmax"] == "learnable" else ())
    found = {name: (exact[name], exact[f"{name}_terms"]) for name in names}
    if CASE["return_max_logit"]:
        found["max_logit"] = dense_max_logit(q, k, CASE["scale"], visible(), added_bias(torch.float64))
    return found


def megatron_local(q, k, v, sink=None):
    """The baseline: Megatron-LM's local core attention (sbhd) with the case's mask, bias and sink (and its max
    logit, with --max-logit)."""
    global MAX_LOGIT
    if CASE["return_max_logit"]:
        MAX_LOGIT = megatron_max_logit(q, k, CASE["scale"], visible(), added_bias(torch.float32))
    return megatron_core_attention(q, k, v, CASE["scale"], visible(), added_bias(torch.float32), sink,
                                   fp8=fp8_mode(CASE))


def flash_style_moves(q, k, dout, exact_out):
    """What a correct flash-style backward's D, from the output rounded to DTYPE, moves dQ and dK by."""
    def attend_keys(gradient):
        keys = dense_reference(q, k, k, gradient, CASE["scale"], visible(), added_bias(torch.float64), SINK)
        return keys["out"], keys["dv"]

    return output_rounding_moves(q, dout, exact_out, exact_out.to(DTYPE), CASE["scale"], attend_keys)


def errors(x, ref, terms, rows=None, empty_rows=None):
    """x measured against float64 as attn-doctor measures it."""
    return error_figures(error_sums(x, ref, terms, rows, empty_rows))


FAILED = {"nonfinite": "NaN/Inf",
          "empty rows": "non-zero output or gradient on rows that see no key (TE's convention: 0)",
          "error": "error above the yardstick", "worst head": "worst head's error above the yardstick",
          "bias": "systematic error", "head bias": "systematic error in one (batch, head) slice"}


UNDECIDED = {"reference": "the float64 reference is not finite here (or its terms' scale is not)",
             "float64": "float64's own rounding approaches the limit",
             "baseline": "the baseline itself has NaN/Inf here, so its error is no yardstick"}


def judge(m, base, tensor="out", flash=None):
    """attn-doctor's rule: (failed, shown error, ratio to the yardstick, why); why starts with "cannot tell"
    where no verdict can be given (not failed then)."""
    found = judge_figures(m, base, CASE["dtype"], MULTIPLE[tensor], flash=flash)
    undecided = found["inconclusive"]
    why = FAILED.get(found["failed"], "")
    if "bias" in found["failed"]:
        why += f": {1 + found['bias']:.4f}x the exact values (z = {found['bias_z']:.0f})"
    if undecided:
        return False, m["scaled"], found["ratio"], f"cannot tell: {UNDECIDED[undecided]}"
    return bool(found["failed"]), m["scaled"] if m["cancellation"] < CANCELLED else m["rel"], found["ratio"], why


# ==== the kernel path, called as attn-doctor calls it =======================================================
'''

MAIN = '''

# ==== main ==================================================================================================

def shards(q, k, v, case):
    """TP shards of the heads (views, or copies when LAYOUT is contiguous), joined along heads."""
    if TP == 1:
        return kernel(q, k, v, case)
    hq, hkv = case["heads"] // TP, case["kv_heads"] // TP
    shard_case = dict(case, heads=hq, kv_heads=hkv)
    outs = []
    for i in range(TP):
        parts = [q[:, :, i * hq:(i + 1) * hq], k[:, :, i * hkv:(i + 1) * hkv], v[:, :, i * hkv:(i + 1) * hkv]]
        if LAYOUT == "contiguous":  # TP shards as contiguous copies; head_slice: as views
            parts = [p.contiguous() for p in parts]
        outs.append(kernel(*parts, shard_case))
    return torch.cat(outs, dim=2)


def run(backend, fmt, layout, q, k, v, dout):
    """out, dq, dk, dv (bshd) of `backend` on the layout's views, and the sink's gradient (learnable sinks), by
    name; out alone for a forward-only case; and the max logit the call returned, with --max-logit."""
    global SINK_LEAF, WARMUP_DOUT, MAX_LOGIT
    index = {side: packed_index(side) if fmt == "thd" else None for side in ("q", "kv")}
    qkv, _ = lay_out(layout, q, k, v, fmt, index["q"], index["kv"])
    WARMUP_DOUT = to_format(dout, fmt, index["q"]).contiguous()
    learnable = CASE["softmax"] == "learnable"
    sink = SINK.detach().clone().requires_grad_() if learnable else SINK
    SINK_LEAF = MAX_LOGIT = None
    padded = {"q": (CASE["batch"], CASE["seq"]), "kv": (CASE["batch"], CASE["seq_kv"])}
    with torch.set_grad_enabled(not CASE["forward_only"]):
        out = backend(*qkv, dict(CASE, sink=sink))
    found = {"out": to_bshd(out.detach(), fmt, index["q"], padded["q"])}
    if MAX_LOGIT is not None:
        found["max_logit"] = MAX_LOGIT.detach().view(1, 1, -1, 1)
    if CASE["forward_only"]:
        return found
    target = (SINK_LEAF if SINK_LEAF is not None else sink) if learnable else None
    leaves = list(qkv) + ([target] if target is not None else [])
    grads = torch.autograd.grad(out, leaves, WARMUP_DOUT, allow_unused=True)
    for name, t, side in zip(("dq", "dk", "dv"), grads[:3], ("q", "kv", "kv")):
        found[name] = to_bshd(t.detach(), fmt, index[side], padded[side])
    if target is not None:
        found["dsink"] = (grads[3] if grads[3] is not None else torch.zeros_like(target)).detach().view(1, 1, -1, 1)
    return found


def main():
    global EXPLICIT, BIAS, SINK
    q, k, v, dout = inputs()
    EXPLICIT, BIAS, SINK = draw_side_inputs(CASE, DEVICE)
    ref = reference(q, k, v, dout)
    got = run(shards, FORMAT, LAYOUT if TP == 1 else "contiguous", q, k, v, dout)
    base = run(lambda q, k, v, case: megatron_local(q, k, v, case["sink"]), "sbhd", "contiguous", q, k, v, dout)
    rows = compared_rows(CASE, EXPLICIT, DEVICE)
    own = {}
    if FLASH_STYLE and CASE["fp8"] == "none":
        moves = flash_style_moves(q, k, dout, ref["out"][0])
        own = {name: errors(ref[name][0] + moves[name], ref[name][0], ref[name][1], **rows.get(name, {}))
               for name in ("dq", "dk") if name in ref}
    wrong, undecided = [], []
    print(f"{'tensor':6} {'err':>10}  {'ratio':>10}  (err: relative to float64; * against the terms' scale,"
          " where the exact tensor cancels; ratio: to the local baseline's error, or to rounding noise)")
    for name, (r, terms) in ref.items():
        if name not in got or name not in base:
            print(f"{name:6} not returned by the kernel: not judged")
            continue
        x, b = got[name], base[name]
        measured = errors(x, r, terms, **rows.get(name, {}))
        failed, shown, ratio, why = judge(measured, errors(b, r, terms, **rows.get(name, {})), name, own.get(name))
        star = "*" if measured["cancellation"] < CANCELLED else " "
        print(f"{name:6} {shown:10.3e}{star} {ratio:9.2f}x" + (f"  WRONG: {why}" if failed else f"  {why}" if why
                                                                   else ""))
        if failed:
            wrong.append(name)
        elif why:
            undecided.append(name)
    if wrong:
        print("STILL WRONG: " + ", ".join(wrong), flush=True)
    elif undecided:
        print("CANNOT TELL: " + ", ".join(undecided) + " (not fixed until it can be judged)", flush=True)
    else:
        print("FIXED: every tensor agrees with float64", flush=True)
    sys.stderr.flush()
    # The exit status is the verdict; os._exit keeps CUDA/TE teardown at interpreter exit from changing it.
    os._exit(1 if wrong or undecided else 0)


if __name__ == "__main__":
    main()
'''


def _env_lines(env: EnvReport | None) -> str:
    if env is None:
        return "  (not recorded)"
    from attn_doctor.machine.env_rows import env_rows

    return "\n".join(f"  {label}: {value}" for label, value in env_rows(env) if label != "env vars")


def short_id(coords: Coords) -> str:
    from attn_doctor.bisect.knobs import knob_dict

    return hashlib.sha1(json.dumps([coords.backend.name, knob_dict(coords)], sort_keys=True).encode()).hexdigest()[:8]


def repro_name(coords: Coords) -> str:
    """repro_<backend>_<short-id>.py: the file name of a probe's repro."""
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in coords.backend.name)
    return f"repro_{safe}_{short_id(coords)}.py"


def repro_text(coords: Coords, env: EnvReport | None, version: str, command: str, full: bool = False) -> str:
    """The standalone repro script of a failing probe, one call or TP shards: the short one, written for its case
    (`attn_doctor.bisect.short_repro`), where it covers the case and `full` is not asked; else the full one
    (ValueError for a depth stack or ranks: those are reproduced by attn-doctor itself)."""
    if not full:
        from attn_doctor.bisect.short_repro import short_repro_text

        short = short_repro_text(coords, env, version)
        if short is not None:
            return short
    from attn_doctor.backends import repro_source
    from attn_doctor.core.coords import ProbeKind

    if coords.layers or coords.kind is ProbeKind.DISTRIBUTED:
        raise ValueError("a depth or multi-rank failure is reproduced by attn-doctor; the standalone repro covers "
                         "one call")
    if coords.case.replay is not None:
        return _replay_repro_text(coords, version, command)
    from attn_doctor.backends import flash_style

    case = {name: value for name, value in coords.case.plain().items() if name != "replay"}
    text = HEADER.format(title=f"{coords.backend.name} on {coords.describe()}", version=version,
                         command=command.replace('"', "'"), env=_env_lines(env), launch=_launch(coords),
                         multiple=max(MULTIPLE.values()),
                         case=repr(case), layout=coords.layout, tp=coords.tp, flash_style=flash_style(coords.backend),
                         cu_seqlens=layouts.packing(coords.case).cu_seqlens_arguments() if coords.case.padded else None)
    rest = CASE_INPUTS + repro_source(coords.backend) + MAIN
    return text + NUMERICS + used_source(standalone, rest) + rest


def _launch(coords: Coords) -> str:
    """How to start the script where its process must load a given library build (a cuDNN build asked for):
    the variables, which must be set before the process starts."""
    import shlex

    from attn_doctor.backends import process_of

    environment = process_of(coords.backend)[1]
    if not environment:
        return ""
    variables = " ".join(f"{name}={shlex.quote(value)}" for name, value in environment.items())
    return ("Run it on the library build it failed on (the loader reads these before the script starts):\n"
            f"  env {variables} python3 THIS_FILE\n")


def write_repro(directory: Path, coords: Coords, env: EnvReport | None, version: str, command: str,
                full: bool = False) -> Path:
    """Write repro_<backend>_<short-id>.py for the (minimal) failing probe, one call or TP shards (`repro_text`)."""
    text = repro_text(coords, env, version, command, full)
    path = Path(directory) / repro_name(coords)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


REPLAY_REPRO = '''"""attn-doctor {version}: {title}.

This fault needs the values and views of a captured call, so this repro re-runs attn-doctor on the capture
rather than drawing inputs of its own: it needs attn-doctor installed and the capture folder
{capture} (attach it to a bug report along with this file). Exit 1 while the path is wrong, 0 once fixed.

Found by: {command}
"""

import subprocess
import sys

sys.exit(subprocess.call([sys.executable, "-m", "attn_doctor", *{arguments!r}]))
'''


def _replay_repro_text(coords: Coords, version: str, command: str) -> str:
    """The repro of a failing probe that still needs its captured call: `attn-doctor run --replay ...`."""
    import shlex

    from attn_doctor.backends import selector

    arguments = shlex.split(coords.repro_command(selector(coords.backend)))[1:]
    return REPLAY_REPRO.format(version=version, title=f"{coords.backend.name} on {coords.describe()}",
                               capture=coords.case.replay.rpartition("@")[0], command=command.replace('"', "'"),
                               arguments=arguments)
