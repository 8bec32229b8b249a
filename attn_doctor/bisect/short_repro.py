"""The short repro: one screen a maintainer reads, written for one case.

The full repro (`attn_doctor.bisect.repro`, `bisect --full-repro`) carries attn-doctor's numerics verbatim: every
input distribution, layout, mask, bias, FP8 simulation and sink, whatever the case needs; about 1,000 lines. This
one holds only what its case reaches: the inputs of its own distribution, the views of its own layout, the mask and
bias it has (none where every query sees every key), the call with its own arguments, the float64 reference with
the terms' sizes, Megatron's local attention as the baseline, and attn-doctor's rule, without the per-(batch, head)
checks where there is one (batch, head) slice (they are the whole tensor's then).

Each piece is written here from the case's values and is held to attn-doctor's own implementation by
tests/test_short_repro.py: the inputs, masks, biases and views bitwise; the reference's terms, the error figures
and the rule's verdicts on the same numbers; and a CPU path's script, run in a fresh process, gives the run's
figures. A case the short form does not cover (`not_covered`: FP8, a learnable sink, TP shards, ...) gets the full
form.
"""

from __future__ import annotations

import math
import shlex

from attn_doctor.backends.base import ShortCall, short_mask_code
from attn_doctor.core import layouts
from attn_doctor.core.coords import Coords, ProbeKind
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.numerics import standalone as numerics

WIDTH = 120  # the scripts' line length
OWN_VARIABLES = "ATTN_DOCTOR_"  # attn-doctor's own worker variables: nothing in a script reads them

HEADER = '''#!/usr/bin/env python3
"""{title}

Made by attn-doctor {version}{made_on}.
{launch}Exits 1 while a tensor is wrong by attn-doctor's rule (`judge`), 0 once every one is right.
"""
import math
import os
import torch
'''

INPUTS = '''
def inputs():  # q, k, v, dout (bshd), as attn-doctor draws them: {what}
    g = torch.Generator(DEVICE).manual_seed(SEED)
    randn = lambda *shape: torch.randn(shape, generator=g, device=DEVICE)
{body}    return q, k, v, randn(B, S, H, DV).to(DTYPE)
'''

REFERENCE = '''
def reference(q, k, v, do):
    # float64, and the squared sizes of the terms each row sums (as they are, and x g^2)
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))
    qh, kh, vh = q.transpose(1, 2), {kv_heads}
    s = {scores}{sink}
    lse = s.logsumexp(-1, keepdim=True)
    p = (s - lse).exp().nan_to_num(0.0){sink_drop}
    out = (p @ vh).transpose(1, 2)
    grads = torch.autograd.grad(out, (q, k, v), do.double())
    p, dh, oh, vh = p.detach(), do.double().transpose(1, 2), out.detach().transpose(1, 2), vh.detach()
    g2 = (1 + 2 * SCORE_U * lse.detach().nan_to_num(0.0, 0.0, 0.0).abs()).square()
    ds = (SCALE * p * ((dh.square() @ vh.square().mT).sqrt() + (dh * oh).square().sum(-1, True).sqrt())).square()
    sq = lambda t: t.detach().square().sum(-1, True)  # squared norms
    by_q = lambda w, x: torch.cat([w @ x, w @ x * g2], -1).transpose(1, 2)
    by_kv = lambda w, x: torch.cat([w.mT @ x, w.mT @ (x * g2)], -1){per_kv_head}.transpose(1, 2)
    terms = by_q(p.square(), sq(vh)), by_q(ds, sq(kh)), by_kv(ds, sq(qh)), by_kv(p.square(), sq(dh))
    return dict(zip(("out", "dq", "dk", "dv"), zip((out.detach(), *grads), terms)))

def local(q, k, v):  # the baseline: Megatron's local core attention (sbhd)
    s, b = q.shape[:2]{repeat_kv}
    x = torch.baddbmm(q.new_empty(b * H, s, SKV), q.reshape(s, b * H, D).transpose(0, 1),
                      k.reshape(SKV, b * H, D).transpose(0, 1).transpose(1, 2), beta=0.0, alpha=SCALE)
{local_probs}{local_empty}
    return torch.bmm(probs.to(q.dtype).reshape(b * H, s, SKV), v.reshape(SKV, b * H, DV).transpose(0, 1)).view(
        b, H, s, DV).permute(2, 0, 1, 3)
'''

RULE = '''
ratio = lambda err, scale: err / scale if scale > 0 else (0.0 if err == 0 else math.inf)

def figures(x, r, t{rows_parameters}):  # x's error against float64 r, as attn-doctor measures it
    x = x.double(){rows_code}
    f = {{"nonfinite": int((~x.isfinite()).sum()), "ref_nonfinite": int((~r.isfinite()).sum())}}
    ok = x.isfinite() & r.isfinite()
    e, r = (x - r).where(ok, 0.0), r.where(ok, 0.0)
    ee, rr, proj = e.square().sum((1, 3)), r.square().sum((1, 3)), (e * r).sum(3)  # per (batch, head); per row
    scale, noisy, p, p2 = rr + t[..., 0].sum(1), rr + t[..., 1].sum(1), proj.sum(1), proj.square().sum(1)
    total, err, norm = float(scale.sum()), float(ee.sum()) ** 0.5, float(rr.sum()) ** 0.5
    bias_of = lambda p, p2, rr: (0.0, 0.0) if rr <= 0 or p2 <= 0 else (float(p / rr), float(p / p2**0.5))
    f.update(rel=ratio(err, norm), scaled=ratio(err, total**0.5), bias=bias_of(p.sum(), p2.sum(), rr.sum()),
             share=norm / total**0.5 if total > 0 else 1.0,
             noise=(float(noisy.sum()) / total) ** 0.5 if total > 0 else 1.0){head_figures}{empty_size}
    return f

def judge(m, b{flash_parameter}):
    # attn-doctor's rule: why x (figures m) fails, or "cannot tell: ...", and its error / the yardstick{flash_own}
    {whole_ratio}
    why = ("NaN/Inf" if m["nonfinite"] else{empty_check} f"error {{whole:.3g}}x the yardstick" if whole > MULTIPLE else{head_check} "")
    for where, (bias, z), limit in (("", m["bias"], {bias_limit}),{head_bias}):
        if not why and m["share"] >= CANCELLED and abs(z) >= BIAS_Z and abs(bias) >= max(BIAS_MIN, MULTIPLE * limit):
            why = f"systematic error{{where}}: {{1 + bias:.4f}}x the exact values (z = {{z:.0f}})"{reference_check}
    return ("cannot tell: the baseline has NaN/Inf here" if b["nonfinite"] and why{own_findings} else why), whole
'''

REFERENCE_CHECK = '''
    if m["ref_nonfinite"] or not all(math.isfinite(b[n]) and not math.isnan(m[n]) for n in ({names})):
        return "cannot tell: the float64 reference is not finite here (or its terms' scale is 0)", whole'''

FLASH = '''
def flash_moves(q, k, do, out):  # a correct flash-style backward's own error (D from O rounded)
    moved = (do.double() * (out.to(DTYPE).double() - out)).sum(-1, keepdim=True)
    keys = reference(q, k, k, moved * q.double())
    return {"dq": -SCALE * moved * keys["out"][0], "dk": -SCALE * keys["dv"][0]}
'''

MAIN = '''
def attend(call, views, to_fmt, to_bshd, do):  # out, dq, dk, dv, bshd
    out = call(*views)
    grads = torch.autograd.grad(out, views, to_fmt(do, "q").contiguous())
    return [to_bshd(t.detach(), side) for t, side in zip((out, *grads), ("q", "q", "kv", "kv"))]

if __name__ == "__main__":
    q, k, v, do = inputs()
    ref = reference(q, k, v, do)
    got = attend(kernel, views(q, k, v), to_fmt, to_bshd, do)
{baseline}{flash}
    wrong, undecided = [], []
    for name, x, b in zip(ref, got, base):
        m = figures(x, *ref[name]{rows})
        why, whole = judge(m, figures(b, *ref[name]{rows}){flash_of})
        (undecided if why.startswith("cannot") else wrong if why else []).append(name)
        print(f"{{name:4}} relative {{m['rel']:9.3e}}, scaled {{m['scaled']:9.3e}}, {{whole:.3g}}x the yardstick",
              "WRONG:" * (name in wrong), why)
    print("STILL WRONG: " + ", ".join(wrong) if wrong else "CANNOT TELL: " + ", ".join(undecided) if undecided
          else "FIXED", flush=True)
    os._exit(1 if wrong or undecided else 0)  # the verdict; teardown cannot change it
'''


# --- which cases it covers ----------------------------------------------------------------------------------

def not_covered(coords: Coords) -> str | None:
    """Why the short form cannot reproduce `coords` (the full form is written then); None when it can."""
    return _coverage(coords)[1]


def _coverage(coords: Coords) -> tuple[ShortCall | None, str | None]:
    """The path's short call for the case, and why the short form cannot be written (None when it can)."""
    from attn_doctor.backends import short_call

    case = coords.case
    if coords.layers or coords.kind is ProbeKind.DISTRIBUTED or case.replay is not None:
        return None, "a depth, multi-rank or replayed probe"
    if coords.tp > 1:
        return None, "tensor-parallel shards"
    if case.fp8 != "none":
        return None, "FP8 attention (its baseline simulates FP8's rounding)"
    if case.softmax == "learnable":
        return None, "a learnable sink (its gradient is a fifth tensor)"
    if case.return_max_logit:
        return None, "TE's max logit (a fifth output)"
    if case.forward_only:
        return None, "a forward-only call"
    if case.padding_mask or case.alibi_slopes is not None:
        return None, "TE's boolean padding mask or custom ALiBi slopes (tensors the short call does not write)"
    call = short_call(coords.backend, case)
    if call is None:
        return None, f"{coords.backend.name} has no short call"
    if _views(call.fmt, coords.layout, _slots(coords)) is None:
        return call, f"layout {coords.layout} in {call.fmt}"
    if coords.layout == "sbh3d_packed" and case.head_dim_v != case.head_dim:
        return call, "sbh3d_packed with a value head dim of its own"
    return call, None


class _Facts:
    """What the pieces are decided on: the case's plain values and what its mask makes of them."""

    def __init__(self, coords: Coords):
        case = coords.case
        self.plain = plain = {name: value for name, value in case.plain().items() if name != "replay"}
        explicit = numerics.draw_side_inputs(plain, "cpu")[0]
        # The script's VISIBLE is None exactly where a kernel's mask argument is not VISIBLE (one decision)
        self.all_visible = short_mask_code(plain) != "VISIBLE"
        allowed = numerics.dense_allowed(plain, explicit, "cpu")
        # Rows that see no key (padding or not): Megatron's softmax gives them 1/n each, then zeroes them
        self.unseeing_rows = allowed is not None and not bool(allowed.any(-1).all())
        rows = numerics.compared_rows(plain, explicit, "cpu")
        self.some_rows = bool(rows)  # not every query sees a key, or not every key exists: the rows are chosen
        self.empty_rows = bool(rows) and bool(rows["out"]["empty_rows"].any())
        self.slices = plain["batch"] * plain["heads"] > 1  # per-(batch, head) checks differ from the whole tensor's
        self.grouped = plain["kv_heads"] != plain["heads"]
        self.sink = plain["softmax"] == "off-by-one"
        self.bias = plain["bias"] != "no_bias"
        self.padded = case.padded
        self.judgeable = _always_judgeable(plain, explicit)


SLICE_SCORES = 1 << 22  # the largest (batch, kv head) slice whose reference the generator works out itself
ALL_SCORES = 1 << 28  # and the most scores over all slices


def _always_judgeable(plain: dict, explicit) -> bool:
    """Whether the float64 reference of the case is finite and every tensor's every (batch, head) slice has a
    nonzero terms' scale, so that the rule's "cannot tell: the reference" never applies whatever the kernel
    returns (judge_figures: it depends on the reference alone; the candidate's figures are never NaN). Worked out
    on the CPU, one (batch, kv head) slice at a time, up to SLICE_SCORES a slice and ALL_SCORES in all; False (the
    check stays in the script) above."""
    batch, heads, kv_heads = plain["batch"], plain["heads"], plain["kv_heads"]
    group, scores = heads // kv_heads, plain["seq"] * plain["seq_kv"]
    if group * scores > SLICE_SCORES or batch * heads * scores > ALL_SCORES:
        return False
    torch = numerics.torch
    q, k, v, dout = numerics.draw_inputs(plain, "cpu")
    _, bias, sink = numerics.draw_side_inputs(plain, "cpu")
    allowed = numerics.dense_allowed(plain, explicit, "cpu")
    added = numerics.dense_bias(plain, bias, torch.float64, "cpu")
    rows = numerics.compared_rows(plain, explicit, "cpu")
    for b in range(batch):
        for kv_head in range(kv_heads):
            qs = slice(kv_head * group, (kv_head + 1) * group)
            exact = numerics.dense_reference(
                q[b:b + 1, :, qs], k[b:b + 1, :, kv_head:kv_head + 1], v[b:b + 1, :, kv_head:kv_head + 1],
                dout[b:b + 1, :, qs], plain["scale"],
                None if allowed is None else allowed[b:b + 1] if allowed.shape[0] > 1 else allowed,
                None if added is None else added.expand(batch, heads, *added.shape[2:])[b:b + 1, qs],
                None if sink is None else sink[qs])
            for name in ("out", "dq", "dk", "dv"):
                side = {key: None if mask is None else mask[b:b + 1] for key, mask in rows.get(name, {}).items()}
                sums = numerics.error_sums(exact[name], exact[name], exact[f"{name}_terms"], **side)
                scale = sums["head_sq_ref"] + sums["head_terms"][..., 0]
                if int(sums["ref_nonfinite"]) or not bool((scale > 0).all()):
                    return False
    return True


def short_repro_text(coords: Coords, env: EnvReport | None, version: str) -> str | None:
    """The short repro script of a failing probe, or None where the short form does not cover it (`not_covered`).
    It names the machine and versions it was made on; the command that found the fault is in the results and the
    issue body, not repeated here."""
    from attn_doctor.backends import flash_style

    call, why_not = _coverage(coords)
    if why_not is not None:
        return None
    facts = _Facts(coords)
    plain = facts.plain
    flash = flash_style(coords.backend)
    launch = _launch(coords)
    header = HEADER.format(title=f"{coords.backend.name} on {coords.describe()}", version=version,
                           made_on=_made_on(env, coords), launch=launch)
    parts = [header, call.setup, _constants(facts), _inputs(plain), _side_and_mask(facts),
             _views(call.fmt, coords.layout, _slots(coords)), call.kernel, _reference(facts), _rule(facts, flash),
             FLASH if flash else "", _main(facts, flash, call.fmt, coords.layout)]
    return _one_screen(_without_unused("".join(parts)))


def _launch(coords: Coords) -> str:
    """The line that runs the script on the cuDNN build and the prepared TE release the probe asked for: the loader
    variables attn-doctor starts its worker with (`loader_environment`, without attn-doctor's own and without this
    machine's other library folders), the build's folder written once as $D; the release's folder first on
    PYTHONPATH, as its worker has it first on its path; "" for a path that asks for neither."""
    from attn_doctor.machine.te_installs import TEInstall

    cudnn, release = coords.backend.options.get("cudnn"), coords.backend.options.get("te")
    site = TEInstall.from_dict(release).site if release else ""
    if not cudnn and not site:
        return ""
    variables = {"PYTHONPATH": site} if site else {}
    folder = ""
    if cudnn:
        from attn_doctor.machine.cudnn_builds import CudnnBuild, loader_environment

        folder = cudnn["directory"]
        variables.update({name: value.replace(folder, "$D") for name, value in loader_environment(
            CudnnBuild.from_dict(cudnn), {}).items() if not name.startswith(OWN_VARIABLES)})
    what = "build" if not site else f"TE release ({release['version']})" + (" and cuDNN build" if cudnn else "")
    return (f"Run on the {what} it failed on: " + (f"D={shlex.quote(folder)}; " if cudnn else "") + "env "
            + " ".join(f'{name}="{value}"' for name, value in variables.items()) + " python3 THIS_FILE\n")


def _multiple() -> float:
    multiples = set(numerics.MULTIPLE.values())
    if len(multiples) != 1:  # the script holds one MULTIPLE; a rule with several would need them by tensor
        raise ValueError("the short repro assumes one multiple for every tensor")
    return multiples.pop()


def _made_on(env: EnvReport | None, coords: Coords) -> str:
    """" on <GPU> (TE x, torch y)": the machine and the libraries the probe ran with: TE the path's own release
    (`--te`) where it asked for one, else the machine's (the path's own cuDNN build is in its name)."""
    if env is None:
        return ""
    release = coords.backend.options.get("te")
    te = release["version"] if release else env.te.value
    versions = ", ".join(f"{name} {value}" for name, value in (("TE", te), ("torch", env.torch.value)) if value)
    gpu = f" on {env.gpus[0].name}" if env.gpus else ""
    return gpu + (f" ({versions})" if versions else "")


def _power(value: float) -> str:
    """2**-n for a power of two, else the float's repr."""
    exponent = math.log2(value) if value > 0 else 0.5
    return f"2**{int(exponent)}" if exponent == int(exponent) else repr(value)


def _constants(facts: _Facts) -> str:
    plain, dtype = facts.plain, facts.plain["dtype"]
    lines = ["", 'DEVICE = "cuda" if torch.cuda.is_available() else "cpu"',
             "B, S, SKV, H, HKV, D, DV, SEED = " + ", ".join(str(plain[name]) for name in (
                 "batch", "seq", "seq_kv", "heads", "kv_heads", "head_dim", "head_dim_v", "seed")),
             f"DTYPE, SCALE = {numerics.TORCH_DTYPES[dtype]}, {plain['scale']!r}  # the inputs' dtype, softmax scale"]
    if facts.padded or plain["mask"] == "arbitrary" or facts.some_rows:  # read by VISIBLE's sequences or ROWS
        lines.append(f"LENS_Q, LENS_KV = {list(plain['lengths_q'])}, {list(plain['lengths_kv'])}  # each sequence's")
    score_u = numerics.score_precision(numerics.TORCH_DTYPES[dtype])
    eps = numerics.EPS[dtype]
    rule = {"EPS": _power(eps), "FLOOR": f"{numerics.NOISE_EPS[dtype]!r} * {_power(eps)}", "MULTIPLE": repr(_multiple()),
            "CANCELLED": _power(numerics.CANCELLED), "BIAS_Z": repr(numerics.BIAS_Z),
            "BIAS_MIN": f"{numerics.BIAS_EPS[dtype]!r} * {_power(eps)}", "SCORE_U": _power(score_u)}
    lines += _assignments(rule)
    if facts.empty_rows:
        lines.append(f"EMPTY_EPS = {numerics.EMPTY_ROW_EPS!r}  # rows that see no key: at most this many eps")
    return "\n".join(lines) + "\n"


def _assignments(values: dict[str, str]) -> list[str]:
    """`A, B, ... = a, b, ...` on one line, or on two where one would pass the scripts' width."""
    line = ", ".join(values) + " = " + ", ".join(values.values())
    if len(line) <= WIDTH:
        return [line]
    names = list(values)
    half = len(names) // 2
    return [line for part in (names[:half], names[half:]) for line in _assignments({n: values[n] for n in part})]


def _inputs(plain: dict) -> str:
    """inputs(): the case's own distribution, bitwise `standalone.draw_inputs`."""
    kind = plain["inputs"]
    shapes = "(B, S, H, D), (B, SKV, HKV, D), (B, SKV, HKV, DV)"
    if kind == "uniform":
        body = ("    uniform = lambda *shape: torch.rand(shape, generator=g, device=DEVICE).mul_(2.0).sub_(1.0).mul_(3**0.5)"
                "\n"
                f"    q, k, v = (uniform(*shape).to(DTYPE) for shape in ({shapes}))\n")
        what = "uniform, unit variance"
    elif kind == "structured":
        rank = min(numerics.RANK, plain["head_dim"])
        body = ("    def low_rank(n, heads, width):  # per token a few coefficients of a per-head basis\n"
                f"        coefficients, basis = randn(B, n, heads, {rank}), randn(heads, {rank}, width)\n"
                "        x = coefficients[..., 0, None] * basis[:, 0]\n"
                f"        for i in range(1, {rank}):\n"
                "            x.addcmul_(coefficients[..., i, None], basis[:, i])\n"
                f"        return x.div_({rank}**0.5)\n\n"
                "    q, k = low_rank(S, H, D).to(DTYPE), low_rank(SKV, HKV, D)\n"
                f"    k = k.add_(randn(HKV, D).mul_({numerics.KEY_MEAN_SCALE!r})).to(DTYPE)  # each head's keys share a mean\n"
                "    v = low_rank(SKV, HKV, DV).to(DTYPE)\n")
        what = f"rank {rank}, keys sharing a mean"
    elif kind == "deep-layer":
        body = ("    def shared(heads, width):  # a direction each head's keys (values) share\n"
                "        direction = randn(heads, width)\n"
                f"        return direction.mul_({numerics.SHARED_DIRECTION!r} * width**0.5 / "
                "direction.norm(dim=-1, keepdim=True))\n\n"
                "    q = randn(B, S, H, D).to(DTYPE)\n"
                "    k = randn(B, SKV, HKV, D).add_(shared(HKV, D)).to(DTYPE)\n"
                "    v = randn(B, SKV, HKV, DV).add_(shared(HKV, DV)).to(DTYPE)\n")
        what = "keys and values sharing a direction per head"
    elif kind == "outliers":
        channels = numerics.outlier_channels(plain["head_dim"], plain["seed"])
        value_channels = numerics.outlier_channels(plain["head_dim_v"], plain["seed"])
        factor = numerics.OUTLIER_SCALE
        body = (f"    q, k, v = (randn(*shape) for shape in ({shapes}))\n"
                "    scale, value_scale = torch.ones(D, device=DEVICE), torch.ones(DV, device=DEVICE)\n"
                f"    scale[{channels}], value_scale[{value_channels}] = {factor!r}, {factor!r}  # the outlier channels\n"
                "    q, k, v = (q * scale).to(DTYPE), (k * scale).to(DTYPE), (v * value_scale).to(DTYPE)\n")
        what = f"standard normal, outlier channels x{factor:g}"
    elif kind == "large-logits":
        factor = numerics.LOGIT_SCALE
        body = (f"    q, k, v = (randn(*shape) for shape in ({shapes}))\n"
                f"    q, k, v = (q * {factor!r}).to(DTYPE), (k * {factor!r}).to(DTYPE), v.to(DTYPE)\n")
        what = f"standard normal, q and k x{factor:g}"
    elif kind == "normal":
        return ("\ndef inputs():  # q, k, v, dout (bshd), as attn-doctor draws them\n"
                "    g = torch.Generator(DEVICE).manual_seed(SEED)\n"
                "    return [torch.randn(shape, generator=g, device=DEVICE).to(DTYPE)\n"
                f"            for shape in ({shapes}, (B, S, H, DV))]\n")
    else:
        raise ValueError(f"the short repro has no inputs {kind!r}")
    return INPUTS.format(what=what, body=body)


def _side_and_mask(facts: _Facts) -> str:
    """The side inputs the case draws (explicit mask, bias, sink logits, from their own generator in that order),
    VISIBLE (which keys each query sees; None where every query sees every key), BIAS (float64, added to the
    scaled scores), and ROWS: the rows compared and those that see no key, by side."""
    plain = facts.plain
    lines = [""]
    draws_bias = plain["bias"].startswith("post_scale_bias")
    if plain["mask"] == "arbitrary" or draws_bias:
        lines.append(f"side = torch.Generator(DEVICE).manual_seed(SEED + {numerics.SIDE_SEED_OFFSET})"
                     "  # the mask's and the bias's own generator")
    if plain["mask"] == "arbitrary":
        lines.append(f"EXPLICIT = torch.rand(B, 1, S, SKV, generator=side, device=DEVICE) >= {plain['masked_fraction']!r}"
                     "  # True: visible")
    if draws_bias:
        lines.append(f"BIAS_IN = torch.randn({tuple(plain['bias_shape'])}, generator=side, device=DEVICE).to(DTYPE)"
                     "  # as TE takes it")
    if facts.sink:
        lines.append("SINK = torch.zeros(H, device=DEVICE)  # off-by-one: a zero logit per head in each softmax")
    lines.append(_visible(facts))
    if plain["bias"] == "alibi":
        slopes = numerics.alibi_slopes(plain["heads"]).tolist()
        diags = [0 if plain["mask"] in numerics.TOP_LEFT_MASKS else len_kv - len_q
                 for len_q, len_kv in zip(plain["lengths_q"], plain["lengths_kv"])]
        lines.append(f"SLOPES = torch.tensor({slopes!r}, dtype=torch.float64, device=DEVICE)  # TE's ALiBi slopes\n"
                     "BIAS = torch.stack([-SLOPES[:, None, None] * (torch.arange(S, device=DEVICE)[:, None] + diag\n"
                     "                    - torch.arange(SKV, device=DEVICE)).abs().double()\n"
                     f"                    for diag in {diags}])  # ALiBi: -slope |i + diag - j|, per sequence")
    elif draws_bias:
        lines.append("BIAS = BIAS_IN.double()  # added to the scaled scores")
    if facts.some_rows:
        lines += ["SEEN = (VISIBLE.any(-1)[:, 0] if VISIBLE is not None else torch.ones(1, S, dtype=torch.bool, "
                  "device=DEVICE)).expand(B, S)",
                  "VALID_Q, VALID_KV = (torch.arange(n, device=DEVICE) < torch.tensor(lens, device=DEVICE)[:, None]"
                  " for n, lens in ((S, LENS_Q), (SKV, LENS_KV)))",
                  'ROWS = {"q": (VALID_Q & SEEN, VALID_Q & ~SEEN), "kv": (VALID_KV, None)}'
                  "  # the rows compared; the rows that see no key"]
    return "\n".join(lines) + "\n"


def _visible(facts: _Facts) -> str:
    """VISIBLE, bitwise `standalone.dense_allowed` (None where it lets every pair through)."""
    plain = facts.plain
    if facts.all_visible:
        return "VISIBLE = None  # every query sees every key"
    grid = "I, J = torch.arange(S, device=DEVICE)[:, None], torch.arange(SKV, device=DEVICE)\n"
    if not plain["mask"].startswith("padding") and plain["mask"] != "arbitrary":
        left, right, diag = numerics.visibility(plain["mask"], plain["window"], plain["seq"], plain["seq_kv"])
        if left < 0 and right == 0:  # causal: key j <= i + diag
            return f"VISIBLE = torch.ones(S, SKV, dtype=torch.bool, device=DEVICE).tril({diag})[None, None]  # causal"
        return grid + f"VISIBLE = ({_band(left, right, str(diag))})[None, None]  # [1, 1, S, SKV], True: visible"
    diags = [numerics.visibility(plain["mask"], plain["window"], len_q, len_kv)[2]
             for len_q, len_kv in zip(plain["lengths_q"], plain["lengths_kv"])]
    left, right, _ = numerics.visibility(plain["mask"], plain["window"], 1, 1)
    band = _band(left, right, "diag")
    explicit = " & EXPLICIT" if plain["mask"] == "arbitrary" else ""
    return (grid + "VISIBLE = torch.stack([(I < lq) & (J < lkv)" + (f" & {band}" if band else "")
            + f" for lq, lkv, diag in zip(LENS_Q, LENS_KV, {diags})])[:, None]{explicit}  # [B, 1, S, SKV]")


def _band(left: int, right: int, diag: str) -> str:
    """`standalone.visible_pairs` as code: query I sees keys I + diag - left .. I + diag + right (-1: no bound)."""
    shifted = "I" if diag == "0" else f"I + {diag}"
    parts = []
    if right >= 0:
        parts.append(f"(J <= {shifted}{f' + {right}' if right else ''})")
    if left >= 0:
        parts.append(f"(J >= {shifted} - {left})")
    return " & ".join(parts)


LEAF = "leaf = lambda t: t.detach().clone(memory_format=torch.contiguous_format).requires_grad_()\n"


def _slots(coords: Coords) -> tuple[list[int], list[int]] | None:
    """Each sequence's slot in a thd tensor, queries and keys (TE's cu_seqlens_*_padded, as differences)."""
    if not coords.case.padded:
        return None
    cu = layouts.packing(coords.case).cu_seqlens_arguments()
    return tuple([b - a for a, b in zip(offsets, offsets[1:])]
                 for offsets in (cu["cu_seqlens_q_padded"], cu["cu_seqlens_kv_padded"]))


def _views(fmt: str, layout: str, slots: tuple[list[int], list[int]] | None) -> str | None:
    """to_fmt, to_bshd (bshd tensors in the kernel's format and back), leaf and views(q, k, v): the layout's
    views, bitwise `standalone.lay_out`; None for a layout the short form does not write."""
    if fmt == "thd":
        convert = ("INDEX = {side: torch.cat([torch.arange(b * n, b * n + slot, device=DEVICE) for b, slot in "
                   "enumerate(slots)])\n"
                   f"         for side, n, slots in ((\"q\", S, {slots[0]}), (\"kv\", SKV, {slots[1]}))}}"
                   "  # thd tokens in bshd\n"
                   "to_fmt = lambda t, side: t.flatten(0, 1)[INDEX[side]]\n"
                   "to_bshd = lambda t, side: t.new_zeros(B * (S if side == \"q\" else SKV), *t.shape[1:]).index_copy_(\n"
                   "    0, INDEX[side], t).unflatten(0, (B, -1))\n")
    elif fmt == "sbhd":
        convert = "to_fmt = to_bshd = lambda t, side: t.transpose(0, 1)  # sbhd views of bshd tensors\n"
    else:
        convert = "to_fmt = to_bshd = lambda t, side: t  # the kernel takes bshd\n"
    sides = 'zip((q, k, v), ("q", "kv", "kv"))'
    if layout == "contiguous":
        return ("\n" + convert + LEAF + f"views = lambda q, k, v: [leaf(to_fmt(t, side)) for t, side in {sides}]"
                "\n")
    elif layout == "transposed" and fmt in ("bshd", "sbhd"):
        other = "t.transpose(0, 1)" if fmt == "bshd" else "t"
        return ("\n" + convert + LEAF + f"views = lambda q, k, v: [leaf({other}).transpose(0, 1) for t in (q, k, v)]"
                f"  # {'sbhd' if fmt == 'bshd' else 'bshd'} storage\n")
    elif layout == "head_slice":
        what = "the second half of the heads of tensors twice as wide"
        body = (f"    g = torch.Generator(DEVICE).manual_seed({numerics.HEAD_SLICE_SEED})\n"
                "    wide = [leaf(to_fmt(torch.cat([torch.randn(t.shape, generator=g, device=DEVICE).to(DTYPE), t], 2), "
                f"side))\n            for t, side in {sides}]\n"
                "    return [w[..., t.shape[2]:, :] for w, t in zip(wide, (q, k, v))]\n")
    elif layout in ("qkv_3hd", "qkv_h3d", "kv_2hd", "kv_h2d"):
        dim = -2 if layout.endswith(("h3d", "h2d")) else -3
        what = f"slices of one {layout} buffer"
        if layout.startswith("kv_"):
            body = (f"    t = [to_fmt(x, side) for x, side in {sides}]\n"
                    f"    kv = leaf(torch.stack(t[1:], dim={dim}))\n"
                    f"    return [leaf(t[0]), kv.select({dim}, 0), kv.select({dim}, 1)]\n")
        else:
            body = (f"    qkv = leaf(torch.stack([to_fmt(t, side) for t, side in {sides}], dim={dim}))\n"
                    f"    return [qkv.select({dim}, i) for i in range(3)]\n")
    elif layout == "sb3hd_packed" and fmt in ("bshd", "sbhd"):
        back = ".transpose(0, 1)" if fmt == "bshd" else ""
        what = "slices of one [s, b, 3, h, d] buffer (a fused qkv GEMM's output)"
        body = ("    qkv = leaf(torch.stack([t.transpose(0, 1) for t in (q, k, v)], dim=2))\n"
                f"    return [qkv[:, :, i]{back} for i in range(3)]\n")
    elif layout == "sbh3d_packed" and fmt in ("bshd", "sbhd"):
        back = ".transpose(0, 1)" if fmt == "bshd" else ""
        what = "Megatron's mixed [s, b, kv_heads, (group + 2) d] buffer"
        body = ("    b, s, h, d = q.shape\n"
                "    mixed = leaf(torch.cat([q.transpose(0, 1).reshape(s, b, HKV, h // HKV * d), k.transpose(0, 1), "
                "v.transpose(0, 1)], -1))\n"
                "    q_part, k_view, v_view = torch.split(mixed, [h // HKV * d, d, d], dim=-1)\n"
                f"    return [q_part.reshape(s, b, h, d){back}, k_view{back}, v_view{back}]\n")
    else:
        return None
    return "\n" + convert + LEAF + f"\ndef views(q, k, v):  # as the kernel gets them: {what}\n" + body


def _reference(facts: _Facts) -> str:
    plain, visible = facts.plain, not facts.all_visible
    return REFERENCE.format(
        kv_heads=("k.transpose(1, 2).repeat_interleave(H // HKV, 1), v.transpose(1, 2).repeat_interleave(H // HKV, 1)"
                  if facts.grouped else "k.transpose(1, 2), v.transpose(1, 2)"),
        scores=("(qh @ kh.mT * SCALE" + (" + BIAS" if facts.bias else "") + ").masked_fill(~VISIBLE, -math.inf)"
                if visible else "qh @ kh.mT * SCALE" + (" + BIAS" if facts.bias else "")),
        sink=("\n    s = torch.cat([s, SINK.double()[None, :, None, None].expand(*s.shape[:-1], 1)], -1)  # the sink logit"
              if facts.sink else ""),
        sink_drop="[..., :SKV]" if facts.sink else "",
        per_kv_head=".unflatten(1, (HKV, H // HKV)).sum(2)" if facts.grouped else "",
        repeat_kv="\n    k, v = (t.repeat_interleave(H // HKV, dim=2) for t in (k, v))" if facts.grouped else "",
        local_probs=_local_probs(facts),
        local_empty=("\n    probs = probs * VISIBLE.any(-1, keepdim=True)  # rows that see no key: 0 (TE's convention)"
                     if facts.unseeing_rows else ""))


def _local_probs(facts: _Facts) -> str:
    """Megatron's masked fp32 softmax, as `standalone.megatron_core_attention` has it for this case."""
    x = "x.view(b, H, s, SKV).float()" + (" + BIAS.float()" if facts.bias else "")
    if not facts.all_visible:
        x = f"({x}).masked_fill(~VISIBLE, {numerics.MEGATRON_MASK_FILL!r})" if facts.bias else \
            f"{x}.masked_fill(~VISIBLE, {numerics.MEGATRON_MASK_FILL!r})"
    elif facts.bias:
        x = f"({x})"
    if facts.sink:
        return (f"    x = {x}\n    probs = torch.cat([x, SINK.float().view(1, H, 1, 1).expand(b, H, s, 1)], -1)"
                ".softmax(-1)[..., :SKV]")
    return f"    probs = {x}.softmax(-1)"


def _rule(facts: _Facts, flash: bool) -> str:
    """figures and judge: `standalone.error_figures` and `judge_figures` for this case (the per-(batch, head)
    checks where there is more than one slice, the rows that see no key where there are any, the flash-style
    yardstick for a flash-style path, the reference's "cannot tell" where the case can reach it)."""
    rows, slices, empty = facts.some_rows, facts.slices, facts.empty_rows
    rows_code = ""
    if rows:
        rows_code = "\n    x, r, t = (a.where(rows[..., None, None], 0.0) for a in (x, r, t))  # the rows compared"
        if empty:
            rows_code = ("\n    on = x.where(empty[..., None, None], 0.0) if empty is not None else x.new_zeros(1)"
                         "  # rows that see no key: on their own"
                         "\n    empty_rows = (int(empty.sum()) * x.shape[2] if empty is not None else 0, "
                         "int((~on.isfinite()).sum()), float(on.nan_to_num(0.0, 0.0, 0.0).abs().max()))" + rows_code)
    head_figures = ("\n    at = int(torch.where(p2 > 0, p / p2.clamp_min(1e-300).sqrt(), 0.0).abs().argmax())"
                    "\n    heads = torch.where(scale > 0, ee / scale.clamp_min(1e-300), ee * math.inf).nan_to_num(0.0, math.inf)"
                    "\n    f.update(worst=float(heads.max()) ** 0.5, head_bias=bias_of(*(a.flatten()[at] for a in (p, p2, rr))),"
                    "\n             head_noise=float(torch.where(scale > 0, noisy / scale.clamp_min(1e-300), 1.0).max()) ** 0.5)"
                    ) if slices else ""
    empty_size = ("\n    counted = int(rows.sum()) * x.shape[2]"
                  "\n    f.update(empty_rows=empty_rows[0], empty_nonfinite=empty_rows[1],"
                  " empty_max=ratio(empty_rows[2], (float(rr.sum()) / counted) ** 0.5 if counted else 0.0))") if empty else ""
    if flash:
        finite = ('flash["scaled"], flash["worst"], flash["bias"][0], flash["head_bias"][0]' if slices
                  else 'flash["scaled"], flash["bias"][0]')
        # Where the reference is finite with a nonzero scale everywhere (`_always_judgeable`), so are the flash-style
        # figures computed from it: the script uses them as they are; else only where they are finite.
        name = "flash" if facts.judgeable else "f"
        flash_own = ("" if facts.judgeable else
                     f"\n    f = flash if flash and all(math.isfinite(v) for v in (\n        {finite})) else None")
        flash_own += (f"\n    own = lambda n: math.hypot(b[n], {name}[n]) if {name} else b[n]"
                      f'\n    bias_limit = max(abs(b["bias"][0]), abs({name}["bias"][0]) if {name} else 0.0)')
        if slices:
            flash_own += (f'\n    head_limit = max(bias_limit, abs(b["head_bias"][0]), abs({name}["head_bias"][0]) '
                          f'if {name} else 0.0)')
        own_scaled = 'own("scaled")'
    else:
        flash_own, own_scaled = "", 'b["scaled"]'
    bias_limit = "bias_limit" if flash else 'abs(b["bias"][0])'
    head_limit = "head_limit" if flash else 'max(abs(b["bias"][0]), abs(b["head_bias"][0]))'
    names = '"scaled", "worst"' if slices else '"scaled",'
    return RULE.format(
        rows_parameters=", rows, empty=None" if rows else "", rows_code=rows_code, head_figures=head_figures,
        empty_size=empty_size, flash_parameter=", flash=None" if flash else "",
        floor=numerics.NOISE_EPS[facts.plain["dtype"]], flash_own=flash_own,
        whole_ratio=(f'whole = ratio(m["scaled"], max({own_scaled}, FLOOR * m["noise"]))' if not slices else
                     f'whole, head = (ratio(m[n], max({own_scaled.replace(chr(34) + "scaled" + chr(34), "n")}, FLOOR * m[z]))'
                     ' for n, z in (("scaled", "noise"), ("worst", "head_noise")))'),
        empty_check=('\n           "non-zero values on rows that see no key" if m["empty_rows"] and '
                     '(m["empty_nonfinite"] or m["empty_max"] > EMPTY_EPS * EPS) else') if empty else "",
        head_check=('\n           f"worst (batch, head)\'s error {head:.3g}x its yardstick" if head > MULTIPLE else'
                    if slices else ""),
        bias_limit=bias_limit,
        head_bias=(f' (" in one (batch, head)", m["head_bias"], {head_limit})' if flash else
                   f'\n            (" in one (batch, head)", m["head_bias"], {head_limit})')
        if slices else "",
        reference_check="" if facts.judgeable else REFERENCE_CHECK.format(names=names),
        own_findings=(' not in ("NaN/Inf", "non-zero values on rows that see no key")' if empty else ' != "NaN/Inf"'))


def _main(facts: _Facts, flash: bool, fmt: str, layout: str) -> str:
    rows = ', *ROWS["q" if name in ("out", "dq") else "kv"]' if facts.some_rows else ""
    flash_code = ""
    if flash:
        flash_rows = ', *ROWS["q" if name == "dq" else "kv"]' if facts.some_rows else ""
        flash_code = ('\n    moves = flash_moves(q, k, do, ref["out"][0])'
                      f"\n    flash = {{name: figures(ref[name][0] + moves[name], *ref[name]{flash_rows}) for name in moves}}")
    baseline = ('    base = attend(local, [leaf(to_fmt(t, "q")) for t in (q, k, v)], to_fmt, to_bshd, do)'
                "  # contiguous sbhd" if fmt == "sbhd" and layout == "contiguous" else
                "    sbhd = lambda t, side: t.transpose(0, 1)\n"
                '    base = attend(local, [leaf(sbhd(t, "q")) for t in (q, k, v)], sbhd, sbhd, do)')
    return MAIN.format(baseline=baseline, flash=flash_code, rows=rows, flash_of=", flash.get(name)" if flash else "")


def _without_unused(script: str) -> str:
    """The script without its top-level assignments and functions that nothing reads (a constant or helper that a
    general piece defines and this case's pieces never use), repeated until none is left."""
    import ast

    while True:
        tree = ast.parse(script)
        read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
        unused = [node for node in tree.body if _defined(node) and not _defined(node) & read]
        if not unused:
            return script
        lines = script.splitlines(keepends=True)
        for node in reversed(unused):
            del lines[node.lineno - 1:node.end_lineno]
        script = "".join(lines)


def _defined(node) -> set[str]:
    import ast

    if isinstance(node, ast.FunctionDef):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {target.id for target in ast.walk(ast.Tuple(elts=node.targets)) if isinstance(target, ast.Name)}
    return set()


def _one_screen(script: str) -> str:
    """The script with no blank line between its top-level statements but one before each part: the case (its
    constants), the reference and the baseline, the rule, the run; and no trailing blank line."""
    head, _, body = script.strip("\n").partition('\n"""\n')
    kept = []
    for line in body.splitlines():
        if line.strip() or (kept and kept[-1].strip()):
            kept.append(line)
    out = []
    for i, line in enumerate(kept):
        following = kept[i + 1] if i + 1 < len(kept) else ""
        if not line.strip() and not following.startswith(PART_STARTS):
            continue
        out.append(line)
    return head + '\n"""\n' + "\n".join(out) + "\n"


PART_STARTS = ("DEVICE = ", "def reference(", "ratio = ", "if __name__")
