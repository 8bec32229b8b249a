"""Known-bug recognition: the shipped data file, the loader's validation, and every rule shape.

Each rule in attn_doctor/data/known_bugs.toml has a scenario below: a machine + run + case where
it must be recognised, and variants with one condition flipped where it must not be.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

import pytest

from attn_doctor.core.case import Case, make_case
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.machine.known_bugs import (
    COMPONENTS,
    CONDITION_KEYS,
    SYMPTOMS,
    KnownBug,
    Match,
    MatchContext,
    describe,
    known_bugs_path,
    load_known_bugs,
    match_case,
    match_environment,
)

TE_TREE = "https://github.com/NVIDIA/TransformerEngine"

_UNSET = object()


def make_env(
    te: str | None = "2.20.2",
    te_cudnn: str | None = "9.19.0 (91900)",
    torch_cudnn: str | None = None,
    sm: str | tuple[str, ...] | None = "sm_90",
    env_vars: dict | None = None,
) -> EnvReport:
    """An EnvReport with only the facts the rules read; None = unknown (not installed / no GPU)."""
    sms = () if sm is None else ((sm,) if isinstance(sm, str) else sm)
    d = {
        "te": {"value": te, "note": None if te else "not installed"},
        "te_cudnn": {"value": te_cudnn, "note": None if te_cudnn else "not probed"},
        "torch_cudnn": {"value": torch_cudnn, "note": None if torch_cudnn else "cuDNN not available to torch"},
        "gpus": [{"index": i, "name": "GPU", "sm": s, "memory_total_mib": 1} for i, s in enumerate(sms)],
        "env_vars": env_vars or {},
    }
    return EnvReport.from_dict(d)


@dataclass(frozen=True)
class MlaCase(Case):
    """A case with d_v != d_qk, which attn-doctor cases cannot express (for the MLA rule)."""

    head_dim_v: int | None = None


@dataclass
class Scenario:
    bug_id: str
    env: dict
    case: dict
    ctx: dict = field(default_factory=dict)
    # label -> (env overrides, case overrides, context overrides): each must NOT match
    flips: dict = field(default_factory=dict)
    case_cls: str = "make_case"  # "make_case", "raw" (mask names attn-doctor has no flag for), "mla"


def _build_case(kind: str, kwargs: dict):
    if kind == "mla":
        return MlaCase(**kwargs)
    if kind == "raw":
        mask = kwargs.get("mask")
        base = make_case(**{k: v for k, v in kwargs.items() if k != "mask"}, mask="none")
        return dataclasses.replace(base, mask=mask) if mask else base
    return make_case(**kwargs)


def _run(sc: Scenario, env_over=None, case_over=None, ctx_over=None) -> tuple[list[Match], EnvReport, MatchContext]:
    env = make_env(**{**sc.env, **(env_over or {})})
    case = _build_case(sc.case_cls, {**sc.case, **(case_over or {})})
    ctx_kw = {"qkv_format": "sbhd", **sc.ctx, **(ctx_over or {})}
    ctx = MatchContext.from_env(env, **ctx_kw)
    return match_case(BUGS, env, case, ctx), env, ctx


def _ids(matches: list[Match]) -> list[str]:
    return [m.bug.id for m in matches]


BUGS = load_known_bugs()
BY_ID = {b.id: b for b in BUGS}

SMALL = dict(batch=1, seq=1024, heads=4, head_dim=64, dtype="bf16", mask="causal")

SCENARIOS = [
    Scenario(
        "te-1937-cudnn-9.10.0-fp8",
        env=dict(te_cudnn="9.10.0 (91000)"),
        case=SMALL,
        ctx=dict(fp8=True),
        flips={"cuDNN 9.10.1": (dict(te_cudnn="9.10.1 (91001)"), {}, {}), "no FP8": ({}, {}, dict(fp8=False))},
    ),
    Scenario(
        "te-1937-cudnn-9.10-f16",
        env=dict(te_cudnn="9.10.1 (91001)"),
        case=SMALL,
        flips={"cuDNN 9.10.2": (dict(te_cudnn="9.10.2 (91002)"), {}, {}), "fp32": ({}, dict(dtype="fp32"), {})},
    ),
    Scenario(
        "te-2185-hopper-mla-bwd",
        env=dict(te_cudnn="9.11.0 (91100)", sm="sm_90"),
        case=dict(batch=1, seq=512, heads=4, head_dim=256, head_dim_v=128),
        case_cls="mla",
        flips={
            "(192, 128) is excluded": ({}, dict(head_dim=192), {}),
            "d_qk == d_v": ({}, dict(head_dim_v=256), {}),
            "d_v < 128": ({}, dict(head_dim_v=64), {}),
            "sm_100": (dict(sm="sm_100"), {}, {}),
            "cuDNN 9.10.2": (dict(te_cudnn="9.10.2 (91002)"), {}, {}),
            "inference": ({}, {}, dict(training=False)),
        },
    ),
    Scenario(
        "te-2344-cudnn-9.14-swa-nan",
        env=dict(te_cudnn="9.14.0 (91400)", sm="sm_90"),
        case=dict(batch=1, seq=2048, heads=4, head_dim=64, dtype="bf16", mask="none", window=(128, 128)),
        flips={
            "seq_kv 1024": ({}, dict(seq=1024), {}),
            "cuDNN 9.15.0": (dict(te_cudnn="9.15.0 (91500)"), {}, {}),
            "causal": ({}, dict(mask="causal", window=(128, 0)), {}),
            "no window": ({}, dict(window=None), {}),
            "left unbounded": ({}, dict(window=(-1, 128)), {}),
        },
    ),
    Scenario(
        "te-2344-cudnn-9.15-cuda-graph-ima",
        env=dict(te_cudnn="9.15.0 (91500)"),
        case=dict(SMALL, seq=1000),
        ctx=dict(cuda_graph=True),
        flips={
            "no CUDA graph": ({}, {}, dict(cuda_graph=False)),
            "seq_kv 1024": ({}, dict(seq=1024), {}),
            "cuDNN 9.15.1": (dict(te_cudnn="9.15.1 (91501)"), {}, {}),
            "thd": ({}, {}, dict(qkv_format="thd")),
            "inference": ({}, {}, dict(training=False)),
        },
    ),
    Scenario(
        "te-2693-sm120-cudnn-lt-9.18.1",
        env=dict(te_cudnn="9.18.0 (91800)", sm="sm_120"),
        case=SMALL,
        flips={"cuDNN 9.18.1": (dict(te_cudnn="9.18.1 (91801)"), {}, {}), "sm_100": (dict(sm="sm_100"), {}, {})},
    ),
    Scenario(
        "te-2798-sm120-deterministic",
        env=dict(te_cudnn="9.19.0 (91900)", sm="sm_120", env_vars={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}),
        case=SMALL,
        flips={
            "non-deterministic": (dict(env_vars={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}), {}, {}),
            "env var unset": (dict(env_vars={}), {}, {}),
            "sm_90": (dict(sm="sm_90"), {}, {}),
        },
    ),
    Scenario(
        "te-2693-sm120-t3hd-th3d",
        env=dict(sm="sm_120"),
        case=SMALL,
        ctx=dict(qkv_format="thd"),
        flips={"sbhd": ({}, {}, dict(qkv_format="sbhd")), "format unknown": ({}, {}, dict(qkv_format=None)),
               "sm_90": (dict(sm="sm_90"), {}, {})},
    ),
    Scenario(
        "te-2584-blackwell-deterministic-bwd",
        env=dict(te_cudnn="9.18.0 (91800)", sm="sm_100"),
        case=SMALL,
        ctx=dict(deterministic=True),
        flips={
            "cuDNN 9.18.1": (dict(te_cudnn="9.18.1 (91801)"), {}, {}),
            "sm_90": (dict(sm="sm_90"), {}, {}),
            "non-deterministic": ({}, {}, dict(deterministic=False)),
        },
    ),
    Scenario(
        "te-sm100-brcm-cross-attention",
        env=dict(te_cudnn="9.7.0 (90700)", sm="sm_100"),
        case=dict(batch=1, seq=512, seq_kv=1024, heads=4, head_dim=64, mask="causal_bottom_right"),
        case_cls="raw",
        flips={
            "self-attention": ({}, dict(seq_kv=512), {}),
            "cuDNN 9.7.1": (dict(te_cudnn="9.7.1 (90701)"), {}, {}),
            "sm_90": (dict(sm="sm_90"), {}, {}),
            "top-left causal": ({}, dict(mask="causal"), {}),
        },
    ),
    Scenario(
        "te-cudnn-lt-8.9.0-f16",
        env=dict(te_cudnn="8.8.1 (8801)"),
        case=dict(SMALL, dtype="fp16"),
        flips={"cuDNN 8.9.0": (dict(te_cudnn="8.9.0 (8900)"), {}, {}), "fp32": ({}, dict(dtype="fp32"), {})},
    ),
    Scenario(
        "te-3173-mxfp8-cudnn-9.23",
        env=dict(te_cudnn="9.23.1 (92301)", sm="sm_100"),
        case=SMALL,
        ctx=dict(fp8=True),
        flips={
            "cuDNN 9.23.2": (dict(te_cudnn="9.23.2 (92302)"), {}, {}),
            "no FP8": ({}, {}, dict(fp8=False)),
            "sm_90": (dict(sm="sm_90"), {}, {}),
        },
    ),
    Scenario(
        "te-2236-fp8-cs-cudnn-lt-9.14",
        env=dict(te_cudnn="9.13.1 (91301)", sm="sm_100"),
        case=SMALL,
        ctx=dict(fp8=True),
        flips={
            "cuDNN 9.14.0": (dict(te_cudnn="9.14.0 (91400)"), {}, {}),
            "sm_90": (dict(sm="sm_90"), {}, {}),
            "no FP8": ({}, {}, dict(fp8=False)),
        },
    ),
    Scenario(
        "te-2236-fp8-cs-deterministic-cudnn-lt-9.18",
        env=dict(te_cudnn="9.17.0 (91700)", sm="sm_100"),
        case=SMALL,
        ctx=dict(fp8=True, deterministic=True),
        flips={
            "cuDNN 9.18.0": (dict(te_cudnn="9.18.0 (91800)"), {}, {}),
            "non-deterministic": ({}, {}, dict(deterministic=False)),
            "no FP8": ({}, {}, dict(fp8=False)),
        },
    ),
    Scenario(
        "te-thd-softmax-sink-cudnn-lt-9.18",
        env=dict(te_cudnn="9.17.0 (91700)"),
        case=SMALL,
        ctx=dict(qkv_format="thd", softmax_sink=True),
        flips={
            "cuDNN 9.18.0": (dict(te_cudnn="9.18.0 (91800)"), {}, {}),
            "vanilla softmax": ({}, {}, dict(softmax_sink=False)),
            "sbhd": ({}, {}, dict(qkv_format="sbhd")),
        },
    ),
    Scenario(
        "te-kv-cache-sm89-sm120",
        env=dict(sm="sm_89"),
        case=SMALL,
        ctx=dict(kv_cache=True),
        flips={"sm_90": (dict(sm="sm_90"), {}, {}), "no KV cache": ({}, {}, dict(kv_cache=False))},
    ),
    Scenario(
        "te-650-cudnn-9-sdpa-nan",
        env=dict(te="1.2.0", te_cudnn="9.0.0 (90000)"),
        case=SMALL,
        flips={
            "TE 1.3": (dict(te="1.3.0"), {}, {}),
            "cuDNN 8.9.7": (dict(te_cudnn="8.9.7 (8907)"), {}, {}),
            "no TE": (dict(te=None), {}, {}),
        },
    ),
    Scenario(
        "te-311-cudnn-8.9.3-bwd",
        env=dict(te="0.10.0", te_cudnn="8.9.3 (8903)"),
        case=dict(SMALL, seq=512),
        flips={
            "seqlen 256": ({}, dict(seq=256), {}),
            "TE 0.11": (dict(te="0.11.0"), {}, {}),
            "inference": ({}, {}, dict(training=False)),
        },
    ),
    Scenario(
        "te-975-fp8-cudnn-lt-9.2.1",
        env=dict(te_cudnn="9.2.0 (90200)"),
        case=SMALL,
        ctx=dict(fp8=True),
        flips={"cuDNN 9.2.1": (dict(te_cudnn="9.2.1 (90201)"), {}, {}), "no FP8": ({}, {}, dict(fp8=False))},
    ),
    Scenario(
        "te-975-thd-cudnn-9.1-9.2",
        env=dict(te_cudnn="9.2.1 (90201)"),
        case=SMALL,
        ctx=dict(qkv_format="thd"),
        flips={
            "cuDNN 9.3.0": (dict(te_cudnn="9.3.0 (90300)"), {}, {}),
            "cuDNN 9.0.0": (dict(te_cudnn="9.0.0 (90000)"), {}, {}),
            "sbhd": ({}, {}, dict(qkv_format="sbhd")),
        },
    ),
    Scenario(
        "te-2186-hopper-thd-cp-bwd-nan",
        env=dict(te_cudnn="9.7.1 (90701)", sm="sm_90"),
        case=SMALL,
        ctx=dict(qkv_format="thd", context_parallel=True),
        flips={
            "no context parallelism": ({}, {}, dict(context_parallel=False)),
            "cuDNN 9.18.0": (dict(te_cudnn="9.18.0 (91800)"), {}, {}),
            "sm_100": (dict(sm="sm_100"), {}, {}),
            "bshd": ({}, {}, dict(qkv_format="bshd")),
        },
    ),
    Scenario(
        "te-3249-thd-sink-dv-bwd",
        env=dict(te_cudnn="9.25.0 (92500)", sm="sm_90"),
        case=dict(SMALL, head_dim=192),
        ctx=dict(qkv_format="thd", softmax_sink=True),
        flips={
            "d_v 128": ({}, dict(head_dim=128), {}),
            "cuDNN 9.26.0": (dict(te_cudnn="9.26.0 (92600)"), {}, {}),
            "vanilla softmax": ({}, {}, dict(softmax_sink=False)),
            "inference": ({}, {}, dict(training=False)),
        },
    ),
    Scenario(
        "te-3333-sm120-thd-bwd",
        env=dict(te="2.17.1", te_cudnn="9.25.0 (92500)", sm="sm_120"),
        case=SMALL,
        ctx=dict(qkv_format="thd"),
        flips={
            "TE 2.18.0": (dict(te="2.18.0"), {}, {}),
            "no TE": (dict(te=None), {}, {}),
            "sm_90": (dict(sm="sm_90"), {}, {}),
            "inference": ({}, {}, dict(training=False)),
            "sbhd": ({}, {}, dict(qkv_format="sbhd")),
        },
    ),
]


# --------------------------------------------------------------------------- the shipped file


def test_shipped_file_loads_with_required_fields():
    assert known_bugs_path().parent.name == "data" and known_bugs_path().is_file()
    assert BUGS, "the shipped known-bugs file is empty"
    for bug in BUGS:
        assert isinstance(bug, KnownBug)
        assert bug.id and bug.title and bug.reference, bug
        assert bug.reference.startswith("https://"), bug.id
        assert bug.source is None or bug.source.startswith("https://"), bug.id
        assert all(u.startswith("https://") for u in bug.see_also), bug.id
        assert bug.symptom in SYMPTOMS, bug.id
        assert bug.component in COMPONENTS, bug.id
        assert bug.when and set(bug.when) <= set(CONDITION_KEYS), bug.id
        assert bug.scope in ("environment", "case")


def test_ids_unique():
    ids = [b.id for b in BUGS]
    assert len(ids) == len(set(ids))


def test_every_rule_has_a_scenario():
    assert sorted(s.bug_id for s in SCENARIOS) == sorted(BY_ID)


def test_seeded_from_the_facts_file():
    refs = {b.reference for b in BUGS} | {u for b in BUGS for u in b.see_also}
    for n in (3333, 2186, 3249):  # section 1, merged with rows 17-19 of section 2.6
        assert f"{TE_TREE}/issues/{n}" in refs
        assert sum(b.reference == f"{TE_TREE}/issues/{n}" for b in BUGS) == 1  # no duplicate rows
    for n in (1937, 2344, 2693, 2798, 2584, 3173, 2236, 650, 311, 975, 3470):
        assert f"{TE_TREE}/pull/{n}" in refs, n


# --------------------------------------------------------------------------- every rule shape


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.bug_id)
def test_rule_matches(sc: Scenario):
    matches, env, ctx = _run(sc)
    assert sc.bug_id in _ids(matches)
    m = next(m for m in matches if m.bug.id == sc.bug_id)
    assert m.scope == BY_ID[sc.bug_id].scope
    assert m.evidence
    line = describe(m)
    assert line.startswith(m.evidence + ": ") and m.bug.reference in line
    if BY_ID[sc.bug_id].scope == "environment":
        assert sc.bug_id in _ids(match_environment(BUGS, env, ctx))


FLIPS = [(sc, label) for sc in SCENARIOS for label in sc.flips]


@pytest.mark.parametrize("sc,label", FLIPS, ids=[f"{sc.bug_id}-not-{label}" for sc, label in FLIPS])
def test_rule_does_not_match_with_one_condition_flipped(sc: Scenario, label: str):
    env_over, case_over, ctx_over = sc.flips[label]
    matches, env, ctx = _run(sc, env_over, case_over, ctx_over)
    assert sc.bug_id not in _ids(matches)
    assert sc.bug_id not in _ids(match_environment(BUGS, env, ctx))


def test_every_scenario_has_a_flip():
    assert all(sc.flips for sc in SCENARIOS)


# --------------------------------------------------------------------------- the example


def _swa(seq=2048, te_cudnn="9.14.0 (91400)"):
    env = make_env(te_cudnn=te_cudnn, sm="sm_90")
    case = make_case(batch=2, seq=seq, heads=16, head_dim=64, dtype="bf16", mask="none", window=(128, 128))
    return env, case


def test_swa_example_matches_with_evidence_and_description():
    env, case = _swa()
    matches = match_case(BUGS, env, case, MatchContext.from_env(env, qkv_format="sbhd"))
    m = next(m for m in matches if m.bug.id == "te-2344-cudnn-9.14-swa-nan")
    assert m.scope == "case"
    assert "cuDNN 9.14.0 (TE's)" in m.evidence
    assert "sliding window" in m.evidence and "non-causal" in m.evidence
    assert "seq_kv 2048 > 1024" in m.evidence
    line = describe(m)
    assert "TE disables FusedAttention" in line and "NaN" in line
    assert f"see {TE_TREE}/pull/2344" in line


@pytest.mark.parametrize("seq,te_cudnn", [(1024, "9.14.0 (91400)"), (2048, "9.15.0 (91500)")])
def test_swa_example_does_not_match(seq, te_cudnn):
    env, case = _swa(seq, te_cudnn)
    assert "te-2344-cudnn-9.14-swa-nan" not in _ids(match_case(BUGS, env, case))


def test_case_rules_are_not_environment_matches():
    env, _ = _swa()
    assert "te-2344-cudnn-9.14-swa-nan" not in _ids(match_environment(BUGS, env))
    assert all(m.scope == "environment" for m in match_environment(BUGS, env))


def test_describe_mentions_fix_and_symptom():
    sc = next(s for s in SCENARIOS if s.bug_id == "te-2344-cudnn-9.15-cuda-graph-ima")
    matches, _, _ = _run(sc)
    line = describe(next(m for m in matches if m.bug.id == sc.bug_id))
    assert "(illegal memory access)" in line and line.endswith("(fixed in cuDNN 9.15.1)")


# --------------------------------------------------------------------------- unknown facts


def test_unknown_facts_never_match():
    env = make_env(te=None, te_cudnn=None, torch_cudnn=None, sm=None)
    for case in (make_case(), make_case(seq=2048, mask="none", window=(128, 128)), make_case(seq=1000)):
        for ctx in (
            MatchContext.from_env(env),
            MatchContext(fp8=True, deterministic=True, kv_cache=True, cuda_graph=True, qkv_format="thd",
                         softmax_sink=True, context_parallel=True),
        ):
            assert match_case(BUGS, env, case, ctx) == []
            assert match_environment(BUGS, env, ctx) == []


def test_no_gpu_means_no_sm_match():
    env = make_env(te_cudnn="9.18.0 (91800)", sm=None)
    assert "te-2693-sm120-cudnn-lt-9.18.1" not in _ids(match_environment(BUGS, env))
    env = make_env(te_cudnn="9.18.0 (91800)", sm="sm_?")
    assert "te-2693-sm120-cudnn-lt-9.18.1" not in _ids(match_environment(BUGS, env))


def test_no_te_means_no_te_version_match():
    sc = next(s for s in SCENARIOS if s.bug_id == "te-3333-sm120-thd-bwd")
    matches, _, _ = _run(sc, dict(te=None), {}, {})
    assert "te-3333-sm120-thd-bwd" not in _ids(matches)


def test_unknown_qkv_format_means_no_format_match():
    env = make_env(te_cudnn="9.15.0 (91500)")
    ctx = MatchContext(cuda_graph=True)  # qkv_format unknown
    assert "te-2344-cudnn-9.15-cuda-graph-ima" not in _ids(match_case(BUGS, env, make_case(seq=1000), ctx))


def test_cudnn_falls_back_to_torch_and_says_so():
    env, case = _swa()
    env = make_env(te=None, te_cudnn=None, torch_cudnn="9.14.0 (91400)", sm="sm_90")
    m = next(m for m in match_case(BUGS, env, case) if m.bug.id == "te-2344-cudnn-9.14-swa-nan")
    assert "cuDNN 9.14.0 (torch's" in m.evidence
    # TE's cuDNN wins over torch's when both are known
    env = make_env(te_cudnn="9.15.0 (91500)", torch_cudnn="9.14.0 (91400)")
    assert "te-2344-cudnn-9.14-swa-nan" not in _ids(match_case(BUGS, env, case))


def test_mixed_gpus_name_the_matching_one():
    env = make_env(te_cudnn="9.17.0 (91700)", sm=("sm_90", "sm_120"))
    m = next(m for m in match_environment(BUGS, env) if m.bug.id == "te-2693-sm120-cudnn-lt-9.18.1")
    assert "sm_120 (GPU 1)" in m.evidence


def test_default_context_is_attn_doctors_run():
    env = make_env(env_vars={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    ctx = MatchContext.from_env(env)
    assert ctx.training and ctx.deterministic
    assert not (ctx.fp8 or ctx.cuda_graph or ctx.context_parallel or ctx.kv_cache or ctx.softmax_sink or ctx.bias)
    assert ctx.qkv_format is None
    assert not MatchContext.from_env(make_env()).deterministic


@pytest.mark.parametrize("te,matched", [("2.17.0", True), ("2.17.1", True), ("2.18.0", False), ("2.20.0.dev0+d0067d0", False)])
def test_te_version_parsing(te, matched):
    sc = next(s for s in SCENARIOS if s.bug_id == "te-3333-sm120-thd-bwd")
    matches, _, _ = _run(sc, dict(te=te), {}, {})
    assert ("te-3333-sm120-thd-bwd" in _ids(matches)) is matched


# --------------------------------------------------------------------------- validation


GOOD = """
[[bug]]
id = "x-1"
title = "a title"
reference = "https://example.invalid/1"
[bug.when]
cudnn = "<9.0"
"""


def _write(tmp_path, text):
    p = tmp_path / "bugs.toml"
    p.write_text(text)
    return p


def test_minimal_file_loads(tmp_path):
    (bug,) = load_known_bugs(_write(tmp_path, GOOD))
    assert bug.id == "x-1" and bug.when == {"cudnn": "<9.0"} and bug.fixed_in is None and bug.scope == "environment"


def test_malformed_toml_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="not valid TOML"):
        load_known_bugs(_write(tmp_path, GOOD + "\n[[bug]\nid = \n"))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda t: t.replace('cudnn = "<9.0"', 'cudnn_version = "<9.0"'), "condition cudnn_version is unknown"),
        (lambda t: t.replace('title = "a title"\n', ""), "missing title"),
        (lambda t: t.replace('reference = "https://example.invalid/1"\n', ""), "missing reference"),
        (lambda t: t.replace('cudnn = "<9.0"', 'cudnn = "less than 9"'), "not a valid PEP 440 specifier"),
        (lambda t: t.replace('cudnn = "<9.0"', "window = 1"), "must be true or false"),
        (lambda t: t.replace('cudnn = "<9.0"', 'dtype = ["bf17"]'), "dtype must be"),
        (lambda t: t.replace('cudnn = "<9.0"', 'cudnn_in = ["nine"]'), "not a version"),
        (lambda t: t.replace("[bug.when]\n", 'symptom = "slow"\n[bug.when]\n'), "symptom 'slow'"),
        (lambda t: t.replace("[bug.when]\n", 'fixed-in = "9.1"\n[bug.when]\n'), "unknown field"),
        (lambda t: t.split("[bug.when]")[0], "non-empty \\[bug.when\\]"),
        (lambda t: t + t, "duplicate id"),
    ],
)
def test_bad_rule_raises_value_error_naming_the_bug(tmp_path, edit, message):
    with pytest.raises(ValueError, match=message) as info:
        load_known_bugs(_write(tmp_path, edit(GOOD)))
    assert "'x-1'" in str(info.value)


def test_missing_id_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="missing id") as info:
        load_known_bugs(_write(tmp_path, GOOD.replace('id = "x-1"\n', "")))
    assert "bug #1" in str(info.value) and "a title" in str(info.value)


def test_unreadable_file_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="cannot be read"):
        load_known_bugs(tmp_path / "missing.toml")


# --- where the matches are shown -------------------------------------------------------------------------------

def test_env_shows_the_defects_that_match_the_machine(monkeypatch, run_cli):
    """`attn-doctor env` prints the environment-level rules that match (the README's promise)."""
    from attn_doctor.cli import known
    from attn_doctor.machine import fingerprint

    sm120 = make_env(te_cudnn="9.17.0 (91700)", sm="sm_120")
    assert any("te-2693" in line or "2693" in line for line in known.machine_defects(sm120))
    h200 = make_env(te_cudnn="9.19.0 (91900)", sm="sm_90")
    assert known.machine_defects(h200) == [describe(m) for m in match_environment(BUGS, h200)]
    monkeypatch.setattr(fingerprint, "collect_env", lambda **kwargs: sm120)
    result = run_cli(["env", "--no-te"])
    assert result.exit_code == 0, result.output
    assert "Known TE/cuDNN defects that match this machine:" in result.stdout
    assert "2693" in " ".join(result.stdout.split())
    document = json.loads(run_cli(["env", "--no-te", "--json"]).stdout)
    assert document["known_defects"] and any("2693" in line for line in document["known_defects"])
    assert EnvReport.from_dict(document) == sm120
