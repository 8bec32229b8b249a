"""Known-bug recognition: the shipped data file, the loader's validation, the tricky conditions, symptoms
present and absent ("not reproduced here"), and where the matches are shown.

Every rule is also tested from its own [bug.when] table, key by key, in tests/test_known_defects_rules.py.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import attn_doctor.known_defects as known_defects
from attn_doctor.core.case import Case, make_case
from attn_doctor.known_defects import (
    CASE_KEYS,
    COMPONENTS,
    CONDITION_KEYS,
    ENV_KEYS,
    SYMPTOMS,
    KnownBug,
    MatchContext,
    Probe,
    describe,
    describe_finding,
    find_known_bugs,
    known_bugs_path,
    load_known_bugs,
    match_case,
    match_environment,
    sub_backend_from_ran,
)
from attn_doctor.known_defects.conditions import CONDITION_BY_KEY, CONDITIONS
from attn_doctor.known_defects.loading import _VALIDATORS
from attn_doctor.machine.fingerprint import EnvReport

BACKEND_NAMES = CONDITION_BY_KEY["backend"].choices  # the path names a rule's backend may list

ROOT = Path(__file__).resolve().parents[1]
TE_TREE = "https://github.com/NVIDIA/TransformerEngine"
STRIDED = "attn-doctor-te-fused-strided-views"

BUGS = load_known_bugs()
BY_ID = {b.id: b for b in BUGS}


def make_env(
    te: str | None = "2.20.2",
    te_cudnn: str | None = "9.19.0 (91900)",
    torch_cudnn: str | None = None,
    sm: str | tuple[str, ...] | None = "sm_90",
    env_vars: dict | None = None,
    torch: str | None = "2.11.0+cu130",
    flash_attn: dict[str, str] | None = None,
) -> EnvReport:
    """An EnvReport with only the facts the rules read; None = unknown (not installed / no GPU).
    flash_attn: installed flash-attn versions by family, e.g. {"v4": "4.0.0b36"}."""
    sms = () if sm is None else ((sm,) if isinstance(sm, str) else sm)
    flash = flash_attn or {}
    d = {
        "te": {"value": te, "note": None if te else "not installed"},
        "te_cudnn": {"value": te_cudnn, "note": None if te_cudnn else "not probed"},
        "torch": {"value": torch, "note": None if torch else "not installed"},
        "torch_cudnn": {"value": torch_cudnn, "note": None if torch_cudnn else "cuDNN not available to torch"},
        "gpus": [{"index": i, "name": "GPU", "sm": s, "memory_total_mib": 1} for i, s in enumerate(sms)],
        "flash_attn": {key: {"value": flash.get(key), "note": None if key in flash else "not installed"}
                       for key in ("v2", "v3", "v4")},
        "env_vars": env_vars or {},
    }
    return EnvReport.from_dict(d)


def _ids(matches) -> list[str]:
    return [m.bug.id for m in matches]


def _context(**fields) -> MatchContext:
    return MatchContext(**{"qkv_format": "sbhd", "backend": "te.fused", "sub_backend": 1, "layout": "contiguous",
                           **fields})


def _findings(env: EnvReport, *probes: Probe) -> dict[str, object]:
    return {f.bug.id: f for f in find_known_bugs(BUGS, env, list(probes))}


# --------------------------------------------------------------------------- the shipped file


def test_shipped_file_loads_with_required_fields():
    assert known_bugs_path().parent.name == "data" and known_bugs_path().is_file()
    assert len(BUGS) >= 50
    for bug in BUGS:
        assert isinstance(bug, KnownBug)
        assert bug.id and bug.title and bug.reference, bug
        assert bug.source is None or bug.source.startswith("https://"), bug.id
        assert all(u.startswith("https://") for u in bug.see_also), bug.id
        assert bug.symptom in SYMPTOMS, bug.id
        assert bug.component in COMPONENTS, bug.id
        assert bug.workaround, f"{bug.id}: every shipped rule says what to do"
        # Every rule names the path it is about, so that a run's probes can show (or not) its symptom.
        assert bug.when.get("backend"), bug.id
        assert bug.when and set(bug.when) <= set(CONDITION_KEYS), bug.id
        assert bug.scope in ("environment", "case")


def test_ids_unique():
    ids = [b.id for b in BUGS]
    assert len(ids) == len(set(ids))


def test_upstream_references_are_urls_and_attn_doctor_findings_name_committed_reports():
    found = [b for b in BUGS if b.found_by == "attn-doctor"]
    assert {b.id for b in found} >= {
        STRIDED, "attn-doctor-te-fused-bias-111s-bwd", "attn-doctor-te-fused-thd-head-dim-gt-128-bwd",
        "attn-doctor-te-unfused-causal-fewer-keys", "attn-doctor-te-fused-fp8-delayed-no-padding",
        "attn-doctor-te-flash-fa4-causal"}
    for bug in BUGS:
        if bug.found_by == "attn-doctor":
            assert (ROOT / bug.reference).is_file(), bug.id
            assert bug.fixed_in is None and "Found by attn-doctor" in (bug.note or ""), bug.id
            assert bug.label == "attn-doctor's finding"
        else:
            assert bug.reference.startswith("https://"), bug.id


# Every wrong-number bug of ../shared/reference/te-wrong-number-bugs.md, by the reference it is filed under.
WRONG_NUMBER_BUGS = [
    f"{TE_TREE}/issues/1195", f"{TE_TREE}/pull/1539", "https://github.com/pytorch/pytorch/pull/141147",
    "https://github.com/pytorch/pytorch/pull/138354", "https://github.com/Dao-AILab/flash-attention/pull/2545",
    "https://github.com/Dao-AILab/flash-attention/pull/2670", f"{TE_TREE}/issues/614", f"{TE_TREE}/pull/818",
    "https://github.com/NVIDIA/Megatron-LM/issues/2357", f"{TE_TREE}/issues/3333",
    "https://github.com/pytorch/pytorch/issues/196678", "https://github.com/NVIDIA/cudnn-frontend/pull/628",
    "https://github.com/NVIDIA/cudnn-frontend/issues/1072", "https://github.com/NVIDIA/cudnn-frontend/issues/160",
    "https://github.com/NVIDIA/Megatron-LM/issues/2011", "https://github.com/pytorch/pytorch/issues/166211",
    f"{TE_TREE}/issues/1197", f"{TE_TREE}/pull/1212", f"{TE_TREE}/pull/2344", f"{TE_TREE}/issues/3249",
    f"{TE_TREE}/pull/3470", f"{TE_TREE}/pull/3441", f"{TE_TREE}/issues/3248",
    "https://github.com/Dao-AILab/flash-attention/issues/2707", f"{TE_TREE}/pull/2236", f"{TE_TREE}/pull/2316",
    f"{TE_TREE}/pull/3173", "https://github.com/NVIDIA/cudnn-frontend/pull/414",
    "https://github.com/NVIDIA/cudnn-frontend/issues/981", f"{TE_TREE}/issues/2892", f"{TE_TREE}/issues/1930",
    f"{TE_TREE}/issues/3331", f"{TE_TREE}/pull/3332", f"{TE_TREE}/issues/2186", f"{TE_TREE}/issues/1557",
    "https://github.com/NVIDIA/Megatron-LM/issues/1464", "https://github.com/NVIDIA/Megatron-LM/issues/1465",
    f"{TE_TREE}/issues/3528", f"{TE_TREE}/pull/3532", f"{TE_TREE}/issues/3216",
    "https://github.com/Dao-AILab/flash-attention/issues/2552", f"{TE_TREE}/issues/2185", f"{TE_TREE}/issues/2448",
    "https://github.com/NVIDIA-NeMo/Megatron-Bridge/issues/2169", f"{TE_TREE}/issues/1615",
    "https://github.com/NVIDIA/Megatron-LM/issues/1503", "https://github.com/pytorch/pytorch/issues/193893",
    f"{TE_TREE}/pull/650", f"{TE_TREE}/pull/1937",
]


def test_every_wrong_number_bug_of_the_reference_has_a_rule():
    refs = {b.reference for b in BUGS} | {u for b in BUGS for u in b.see_also}
    assert [url for url in WRONG_NUMBER_BUGS if url not in refs] == []


def test_every_condition_key_is_documented_validated_and_read():
    doc = known_defects.__doc__
    validated = {c.key for c in CONDITIONS if c.kind in _VALIDATORS}
    for key in CONDITION_KEYS:
        assert f"``{key}``" in doc, key
        assert key in validated, key
    assert {c.key for c in CONDITIONS if c.scope == "case" and callable(c.check)} == set(CASE_KEYS)


def _documented_keys(doc: str) -> dict[str, str | None]:
    """The condition keys the package's docstring documents (its ``key`` spans under ``[bug.when]``), each
    with the scope heading it stands under (None before the first)."""
    section = doc.split("``[bug.when]``", 1)[1].split("\n\nA rule is machine-level", 1)[0]
    keys: dict[str, str | None] = {}
    scope = None
    for line in section.splitlines():
        heading = re.match(r"  (environment|run|path|case) \(", line)
        if heading:
            scope = heading.group(1)
        for key in re.findall(r"``(\w+)``", line):
            keys[key] = scope
    return keys


def test_the_documented_condition_keys_are_the_table():
    """Every key of the condition table is documented under its scope, and every key documented is in the
    table."""
    assert _documented_keys(known_defects.__doc__) == {c.key: c.scope for c in CONDITIONS}
    # The parse sees a key the docs leave out, and one they add.
    assert "batch_ge" not in _documented_keys(known_defects.__doc__.replace("``batch_ge``", "batch_ge"))
    assert "batch_le" in _documented_keys(known_defects.__doc__.replace("``batch_ge``", "``batch_le``"))


def _attn_doctor_imports(source: str) -> list[tuple[str, bool]]:
    """(attn_doctor subpackage, only for type checking) for each import of a module's source."""
    imports: list[tuple[str, bool]] = []

    def visit(node: ast.AST, typing_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test) == "TYPE_CHECKING":
                visit(child, True)
                continue
            names = ([child.module or ""] if isinstance(child, ast.ImportFrom)
                     else [alias.name for alias in child.names] if isinstance(child, ast.Import) else [])
            imports.extend((name.split(".")[1], typing_only) for name in names if name.startswith("attn_doctor."))
            visit(child, typing_only)

    visit(ast.parse(source), False)
    return imports


def test_the_package_imports_no_layer_above_it():
    """The known defects read core, the machine's fingerprint, the backend registry and results rows (for
    their type alone); the capture's one fact comes in as row_probe's argument, so tracing stays out."""
    package = Path(known_defects.__file__).parent
    imports = [found for source in package.glob("*.py") for found in _attn_doctor_imports(source.read_text())]
    assert {name for name, typing_only in imports if not typing_only} <= {"backends", "core", "known_defects"}
    assert {name for name, _ in imports} <= {"backends", "core", "known_defects", "machine", "results"}
    assert _attn_doctor_imports("from attn_doctor.tracing.replay import x") == [("tracing", False)]


def test_backend_names_cover_every_built_in_path():
    from attn_doctor.backends import REGISTRY, builtin_specs

    assert {spec.name for spec in builtin_specs()} <= set(BACKEND_NAMES)
    assert {family for family, cls in REGISTRY.items() if len(cls.paths()) > 1} <= set(BACKEND_NAMES)


# --------------------------------------------------------------------------- the strided-view fault


def _strided_probe(layout="transposed", verdict="FAIL", failing=("out", "dq", "dk", "dv"), **context):
    case = make_case(batch=2, seq=2, heads=1, head_dim=8, dtype="fp16", mask="none")
    return Probe(case, _context(layout=layout, **context), verdict, failing=frozenset(failing),
                 ran="FusedAttention (sub-backend 1: F16_arbitrary_seqlen); layout sbhd_sbhd_sbhd")


def test_strided_views_rule_states_the_mechanism_from_te_source():
    bug = BY_ID[STRIDED]
    assert bug.when["te"] == ">=1.12" and bug.fixed_in is None
    assert bug.when["backend"] == ["te.fused"] and bug.when["sub_backend"] == [1]
    assert bug.when["layout"] == ["head_slice", "transposed"] and bug.when["context_parallel"] is False
    for fact in ("get_qkv_layout", "check_strides_kv", "storage offsets", "generateMatrixStrides",
                 "fused_attn_f16_arbitrary_seqlen.cu", "dense", "2.20.2"):
        assert fact in bug.note, fact
    assert bug.source.endswith("dot_product_attention/utils.py#L2514-L2588")
    assert "contiguous" in bug.workaround and "NVTE_FUSED_ATTN=0" in bug.workaround


def test_strided_views_match_transposed_and_head_slice_and_nothing_dense():
    env = make_env(te="2.20.2", te_cudnn="9.14.0 (91400)")
    found = _findings(env, _strided_probe())
    assert found[STRIDED].reproduced
    line = describe_finding(found[STRIDED])
    assert line.startswith("te.fused on transposed (b2 s2 h1 d8 fp16 no_mask): this matches attn-doctor's finding")
    assert "no fixed version known; workaround: make q, k, v contiguous" in line and "reports/h200/README.md" in line
    # The suspected location `report --format issue` names, as it reads it from the line.
    from attn_doctor.render.report_data import code_locations

    assert f"Code: {BY_ID[STRIDED].source}; see reports/h200/README.md" in line
    assert code_locations([line]) == [BY_ID[STRIDED].source]
    for neighbour in (_strided_probe(layout="contiguous"), _strided_probe(layout="qkv_3hd"),
                      _strided_probe(sub_backend=2), _strided_probe(backend="te.unfused"),
                      _strided_probe(context_parallel=True, cp_size=2, cp_comm_type="p2p")):
        assert STRIDED not in _findings(env, neighbour)
    assert STRIDED in _findings(env, _strided_probe(backend="te.fused.det"))  # te.fused names its det variant


def test_strided_views_before_te_1_12_are_te_1195():
    env = make_env(te="1.11.0", te_cudnn="9.2.1 (90201)")
    found = _findings(env, _strided_probe(layout="head_slice"))
    assert "te-1195-strided-views-before-1.12" in found and STRIDED not in found
    assert describe_finding(found["te-1195-strided-views-before-1.12"]).count("this matches TE#1195") == 1
    assert "fixed in TE 1.12" in describe_finding(found["te-1195-strided-views-before-1.12"])
    assert STRIDED in _findings(make_env(te="1.12.0"), _strided_probe(layout="head_slice"))


def test_a_head_slice_that_passed_is_not_reproduced_here_and_said_so():
    """TE copies head-sliced views at a non-zero storage offset (run's head_slice layout), so they pass: the
    rule's conditions hold there, and the line says it was not reproduced instead of dropping it."""
    env = make_env(te_cudnn="9.14.0 (91400)")
    passed = _strided_probe(layout="head_slice", verdict="PASS", failing=())
    finding = _findings(env, passed)[STRIDED]
    assert not finding.reproduced and finding.quiet == (passed,)
    line = describe_finding(finding)
    assert line.startswith("not reproduced here: attn-doctor's finding: FusedAttention misreads")
    assert "its conditions hold for te.fused on head_slice" in line and line.endswith(
        "but it passed. See reports/h200/README.md")
    both = _findings(env, _strided_probe(), passed)[STRIDED]
    assert both.reproduced and both.quiet == (passed,)
    assert "(Its conditions also hold for te.fused on head_slice" in describe_finding(both)


# --------------------------------------------------------------------------- versions, facts, sub-backends


@pytest.mark.parametrize("te,matched", [("2.17.0", True), ("2.17.1", True), ("2.18.0", False),
                                        ("2.20.0.dev0+d0067d0", False), (None, False)])
def test_te_versions_dev_and_unknown(te, matched):
    env = make_env(te=te, te_cudnn="9.25.0 (92500)", sm="sm_120")
    ctx = _context(qkv_format="thd")
    assert ("te-3333-sm120-thd-bwd" in _ids(match_case(BUGS, env, make_case(), ctx))) is matched


@pytest.mark.parametrize("flash,fa4_b36_rule", [({"v4": "4.0.0b36"}, True), ({"v4": "4.0.0b11"}, False),
                                                ({"v2": "2.7.4"}, False), (None, False)])
def test_flash_attn_prerelease_versions(flash, fa4_b36_rule):
    env = make_env(flash_attn=flash)
    ctx = _context(backend="te.flash", sub_backend=None)
    ids = _ids(match_case(BUGS, env, make_case(mask="causal"), ctx))
    assert ("attn-doctor-te-flash-fa4-causal" in ids) is fa4_b36_rule
    assert ("te-3528-fa4-causal-window-sentinel" in ids) is (flash is not None and "v4" in flash)
    windowed = make_case(mask="causal", window=(128, 0))
    assert "te-3528-fa4-causal-window-sentinel" not in _ids(match_case(BUGS, env, windowed, ctx))


def test_torch_local_version_and_unknown_torch():
    case = make_case(batch=2, seq=64, heads=4, head_dim=8, mask="padding", seqlens=(64, 30))
    ctx = _context(backend="sdpa.cudnn", sub_backend=None, qkv_format=None)
    rule = "attn-doctor-sdpa-cudnn-ragged-padding-dkdv"
    assert rule in _ids(match_case(BUGS, make_env(torch="2.11.0+cu130"), case, ctx))
    assert rule not in _ids(match_case(BUGS, make_env(torch="2.10.0"), case, ctx))
    assert rule not in _ids(match_case(BUGS, make_env(torch=None), case, ctx))


def test_sdpa_rules_read_torchs_cudnn_and_te_rules_read_tes():
    """On the H200 TE loads cuDNN 9.14.0 and torch 9.19.0: an SDPA rule for 9.19-9.20 is about torch's."""
    env = make_env(te_cudnn="9.14.0 (91400)", torch_cudnn="9.19.0 (91900)", sm="sm_100")
    case = make_case(heads=16, kv_heads=2)
    sdpa = match_case(BUGS, env, case, _context(backend="sdpa.cudnn", sub_backend=None))
    m = next(m for m in sdpa if m.bug.id == "pytorch-193893-sdpa-cudnn-gqa-b200")
    assert "cuDNN 9.19.0 (torch's)" in m.evidence
    te_env = make_env(te_cudnn="9.19.0 (91900)", torch_cudnn="9.14.0 (91400)", sm="sm_100")
    assert "pytorch-193893-sdpa-cudnn-gqa-b200" not in _ids(
        match_case(BUGS, te_env, case, _context(backend="sdpa.cudnn", sub_backend=None)))
    swa = make_case(seq=2048, mask="none", window=(128, 128))
    assert "te-2344-cudnn-9.14-swa-nan" in _ids(match_case(BUGS, env, swa, _context()))


def test_cudnn_falls_back_to_torch_for_te_paths_and_says_so():
    env = make_env(te=None, te_cudnn=None, torch_cudnn="9.14.0 (91400)")
    swa = make_case(seq=2048, mask="none", window=(128, 128))
    m = next(m for m in match_case(BUGS, env, swa, _context()) if m.bug.id == "te-2344-cudnn-9.14-swa-nan")
    assert "cuDNN 9.14.0 (torch's; TE's unknown)" in m.evidence


@pytest.mark.parametrize("ran,sub", [("FusedAttention (sub-backend 1: F16_arbitrary_seqlen); layout sbhd_sbhd_sbhd", 1),
                                     ("FusedAttention (sub-backend 2: FP8); layout bshd_bshd_bshd", 2),
                                     ("FlashAttention (version 4.0.0b36); layout sb3hd", None), ("", None)])
def test_sub_backend_is_read_from_what_te_ran(ran, sub):
    assert sub_backend_from_ran(ran) == sub


def test_sub_backend_separates_fp8_from_f16():
    env = make_env(te_cudnn="9.14.0 (91400)")
    case = make_case(head_dim=128, mask="causal", fp8="delayed")
    rule = "attn-doctor-te-fused-fp8-delayed-no-padding"
    assert rule in _ids(match_case(BUGS, env, case, _context(sub_backend=2, fp8=True)))
    assert rule not in _ids(match_case(BUGS, env, case, _context(sub_backend=1, fp8=True)))
    assert rule not in _ids(match_case(BUGS, env, case, _context(sub_backend=None, fp8=True)))
    padded = make_case(head_dim=128, mask="padding_causal", fp8="delayed", seqlens=(1024,) * 4)
    assert rule not in _ids(match_case(BUGS, env, padded, _context(sub_backend=2, fp8=True)))


def test_cp_conditions_need_context_parallelism():
    env = make_env(te="2.17.1")
    case = make_case(batch=1, seq=698, heads=4, head_dim=64, mask="padding_causal", qkv_format="thd", seqlens=(698,))
    cp4 = _context(backend="te.fused", qkv_format="thd", context_parallel=True, cp_size=4, cp_comm_type="p2p")
    assert "te-3331-thd-cp-p2p-tail-padding" in _ids(match_case(BUGS, env, case, cp4))
    even = make_case(batch=1, seq=704, heads=4, head_dim=64, mask="padding_causal", qkv_format="thd", seqlens=(704,))
    assert "te-3331-thd-cp-p2p-tail-padding" not in _ids(match_case(BUGS, env, even, cp4))
    no_cp = _context(backend="te.fused", qkv_format="thd")
    assert "te-3331-thd-cp-p2p-tail-padding" not in _ids(match_case(BUGS, env, case, no_cp))


def test_mixed_gpus_name_the_matching_one():
    env = make_env(te_cudnn="9.17.0 (91700)", sm=("sm_90", "sm_120"))
    m = next(m for m in match_environment(BUGS, env) if m.bug.id == "te-2693-sm120-cudnn-lt-9.18.1")
    assert "sm_120 (GPU 1)" in m.evidence and m.evidence.endswith("; affects te.fused")


def test_unknown_facts_never_match():
    env = make_env(te=None, te_cudnn=None, torch_cudnn=None, sm=None, torch=None)
    everything = MatchContext(fp8=True, deterministic=True, kv_cache=True, cuda_graph=True, qkv_format="thd",
                              softmax_sink=True, context_parallel=True, cp_size=2, cp_comm_type="p2p",
                              dout_strided=True, causal_with_explicit_mask=True, varying_cu_seqlens=True,
                              recompute=True, backend="te.fused", sub_backend=1, layout="transposed")
    # Rules with no environment condition may match without facts; every other rule must not.
    facts_free = {b.id for b in BUGS if not set(b.when) & set(ENV_KEYS)}
    for case in (make_case(), make_case(seq=2048, mask="none", window=(128, 128)), make_case(seq=1000)):
        for ctx in (MatchContext.from_env(env), everything):
            assert set(_ids(match_case(BUGS, env, case, ctx))) <= facts_free
            assert set(_ids(match_environment(BUGS, env, ctx))) <= facts_free
    unknown_path = MatchContext(backend=None, sub_backend=None, layout=None, qkv_format=None)
    assert match_case(BUGS, make_env(), make_case(), unknown_path) == []


def test_default_context_is_attn_doctors_run():
    env = make_env(env_vars={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    ctx = MatchContext.from_env(env)
    assert ctx.training and ctx.deterministic
    assert not (ctx.fp8 or ctx.cuda_graph or ctx.context_parallel or ctx.kv_cache or ctx.softmax_sink or ctx.bias)
    assert ctx.qkv_format is None and ctx.backend is None and ctx.cp_size == 1
    assert not MatchContext.from_env(make_env()).deterministic
    fp8 = MatchContext.for_case(env, make_case(fp8="delayed", bias="post_scale_bias:111s"), backend="te.fused")
    assert fp8.fp8 and fp8.bias and not fp8.softmax_sink and fp8.deterministic and fp8.backend == "te.fused"


# --------------------------------------------------------------------------- symptoms present and absent


def _swa_probe(verdict: str, ran: str = "", failing: frozenset[str] = frozenset()) -> Probe:
    case = make_case(seq=2048, mask="none", window=(128, 128))
    return Probe(case, _context(sub_backend=1 if ran else None), verdict, ran=ran, failing=failing)


def test_backend_disabled_rule_is_reproduced_by_a_skip_and_not_by_a_run():
    """The H200 case (reports/h200/run-swa): TE 2.20.2 with cuDNN 9.14.0 ran FusedAttention with a non-causal
    window at s_kv 2048, where TE's source says it disables it, and was right."""
    env = make_env(te_cudnn="9.14.0 (91400)")
    ran = "FusedAttention (sub-backend 1: F16_arbitrary_seqlen); layout sbhd_sbhd_sbhd"
    finding = _findings(env, _swa_probe("PASS", ran=ran))["te-2344-cudnn-9.14-swa-nan"]
    assert not finding.reproduced
    assert describe_finding(finding).startswith("not reproduced here: TE#2344: cuDNN 9.14.0: NaN outputs")
    finding = _findings(env, _swa_probe("FAIL", ran=ran, failing=frozenset({"out"})))["te-2344-cudnn-9.14-swa-nan"]
    assert not finding.reproduced, "a FAIL without NaN is not this rule's symptom"
    disabled = BY_ID["te-2693-sm120-cudnn-lt-9.18.1"]
    sm120 = make_env(te_cudnn="9.17.0 (91700)", sm="sm_120")
    skipped = Probe(make_case(), _context(sub_backend=None), "SKIP", reason="TE: Disabling FusedAttention on sm120")
    finding = _findings(sm120, skipped)[disabled.id]
    assert finding.reproduced and "Skipped: TE: Disabling FusedAttention on sm120." in describe_finding(finding)
    finding = _findings(sm120, Probe(make_case(), _context(), "PASS", ran=ran))[disabled.id]
    assert not finding.reproduced and f"but the backend ran ({ran})" in describe_finding(finding)


def test_probes_that_cannot_tell_are_left_out():
    """A SKIP says nothing about wrong numbers, attn-doctor's own ERROR nothing at all."""
    env = make_env()
    case = make_case(batch=2, seq=64, heads=4, head_dim=64, mask="padding", seqlens=(64, 30), bias="post_scale_bias:111s")
    ctx = _context(bias=True)
    rule = "attn-doctor-te-fused-bias-111s-bwd"
    assert rule not in _findings(env, Probe(case, ctx, "SKIP", reason="x"))
    assert rule not in _findings(env, Probe(case, ctx, "ERROR", reason="attn-doctor bug", internal=True))
    assert _findings(env, Probe(case, ctx, "FAIL", failing=frozenset({"dq"})))[rule].reproduced
    assert not _findings(env, Probe(case, ctx, "FAIL", failing=frozenset({"out"})))[rule].reproduced
    assert _findings(env, Probe(case, ctx, "FAIL"))[rule].reproduced  # no per-tensor verdicts: any FAIL counts


def test_reproduced_findings_come_first_and_lines_carry_fix_and_workaround():
    env = make_env(te="2.17.1", te_cudnn="9.25.0 (92500)", sm="sm_120")
    thd = Probe(make_case(), _context(qkv_format="thd"), "FAIL", failing=frozenset({"dq", "dk"}))
    strided = _strided_probe(layout="head_slice", verdict="PASS", failing=())
    findings = find_known_bugs(BUGS, env, [strided, thd])
    assert [f.reproduced for f in findings] == sorted((f.reproduced for f in findings), reverse=True)
    line = describe_finding(next(f for f in findings if f.bug.id == "te-3333-sm120-thd-bwd"))
    assert "this matches TE#3333" in line and "fixed in TE 2.18" in line
    assert "workaround: upgrade to TE 2.18+, or set NVTE_FUSED_ATTN=0" in line


def test_machine_line_names_evidence_fix_workaround_and_reference():
    env = make_env(te_cudnn="9.17.0 (91700)", sm="sm_120")
    m = next(m for m in match_environment(BUGS, env) if m.bug.id == "te-2693-sm120-cudnn-lt-9.18.1")
    line = describe(m)
    assert line.startswith("TE#2693: sm120: FusedAttention needs cuDNN 9.18.1+ (backend disabled) — matches cuDNN 9.17.0 (TE's) + sm_120; affects te.fused")
    assert "fixed in cuDNN 9.18.1; workaround: upgrade cuDNN" in line and line.endswith(f"See {TE_TREE}/pull/2693")


def test_labels():
    assert BY_ID["te-3333-sm120-thd-bwd"].label == "TE#3333"
    assert BY_ID["pytorch-196678-negative-lse-dq-nan"].label == "pytorch/pytorch#196678"
    assert BY_ID["te-sm100-brcm-cross-attention"].label == "TE's fused_attn.cpp#L451-L463"


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
    assert bug.workaround is None and bug.found_by is None


def test_new_keys_load_in_canonical_form(tmp_path):
    text = GOOD.replace('cudnn = "<9.0"', 'seq_kv_mod = [128, 64]\nsub_backend = [1]\nbackend = ["te"]\n'
                                          'layout = ["transposed"]\nflash_attn = ">=4.0.0a0,<5"\nbias_shape = ["111s"]')
    (bug,) = load_known_bugs(_write(tmp_path, text))
    assert bug.when["seq_kv_mod"] == (128, 64) and bug.scope == "case"


def test_an_attn_doctor_finding_may_reference_a_report_path(tmp_path):
    text = GOOD.replace('reference = "https://example.invalid/1"', 'reference = "reports/h200/README.md"\n'
                                                                     'found_by = "attn-doctor"')
    (bug,) = load_known_bugs(_write(tmp_path, text))
    assert bug.reference == "reports/h200/README.md" and bug.label == "attn-doctor's finding"


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
        (lambda t: t.replace('cudnn = "<9.0"', 'flash_attn = "four"'), "not a valid PEP 440 specifier"),
        (lambda t: t.replace('cudnn = "<9.0"', "window = 1"), "must be true or false"),
        (lambda t: t.replace('cudnn = "<9.0"', 'dtype = ["bf17"]'), "dtype must be"),
        (lambda t: t.replace('cudnn = "<9.0"', 'backend = ["te.fast"]'), "backend must be"),
        (lambda t: t.replace('cudnn = "<9.0"', 'layout = ["diagonal"]'), "layout must be"),
        (lambda t: t.replace('cudnn = "<9.0"', "sub_backend = [3]"), "FusedAttention sub-backends"),
        (lambda t: t.replace('cudnn = "<9.0"', "seq_kv_mod = [64, 128]"), "0 <= r < m"),
        (lambda t: t.replace('cudnn = "<9.0"', "kv_heads_lt = 0"), ">= 1"),
        (lambda t: t.replace('cudnn = "<9.0"', 'cp_comm_type = ["ring"]'), "cp_comm_type must be"),
        (lambda t: t.replace('cudnn = "<9.0"', 'cudnn_in = ["nine"]'), "not a version"),
        (lambda t: t.replace("[bug.when]\n", 'symptom = "slow"\n[bug.when]\n'), "symptom 'slow'"),
        (lambda t: t.replace("[bug.when]\n", 'found_by = "someone"\n[bug.when]\n'), "found_by 'someone'"),
        (lambda t: t.replace("https://example.invalid/1", "reports/x.md"), "must be an https URL"),
        (lambda t: t.replace("https://example.invalid/1", "../x.md").replace(
            "[bug.when]\n", 'found_by = "attn-doctor"\n[bug.when]\n'), "relative path in this repository"),
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
    """`attn-doctor env` prints the machine-level rules that match (the README's promise)."""
    from attn_doctor.cli import known
    from attn_doctor.machine import fingerprint

    sm120 = make_env(te_cudnn="9.17.0 (91700)", sm="sm_120")
    assert any("TE#2693" in line for line in known.machine_defects(sm120))
    h200 = make_env(te_cudnn="9.14.0 (91400)", sm="sm_90")
    assert known.machine_defects(h200) == [describe(m) for m in match_environment(BUGS, h200)] == []
    monkeypatch.setattr(fingerprint, "collect_env", lambda **kwargs: sm120)
    result = run_cli(["env", "--no-te"])
    assert result.exit_code == 0, result.output
    assert "Known TE/cuDNN defects that match this machine:" in result.stdout
    assert "2693" in " ".join(result.stdout.split())
    document = json.loads(run_cli(["env", "--no-te", "--json"]).stdout)
    assert document["known_defects"] and any("2693" in line for line in document["known_defects"])
    assert EnvReport.from_dict(document) == sm120


def _committed(path: str):
    from attn_doctor.results.report import read_report

    return read_report(ROOT / path)


def test_run_report_from_the_h200_names_the_strided_fault_on_its_rows():
    """The committed H200 run (reports/h200/api): te.fused and te.fused.det FAIL on transposed, PASS on head_slice
    (TE copies those views); te.flash with FA4 FAILs under causal."""
    from attn_doctor.cli.known import known_defects

    lines = known_defects(_committed("reports/h200/api/run-default.json"))
    strided = next(line for line in lines if "FusedAttention misreads q/k/v views" in line)
    assert strided.startswith("te.fused, te.fused.det on transposed (b4 s1024 h16 d64 bf16 causal): this matches")
    assert "TE 2.20.2" in strided and "sub-backend 1 (F16_arbitrary_seqlen)" in strided
    assert "(Its conditions also hold for te.fused, te.fused.det on head_slice" in strided
    assert any(line.startswith("te.flash on contiguous, sb3hd_packed") and "this matches TE#3528" in line
               for line in lines)


def test_run_report_says_not_reproduced_here_for_the_h200_window_case():
    from attn_doctor.cli.known import known_defects

    (line,) = known_defects(_committed("reports/h200/run-swa/results.json"))
    assert line.startswith("not reproduced here: TE#2344") and line.endswith("but it passed. See " + TE_TREE + "/pull/2344")


def test_tp_shards_as_views_reproduce_the_strided_fault():
    from attn_doctor.cli.known import known_defects

    lines = known_defects(_committed("reports/h200/sweep-tp/results.json"))
    assert any(re.match(r"te\.fused on head_slice \(.*\): this matches attn-doctor's finding", line) for line in lines)


def test_a_row_becomes_a_probe_with_its_path_cp_and_tensors():
    from attn_doctor.backends import builtin_specs
    from attn_doctor.core.coords import Coords
    from attn_doctor.known_defects import row_probe
    from attn_doctor.results.row import Row

    spec = next(s for s in builtin_specs() if s.name == "te.fused.det")
    case = make_case(batch=2, seq=64, heads=4, head_dim=64, fp8="delayed")
    row = Row(Coords.distributed(case, spec, tp=1, cp=2, cp_comm_type="p2p"), "PASS",
              ran="FusedAttention (sub-backend 2: FP8); layout sbhd_sbhd_sbhd, deterministic")
    probe = row_probe(row, make_env())
    ctx = probe.context
    assert (ctx.backend, ctx.sub_backend, ctx.layout, ctx.qkv_format) == ("te.fused.det", 2, "contiguous", "sbhd")
    assert ctx.context_parallel and ctx.cp_size == 2 and ctx.cp_comm_type == "p2p"
    assert ctx.deterministic and ctx.fp8 and probe.verdict == "PASS" and probe.failing == frozenset()
    assert isinstance(probe.case, Case)
