"""Every rule of the shipped known-defect file, tested from its own [bug.when] table.

For each rule a witness is built: a machine, a run, a path and a case for which every condition holds; it
must match the rule (and a probe of it must show the rule's symptom or be "not reproduced here"). For each
condition key of the rule a neighbour is built: the same search with only that condition violated and every
other one still holding; it must not match. The witnesses come from a small search over candidate facts, and
what each condition means is written here again (the `Dimension` predicates), independently of the engine:
a key the engine reads wrongly fails its witness or its neighbour.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from test_known_defects import make_env

from attn_doctor.core.case import MASKS, Case
from attn_doctor.core.layouts import LAYOUTS
from attn_doctor.known_defects import (
    CONDITION_KEYS,
    KnownBug,
    MatchContext,
    Probe,
    find_known_bugs,
    load_known_bugs,
    match_case,
    match_environment,
)

BUGS = load_known_bugs()

Facts = dict[str, Any]
Predicate = Callable[[Any, Facts], bool]


def _in_spec(spec: str, version: str | None) -> bool:
    return version is not None and SpecifierSet(spec).contains(Version(version), prereleases=True)


def _lengths(f: Facts) -> tuple[tuple[int, ...], tuple[int, ...]]:
    lengths_q = f["seqlens"] or (f["seq"],) * f["batch"]
    lengths_kv = (f["seq_kv"],) * f["batch"] if f["seqlens"] is None or f["seq_kv"] != f["seq"] else lengths_q
    return lengths_q, lengths_kv


def _uneven_for_cp(value: bool, f: Facts) -> bool:
    if f["cp_size"] <= 1:
        return False
    return any(n % (2 * f["cp_size"]) for n in _lengths(f)[0]) == value


@dataclass(frozen=True)
class Dimension:
    """A group of facts searched together (the conditions that read them interact), typical values first."""

    candidates: Callable[[], Iterator[Facts]]
    predicates: dict[str, Predicate]


def _one(name: str, values: list) -> Callable[[], Iterator[Facts]]:
    return lambda: ({name: v} for v in values)


def _flag(name: str) -> Dimension:
    return Dimension(_one(name, [False, True]), {name: lambda v, f, name=name: f[name] == v})


def _seq_facts() -> Iterator[Facts]:
    pairs = [(1024, 1024), (7, 7), (64, 64), (192, 192), (512, 256), (317, 2), (1, 128), (1, 1), (2048, 2048),
             (1000, 1000), (4200, 4200), (1, 4200), (512, 512)]
    cps = [(1, None), (2, "p2p"), (2, "a2a"), (4, "all_gather")]
    for (cp_size, comm), batch, (seq, seq_kv), ragged in itertools.product(cps, [2, 1, 4], pairs, [False, True]):
        seqlens = tuple([seq] * (batch - 1) + [seq - 1]) if ragged and seq > 1 else None
        if ragged and seqlens is None:
            continue
        yield {"cp_size": cp_size, "cp_comm_type": comm, "batch": batch, "seq": seq, "seq_kv": seq_kv,
               "seqlens": seqlens}


def _fp8_facts() -> Iterator[Facts]:
    for recipe, dtype in itertools.product(["none", "delayed", "current", "mxfp8", "blockwise"], ["bf16", "fp16", "fp32"]):
        yield {"fp8_recipe": recipe, "dtype": dtype}


DIMENSIONS: list[Dimension] = [
    Dimension(_one("te", ["2.20.2", "2.21.0", "0.10.0", "0.11.0", "1.2.0", "1.3.0", "1.6.0", "1.7.0", "1.11.0",
                          "1.12.0", "1.13.0", "2.1.0", "2.2.0", "2.7.0", "2.8.0", "2.9.0", "2.10.0", "2.12.0",
                          "2.16.0", "2.17.1", "2.18.0", None]),
              {"te": lambda v, f: _in_spec(v, f["te"])}),
    Dimension(_one("cudnn", ["9.19.0", "8.8.1", "8.9.0", "8.9.3", "9.0.0", "9.1.0", "9.2.0", "9.2.1", "9.3.0", "9.5.0",
                             "9.5.1", "9.7.0", "9.7.1", "9.10.0", "9.10.1", "9.10.2", "9.11.0", "9.12.0", "9.13.1",
                             "9.14.0", "9.15.0", "9.15.1", "9.17.0", "9.18.0", "9.18.1", "9.20.0", "9.21.0", "9.23.0",
                             "9.23.1", "9.23.2", "9.24.0", "9.25.0", "9.25.1", "9.26.0", None]),
              {"cudnn": lambda v, f: _in_spec(v, f["cudnn"]),
               "cudnn_in": lambda v, f: f["cudnn"] is not None and any(Version(f["cudnn"]) == Version(x) for x in v)}),
    Dimension(_one("sm", [90, 70, 80, 86, 89, 100, 103, 120, None]),
              {"sm": lambda v, f: f["sm"] is not None and _in_spec(v, str(f["sm"])),
               "sm_in": lambda v, f: f["sm"] in v}),
    Dimension(_one("flash_attn", [None, "2.7.4", "4.0.0b11", "4.0.0b36"]),
              {"flash_attn": lambda v, f: _in_spec(v, f["flash_attn"])}),
    Dimension(_one("torch", ["2.11.0+cu130", "2.10.0", "2.13.0", None]),
              {"torch": lambda v, f: _in_spec(v, f["torch"])}),
    *(_flag(name) for name in ("deterministic", "cuda_graph", "kv_cache", "dout_strided", "causal_with_explicit_mask",
                               "varying_cu_seqlens", "recompute")),
    Dimension(_one("training", [True, False]), {"training": lambda v, f: f["training"] == v}),
    Dimension(_fp8_facts, {"fp8": lambda v, f: (f["fp8_recipe"] != "none") == v,
                           "fp8_recipe": lambda v, f: f["fp8_recipe"] in v,
                           "dtype": lambda v, f: f["dtype"] in v or ("fp8" in v and f["fp8_recipe"] != "none")}),
    Dimension(_one("bias_type", ["no_bias", "post_scale_bias:1hss", "post_scale_bias:111s", "post_scale_bias:11ss",
                                 "alibi"]),
              {"bias": lambda v, f: (f["bias_type"] != "no_bias") == v,
               "bias_shape": lambda v, f: f["bias_type"].split(":")[-1] in v}),
    Dimension(_one("softmax", ["vanilla", "off-by-one", "learnable"]),
              {"softmax_sink": lambda v, f: (f["softmax"] != "vanilla") == v,
               "softmax_type": lambda v, f: f["softmax"] in v}),
    Dimension(_seq_facts, {
        "context_parallel": lambda v, f: (f["cp_size"] > 1) == v,
        "cp_comm_type": lambda v, f: f["cp_comm_type"] in v,
        "seqlens_not_multiple_of_2cp": _uneven_for_cp,
        "batch_ge": lambda v, f: f["batch"] >= v,
        "cross_attention": lambda v, f: (f["seq"] != f["seq_kv"]) == v,
        "seq_kv_shorter": lambda v, f: any(kv < q for q, kv in zip(*_lengths(f))) == v,
        "ragged": lambda v, f: (any(n < f["seq"] for n in _lengths(f)[0])
                                or any(n < f["seq_kv"] for n in _lengths(f)[1])) == v,
        "seq_kv_gt": lambda v, f: f["seq_kv"] > v,
        "seq_q_gt": lambda v, f: f["seq"] > v,
        "seq_q_le": lambda v, f: f["seq"] <= v,
        "seq_kv_not_multiple_of": lambda v, f: f["seq_kv"] % v != 0,
        "seq_kv_mod": lambda v, f: f["seq_kv"] % v[0] == v[1],
    }),
    Dimension(lambda: ({"mask": m, "window": w} for m, w in itertools.product(MASKS, [None, (128, 0), (128, 128), (-1, 0)])),
              {"mask": lambda v, f: f["mask"] in ["no_mask" if m == "none" else m for m in v],
               "causal": lambda v, f: ("causal" in f["mask"]) == v,
               "window": lambda v, f: (f["window"] is not None and f["window"][0] != -1) == v}),
    Dimension(lambda: ({"heads": h, "kv_heads": kv} for h, kv in [(16, 16), (16, 8), (16, 4), (16, 2), (16, 1), (4, 4)]),
              {"gqa": lambda v, f: (f["kv_heads"] < f["heads"]) == v, "kv_heads_lt": lambda v, f: f["kv_heads"] < v}),
    Dimension(lambda: ({"d_qk": q, "d_v": dv} for q, dv in itertools.product([64, 8, 128, 136, 192, 256],
                                                                           [None, 64, 96, 128, 192, 256])),
              {"head_dim_qk_ge": lambda v, f: f["d_qk"] >= v,
               "head_dim_v_ge": lambda v, f: (f["d_v"] or f["d_qk"]) >= v,
               "head_dim_in": lambda v, f: f["d_qk"] in v,
               "head_dims_differ": lambda v, f: (f["d_qk"] != (f["d_v"] or f["d_qk"])) == v,
               "head_dims_not_in": lambda v, f: (f["d_qk"], f["d_v"] or f["d_qk"]) not in v,
               "head_dim_v_not_in": lambda v, f: (f["d_v"] or f["d_qk"]) not in v,
               "head_dim_v_not_multiple_of": lambda v, f: (f["d_v"] or f["d_qk"]) % v != 0}),
    Dimension(_one("qkv_format", ["sbhd", "bshd", "thd", None]),
              {"qkv_format": lambda v, f: f["qkv_format"] in v}),
    _flag("pad_between_seqs"),
    Dimension(_one("backend", ["te.fused", "te.fused.det", "te.flash", "te.unfused", "sdpa.flash", "sdpa.efficient",
                               "sdpa.cudnn", "sdpa.math", "local", None]),
              {"backend": lambda v, f: f["backend"] is not None
               and any(f["backend"] == w or f["backend"].startswith(w + ".") for w in v)}),
    Dimension(_one("sub_backend", [1, 0, 2, None]), {"sub_backend": lambda v, f: f["sub_backend"] in v}),
    Dimension(_one("layout", ["contiguous", *[name for name in LAYOUTS if name != "contiguous"], None]),
              {"layout": lambda v, f: f["layout"] in v}),
]


def test_every_condition_key_has_a_dimension():
    covered = [key for d in DIMENSIONS for key in d.predicates]
    assert sorted(covered) == sorted(CONDITION_KEYS)


def solve(bug: KnownBug, violate: str | None = None) -> Facts:
    """Facts for which every condition of the rule holds, except `violate`, which must not."""
    facts: Facts = {}
    for dimension in DIMENSIONS:
        keys = [key for key in dimension.predicates if key in bug.when]
        for candidate in dimension.candidates():
            if all(dimension.predicates[key](bug.when[key], candidate) != (key == violate) for key in keys):
                facts.update(candidate)
                break
        else:
            pytest.fail(f"{bug.id}: no facts satisfy {keys} (violating {violate})")
    return facts


def build(facts: Facts) -> tuple[Any, Case, MatchContext]:
    """The EnvReport, Case and MatchContext the facts describe."""
    flash = facts["flash_attn"]
    env = make_env(te=facts["te"], te_cudnn=facts["cudnn"], torch_cudnn=facts["cudnn"],
                   sm=None if facts["sm"] is None else f"sm_{facts['sm']}", torch=facts["torch"],
                   flash_attn={f"v{flash[0]}": flash} if flash else None)
    case = Case(batch=facts["batch"], seq=facts["seq"], seq_kv=facts["seq_kv"], heads=facts["heads"], kv_heads=facts["kv_heads"],
                head_dim=facts["d_qk"], head_dim_v=facts["d_v"], dtype=facts["dtype"], mask=facts["mask"],
                window=facts["window"], seqlens=facts["seqlens"], qkv_format=facts["qkv_format"] or "sbhd",
                pad_between_seqs=facts["pad_between_seqs"], bias=facts["bias_type"], softmax=facts["softmax"],
                fp8=facts["fp8_recipe"])
    context = MatchContext(
        training=facts["training"], deterministic=facts["deterministic"], cuda_graph=facts["cuda_graph"],
        fp8=facts["fp8_recipe"] != "none", context_parallel=facts["cp_size"] > 1, kv_cache=facts["kv_cache"],
        softmax_sink=facts["softmax"] != "vanilla", bias=facts["bias_type"] != "no_bias",
        dout_strided=facts["dout_strided"], causal_with_explicit_mask=facts["causal_with_explicit_mask"],
        varying_cu_seqlens=facts["varying_cu_seqlens"], recompute=facts["recompute"], cp_size=facts["cp_size"],
        cp_comm_type=facts["cp_comm_type"], qkv_format=facts["qkv_format"], backend=facts["backend"],
        sub_backend=facts["sub_backend"], layout=facts["layout"])
    return env, case, context


def _ids(matches) -> list[str]:
    return [m.bug.id for m in matches]


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.id)
def test_rule_matches_its_own_conditions(bug: KnownBug):
    env, case, context = build(solve(bug))
    matches = match_case(BUGS, env, case, context)
    assert bug.id in _ids(matches)
    match = next(m for m in matches if m.bug.id == bug.id)
    assert match.evidence and match.scope == bug.scope
    if bug.scope == "environment":
        assert bug.id in _ids(match_environment(BUGS, env, context))
    else:
        assert bug.id not in _ids(match_environment(BUGS, env, context))


NEIGHBOURS = [(bug, key) for bug in BUGS for key in bug.when]


@pytest.mark.parametrize("bug,key", NEIGHBOURS, ids=[f"{bug.id}-not-{key}" for bug, key in NEIGHBOURS])
def test_rule_does_not_match_with_one_condition_violated(bug: KnownBug, key: str):
    env, case, context = build(solve(bug, violate=key))
    assert bug.id not in _ids(match_case(BUGS, env, case, context))
    if bug.scope == "environment" and key not in ("backend", "sub_backend"):
        assert bug.id not in _ids(match_environment(BUGS, env, context))


SHOWING: dict[str, dict[str, Any]] = {
    "backend disabled": {"verdict": "SKIP", "reason": "TE: Disabling FusedAttention for this case"},
    "illegal memory access": {"verdict": "ERROR", "reason": "CUDA error: an illegal memory access was encountered"},
    "NaN": {"verdict": "FAIL", "failing": frozenset({"dq"}), "nonfinite": frozenset({"dq"})},
    "wrong output": {"verdict": "FAIL", "failing": frozenset({"out", "dq"})},
    "wrong gradient": {"verdict": "FAIL", "failing": frozenset({"dq", "dk", "dv"})},
    "nondeterministic": {"verdict": "PASS", "nondeterministic": True},
    "mask leak": {"verdict": "FAIL", "failing": frozenset({"out"})},
}


@pytest.mark.parametrize("bug", BUGS, ids=lambda b: b.id)
def test_rule_is_reproduced_where_its_symptom_shows_and_not_reproduced_where_it_does_not(bug: KnownBug):
    env, case, context = build(solve(bug))
    shown = Probe(case, context, **SHOWING[bug.symptom])
    (finding,) = [f for f in find_known_bugs(BUGS, env, [shown]) if f.bug.id == bug.id]
    assert finding.reproduced and finding.shown == (shown,)
    absent = Probe(case, context, verdict="PASS", ran="the path under test")
    (finding,) = [f for f in find_known_bugs(BUGS, env, [absent]) if f.bug.id == bug.id]
    assert not finding.reproduced and finding.quiet == (absent,)
