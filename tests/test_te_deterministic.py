"""TE's deterministic mode as a path (`te.fused.det`), on the CPU without TE: a fake TE module in this process
stands in for transformer_engine.pytorch, as TE's own code behaves in the parts attn-doctor relies on
(NVTE_ALLOW_NONDETERMINISTIC_ALGO read in DotProductAttention.__init__ only, `_attention_backends` filled by
the forward's backend selection, the `deterministic` the selection and the fused submodule were given).
What the row says must come from what the fake reports, never from the flag attn-doctor set.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from attn_doctor.backends import te as te_backend

FLAG = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
TENSORS = ("out", "dq", "dk", "dv")


class FakeDotProductAttention(torch.nn.Module):
    """TE's DotProductAttention as far as attn-doctor reads it: sbhd in, [s, b, h*d] out."""

    honours_flag = True  # False: a TE that ignores NVTE_ALLOW_NONDETERMINISTIC_ALGO
    selection_reports = True  # False: a TE whose AttentionParams has no `deterministic`

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, softmax_scale=None, **parallel):
        super().__init__()
        self.causal = attn_mask_type == "causal"
        self.softmax_scale = softmax_scale
        # What TE's __init__ does: read the variable now, once.
        self.deterministic = self.honours_flag and not bool(int(os.getenv(FLAG, "1")))
        self.fused_attention = SimpleNamespace(deterministic=self.deterministic)
        self.flash_attention = SimpleNamespace(deterministic=self.deterministic)

    def forward(self, q, k, v):
        state = FAKE.state
        params = SimpleNamespace(deterministic=self.deterministic) if self.selection_reports else SimpleNamespace()
        if state["backend_selection_requires_update"] or state["attention_params"] != params:
            state["attention_params"] = params
            fused = os.environ.get("NVTE_FUSED_ATTN") == "1"
            state.update(use_flash_attention=False, flash_attention_backend=None, use_fused_attention=fused,
                         fused_attention_backend=1 if fused else None,
                         use_unfused_attention=os.environ.get("NVTE_UNFUSED_ATTN") == "1",
                         backend_selection_requires_update=False)
        if not (state["use_fused_attention"] or state["use_unfused_attention"]):
            raise ValueError(te_backend.NO_BACKEND_MESSAGE + " for the provided inputs.")
        s, b, h, d = q.shape
        hkv = k.shape[2]
        qh, kh, vh = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
        kh, vh = (t.repeat_interleave(h // hkv, dim=1) for t in (kh, vh))
        out = F.scaled_dot_product_attention(qh.float(), kh.float(), vh.float(), is_causal=self.causal,
                                             scale=self.softmax_scale).to(q.dtype)
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _fresh_state() -> dict:
    return {"attention_params": None, "use_flash_attention": None, "flash_attention_backend": None,
            "use_fused_attention": None, "fused_attention_backend": None, "use_unfused_attention": None,
            "backend_selection_requires_update": False}


FAKE = SimpleNamespace(te=SimpleNamespace(DotProductAttention=FakeDotProductAttention), state=_fresh_state(),
                       capture=SimpleNamespace(lines=[]), flash_utils=None)


@pytest.fixture
def fake_te(monkeypatch):
    """The fake TE loaded in this process (as `prepare_process` would load the real one); every variable
    attn-doctor sets is restored afterwards."""
    FAKE.state = _fresh_state()
    monkeypatch.setattr(te_backend, "_te", FAKE)
    monkeypatch.setattr(te_backend, "_import_error", None)
    for name in (FLAG, "NVTE_FUSED_ATTN_BACKEND", *te_backend.FLAGS.values()):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(FakeDotProductAttention, "honours_flag", True)
    monkeypatch.setattr(FakeDotProductAttention, "selection_reports", True)
    return FAKE


def _spec(name):
    from attn_doctor.backends import select

    (spec,) = select([name])
    return spec


def _probe(name, small_case, repeats=1):
    """Run the path's CALL probe in this process, as a worker runs it."""
    from attn_doctor.backends import build
    from attn_doctor.core.coords import Coords
    from attn_doctor.probes import Caches, run_probe

    backend = build(_spec(name))
    return backend, run_probe(backend, Coords.call(small_case, _spec(name)), Caches(torch.device("cpu")),
                              repeats=repeats)


# --- declared like every TE path ----------------------------------------------------------------------------

def test_the_deterministic_path_is_declared_and_selected_like_the_others():
    from attn_doctor.backends import builtin_specs, select, selector, static_skip
    from attn_doctor.core.case import make_case

    spec = _spec("te.fused.det")
    assert spec.family == "te" and spec.options == {"path": "fused", "deterministic": True}
    assert spec in select(["te"]) and spec in builtin_specs() and spec in select([])
    assert selector(spec) == "--backend te.fused.det"
    assert "CUDA" in static_skip(spec, make_case(), "cpu")
    assert [s.name for s in select(["te"])][:3] == ["te.flash", "te.fused", "te.fused.det"]


def test_the_deterministic_path_is_honoured_and_bitwise_reproducible(fake_te, small_case):
    backend, outcome = _probe("te.fused.det", small_case, repeats=3)
    assert outcome.status == "ok", outcome.reason
    assert outcome.ran == "FusedAttention (sub-backend 1: F16_arbitrary_seqlen), deterministic"
    facts = outcome.extra["deterministic"]
    assert facts["requested"] and facts["honoured"]
    assert (facts["module"], facts["selection"], facts["kernel"]) == (True, True, True)
    assert facts["kernel_module"] == "FusedAttention"
    assert outcome.extra["repeats"]["identical"] == {name: True for name in TENSORS}
    (module,) = backend._modules.values()
    assert module.deterministic is True
    assert FLAG not in os.environ  # set while the module was built, not left for the other paths
    assert os.environ["NVTE_FUSED_ATTN"] == "1" and os.environ["NVTE_FLASH_ATTN"] == "0"  # forced like te.fused


def test_the_plain_fused_path_stays_nondeterministic_and_says_nothing_of_it(fake_te, small_case):
    _, det = _probe("te.fused.det", small_case)
    backend, plain = _probe("te.fused", small_case)  # after the deterministic one, in the same process
    assert plain.ran == "FusedAttention (sub-backend 1: F16_arbitrary_seqlen)"
    assert "deterministic" not in plain.extra
    (module,) = backend._modules.values()
    assert module.deterministic is False
    assert "deterministic" in det.extra


def test_a_te_that_ignores_the_flag_is_reported_not_honoured(fake_te, small_case, monkeypatch):
    monkeypatch.setattr(FakeDotProductAttention, "honours_flag", False)
    _, outcome = _probe("te.fused.det", small_case)
    assert outcome.status == "ok"
    assert outcome.ran.startswith("FusedAttention (sub-backend 1: F16_arbitrary_seqlen), deterministic requested, "
                                  "not honoured (")
    assert "DotProductAttention.deterministic is False" in outcome.ran
    assert "FusedAttention.deterministic is False" in outcome.ran
    facts = outcome.extra["deterministic"]
    assert facts["requested"] and not facts["honoured"]


def test_a_selection_that_does_not_report_determinism_is_not_taken_for_honoured(fake_te, small_case, monkeypatch):
    monkeypatch.setattr(FakeDotProductAttention, "selection_reports", False)
    _, outcome = _probe("te.fused.det", small_case)
    assert "not honoured (the backend selection's AttentionParams.deterministic is not reported)" in outcome.ran
    assert outcome.extra["deterministic"]["selection"] is None and not outcome.extra["deterministic"]["honoured"]


def test_the_users_own_setting_is_restored_and_read_back(fake_te, small_case, monkeypatch):
    """A user who set the variable to 1 gets it back after the deterministic module is built; one who set it
    to 0 sees te.fused reported deterministic too (read back, not assumed)."""
    monkeypatch.setenv(FLAG, "1")
    _, det = _probe("te.fused.det", small_case)
    assert det.extra["deterministic"]["honoured"] and os.environ[FLAG] == "1"
    monkeypatch.setenv(FLAG, "0")
    _, plain = _probe("te.fused", small_case)
    assert plain.ran.endswith(", deterministic")
    assert plain.extra["deterministic"]["requested"] is False and plain.extra["deterministic"]["honoured"]
    assert os.environ[FLAG] == "0"


def test_read_determinism_needs_every_readback():
    state = {"attention_params": SimpleNamespace(deterministic=True), "use_fused_attention": True}
    module = SimpleNamespace(deterministic=True, fused_attention=SimpleNamespace(deterministic=True))
    assert te_backend.read_determinism(module, state, requested=True)["honoured"]
    unfused = {"attention_params": SimpleNamespace(deterministic=True), "use_unfused_attention": True}
    assert te_backend.read_determinism(SimpleNamespace(deterministic=True), unfused, requested=True)["honoured"]
    lost = SimpleNamespace(deterministic=True, fused_attention=SimpleNamespace(deterministic=False))
    facts = te_backend.read_determinism(lost, state, requested=True)
    assert not facts["honoured"] and facts["not_honoured_by"] == ["FusedAttention.deterministic is False"]
    no_attribute = SimpleNamespace(fused_attention=SimpleNamespace())
    facts = te_backend.read_determinism(no_attribute, state, requested=True)
    assert not facts["honoured"] and facts["module"] is None
    assert te_backend.read_determinism(SimpleNamespace(deterministic=False), state, requested=False) == {}
    assert te_backend.describe_determinism({}) == ""


def test_the_deterministic_repro_sets_the_flag_before_te_builds_the_module():
    from attn_doctor.backends import repro_source

    det, plain = repro_source(_spec("te.fused.det")), repro_source(_spec("te.fused"))
    assert f"'{FLAG}': '0'" in det and FLAG not in plain.split("print(")[0]
    assert det.index(FLAG) < det.index("import transformer_engine")
    for source in (det, plain):
        compile(source, "repro", "exec")


def test_known_defects_match_the_deterministic_path_as_deterministic():
    """A rule for deterministic mode (TE disables deterministic FusedAttention on sm120) matches a run with
    te.fused.det rows, and not one with te.fused rows alone on a machine that did not set the variable."""
    from attn_doctor.cli.known import known_defects
    from attn_doctor.core.case import make_case
    from attn_doctor.core.coords import Coords
    from attn_doctor.results.report import RunReport
    from attn_doctor.results.row import Row
    from test_known_defects import make_env

    env = make_env(te_cudnn="9.19.0 (91900)", sm="sm_120")
    case = make_case(batch=1, seq=16, heads=2, head_dim=8)

    def report(names):
        rows = [Row(Coords.call(case, _spec(name)), "SKIP", reason="x") for name in names]
        return RunReport(command="attn-doctor run", device="cuda", env=env, rows=rows)

    assert any("2798" in line for line in known_defects(report(["te.fused", "te.fused.det"])))
    assert not any("2798" in line for line in known_defects(report(["te.fused", "te.unfused"])))


def test_a_window_on_cross_attention_runs_on_te_aligned_as_te_aligns_it(monkeypatch):
    """TE places a sliding window from the bottom-right corner when seq_q != seq_kv (seen on the H200:
    reports/h200/verdicts); issue 15 skipped such cases for TE. The reference now aligns windows as TE does
    (attn_doctor.numerics.masks), so TE rows run them."""
    from attn_doctor.backends import select, static_skip
    from attn_doctor.core.case import make_case
    from attn_doctor.numerics.masks import visibility

    monkeypatch.setattr(te_backend, "te_installed", lambda: True)
    spec = next(s for s in select(["te"]) if s.name == "te.unfused")
    cross = make_case(seq=64, seq_kv=16, mask="none", window=(0, 0))
    assert static_skip(spec, cross, "cuda") is None
    assert visibility(cross, 64, 16).diag == 16 - 64  # bottom-right: query 48 sees key 0
    causal = make_case(seq=64, seq_kv=16, mask="causal", window=(4, 0))
    assert visibility(causal, 64, 16).diag == 0  # causal windows stay top-left, as in TE
