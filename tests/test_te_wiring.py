"""How the TE backend hands a case to TE (formats, thd packing and cu_seqlens, padding masks, explicit masks,
bias, ALiBi, sinks, MLA head dims), checked on the CPU against a stand-in for TE's DotProductAttention that
computes what TE documents from exactly the arguments TE would get. A wiring mistake (a format mislabelled,
a mask's polarity flipped, the sink's gradient read from the wrong tensor) makes a correct kernel FAIL here,
where the H200 is not needed to see it."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from attn_doctor.backends import BackendSpec, select
from attn_doctor.backends import te as te_backend
from attn_doctor.core.case import make_case
from attn_doctor.core.coords import Coords
from attn_doctor.numerics import standalone
from attn_doctor.probes import Caches, run_probe
from attn_doctor.results.row import Row
from attn_doctor.verdict.judge import judge
from attn_doctor.verdict.rule import PASS
from tests.test_te_api import _te_alibi, _te_visible


class StandInDotProductAttention(torch.nn.Module):
    """TE's DotProductAttention's documented contract, computed plainly in fp32."""

    def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                 qkv_format="sbhd", attn_mask_type="causal", window_size=None, softmax_scale=None,
                 attention_type="self", softmax_type="vanilla", return_max_logit=False):
        super().__init__()
        self.return_max_logit = return_max_logit
        assert attention_dropout == 0.0
        self.heads, self.fmt, self.mask_type = num_attention_heads, qkv_format, attn_mask_type
        self.d, self.dv = kv_channels if isinstance(kv_channels, tuple) else (kv_channels, kv_channels)
        self.window, self.scale, self.attention_type = window_size, softmax_scale, attention_type
        if softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.zeros(num_attention_heads))
        elif softmax_type == "off-by-one":
            self.softmax_offset = torch.zeros(num_attention_heads)
        else:
            self.softmax_offset = None

    def _padded(self, t, cu, cu_padded, batch, seq):
        """thd -> [b, seq, h, d] (zeros past each length), differentiably."""
        starts = (cu_padded if cu_padded is not None else cu).tolist()
        rows = []
        for b in range(batch):
            n = int(cu[b + 1] - cu[b])
            part = t[starts[b]:starts[b] + n]
            rows.append(torch.cat([part, part.new_zeros(seq - n, *t.shape[1:])]))
        return torch.stack(rows)

    def forward(self, q, k, v, attention_mask=None, cu_seqlens_q=None, cu_seqlens_kv=None, max_seqlen_q=None,
                max_seqlen_kv=None, cu_seqlens_q_padded=None, cu_seqlens_kv_padded=None, pad_between_seqs=None,
                core_attention_bias_type="no_bias", core_attention_bias=None, alibi_slopes=None, num_splits=1):
        assert isinstance(num_splits, int) and num_splits >= 1
        state = te_backend._te.state
        state.update(use_fused_attention=True, fused_attention_backend=1, use_flash_attention=False,
                     use_unfused_attention=False, backend_selection_requires_update=False,
                     attention_params=SimpleNamespace(qkv_layout=f"{self.fmt} (stand-in)"))
        if self.fmt == "thd":
            assert q.dim() == 3 and cu_seqlens_q.dtype == torch.int32
            batch = len(cu_seqlens_q) - 1
            lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
            lengths_kv = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).tolist()
            qb = self._padded(q, cu_seqlens_q, cu_seqlens_q_padded, batch, max_seqlen_q)
            kb = self._padded(k, cu_seqlens_kv, cu_seqlens_kv_padded, batch, max_seqlen_kv)
            vb = self._padded(v, cu_seqlens_kv, cu_seqlens_kv_padded, batch, max_seqlen_kv)
        else:
            assert q.dim() == 4
            qb, kb, vb = (t if self.fmt == "bshd" else t.transpose(0, 1) for t in (q, k, v))
            batch = qb.shape[0]
            lengths_q, lengths_kv = [qb.shape[1]] * batch, [kb.shape[1]] * batch
            if self.mask_type.startswith("padding"):  # sequences padded at the end, lengths in cu_seqlens
                assert cu_seqlens_q.dtype == torch.int32 and len(cu_seqlens_q) == batch + 1
                lengths_q = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist()
                lengths_kv = (cu_seqlens_kv[1:] - cu_seqlens_kv[:-1]).tolist()
                if attention_mask is not None:  # TE's boolean padding mask: one for self-, a pair for cross-attention
                    pair = attention_mask if self.attention_type == "cross" else (attention_mask, attention_mask)
                    for side, lengths in zip(pair, (lengths_q, lengths_kv)):
                        expected = torch.arange(side.shape[-1])[None, :] >= torch.tensor(lengths)[:, None]
                        assert side.dtype == torch.bool and torch.equal(side.view(batch, -1), expected)
        padded = self.mask_type.startswith("padding")
        case = make_case(batch=batch, seq=qb.shape[1], seq_kv=kb.shape[1], heads=self.heads,
                         kv_heads=kb.shape[2], head_dim=self.d, mask=self.mask_type, window=self.window,
                         **({"seqlens": tuple(lengths_q), "seqlens_kv": tuple(lengths_kv)} if padded else {}),
                         **({"mask_source": "random:0.5"} if self.mask_type == "arbitrary" else {}))
        visible = _te_visible(case)
        if self.mask_type == "arbitrary":
            visible &= ~attention_mask  # TE: True = masked out
        bias = None
        if core_attention_bias_type == "alibi" and alibi_slopes is not None:  # [heads] or [batch, heads], fp32
            assert alibi_slopes.dtype == torch.float32
            slopes = alibi_slopes.double().expand(batch, self.heads)
            bias = torch.stack([standalone.alibi_bias(slopes[b], self.mask_type, lengths_q[b], lengths_kv[b],
                                                      qb.shape[1], kb.shape[1], "cpu") for b in range(batch)]).float()
        elif core_attention_bias_type == "alibi":
            bias = _te_alibi(case).float()
        elif core_attention_bias_type == "post_scale_bias":
            bias = core_attention_bias.float()
        group = self.heads // kb.shape[2]
        qh = qb.float().transpose(1, 2)
        kh, vh = (t.float().transpose(1, 2).repeat_interleave(group, dim=1) for t in (kb, vb))
        scores = qh @ kh.transpose(-1, -2) * self.scale
        if bias is not None:
            scores = scores + bias
        scores = scores.masked_fill(~visible, float("-inf"))
        max_logit = scores.amax(dim=(0, 2, 3)) if self.return_max_logit else None
        if self.softmax_offset is not None:
            sink = self.softmax_offset.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
            scores = torch.cat([scores, sink], -1)
        probs = torch.nan_to_num(torch.softmax(scores, -1), nan=0.0)[..., :kb.shape[1]]
        out = (probs @ vh).transpose(1, 2).to(q.dtype)  # [b, s, h, dv]
        if self.fmt == "thd":
            starts = (cu_seqlens_q_padded if cu_seqlens_q_padded is not None else cu_seqlens_q).tolist()
            flat = out.new_zeros(q.shape[0], self.heads, self.dv)
            parts = [flat[:starts[0]]]
            for b in range(batch):
                n = lengths_q[b]
                end = starts[b + 1] if b + 1 < len(starts) else q.shape[0]
                parts += [out[b, :n], flat[starts[b] + n:end]]
            out = torch.cat(parts)
        elif self.fmt == "sbhd":
            out = out.transpose(0, 1)
        out = out.reshape(*out.shape[:-2], self.heads * self.dv)
        return (out, max_logit) if self.return_max_logit else out


@pytest.fixture
def stand_in_te(monkeypatch):
    fake = SimpleNamespace(te=SimpleNamespace(DotProductAttention=StandInDotProductAttention),
                           state={"backend_selection_requires_update": True}, capture=SimpleNamespace(lines=[]),
                           flash_utils=None, dpa_module=SimpleNamespace(_alibi_cache={}))
    monkeypatch.setattr(te_backend, "_te", fake)
    monkeypatch.setattr(te_backend, "_import_error", None)
    saved = {name: os.environ.get(name) for name in [*te_backend.FLAGS.values(), te_backend.UNFUSED_FP8_EMULATION]}
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


WIRING_CASES = {
    "bshd": dict(batch=2, seq=24, mask="no_mask", qkv_format="bshd"),
    "sbhd causal GQA": dict(batch=2, seq=24, mask="causal", kv_heads=2),
    "bshd cross bottom-right": dict(batch=2, seq=24, seq_kv=16, mask="causal_bottom_right", qkv_format="bshd"),
    "sbhd padding self": dict(seqlens=(24, 9, 0), seq=24, mask="padding_causal"),
    "bshd padding cross": dict(seqlens=(24, 9, 3), seqlens_kv=(5, 20, 0), seq=24, seq_kv=20,
                               mask="padding_causal_bottom_right", qkv_format="bshd"),
    "thd ragged": dict(seqlens=(24, 9, 1, 0), seq=24, mask="padding_causal", qkv_format="thd", kv_heads=2),
    "thd pad between, window": dict(seqlens=(20, 9, 1), seq=24, mask="padding", qkv_format="thd",
                                    pad_between_seqs=True, window=(4, 2)),
    "thd cross": dict(seqlens=(24, 9, 3), seqlens_kv=(5, 20, 0), seq=24, seq_kv=20, mask="padding",
                      qkv_format="thd"),
    "arbitrary": dict(batch=2, seq=24, mask="arbitrary", mask_source="random:0.6", qkv_format="bshd"),
    "bias bhss": dict(batch=2, seq=24, mask="causal", bias="post_scale_bias:bhss"),
    "alibi": dict(batch=2, seq=24, seq_kv=32, mask="no_mask", bias="alibi", window=(6, 2)),
    "learnable sink thd": dict(seqlens=(24, 9, 0), seq=24, mask="padding_causal", qkv_format="thd",
                               softmax="learnable"),
    "off-by-one": dict(batch=2, seq=24, mask="causal", softmax="off-by-one", qkv_format="bshd"),
    "MLA thd": dict(seqlens=(24, 9), seq=24, mask="padding_causal", qkv_format="thd", head_dim=32, head_dim_v=16),
    "max logit, padding mask": dict(seqlens=(24, 9, 3), seq=24, mask="padding_causal", qkv_format="bshd",
                                    return_max_logit=True, padding_mask=True, bias="post_scale_bias:1hss"),
    "padding mask cross": dict(seqlens=(24, 9, 3), seqlens_kv=(5, 20, 1), seq=24, seq_kv=20, mask="padding",
                               padding_mask=True),
    "custom slopes per sequence, num_splits": dict(seqlens=(24, 9), seq=24, mask="padding_causal_bottom_right",
                                                   bias="alibi", alibi_slopes="random-batch", num_splits=2),
    "custom slopes, max logit, forward only": dict(batch=2, seq=24, mask="causal", bias="alibi",
                                                   alibi_slopes="random", return_max_logit=True, forward_only=True),
}


@pytest.mark.parametrize("layout", ["contiguous", "kv_2hd"])
@pytest.mark.parametrize("fields", WIRING_CASES.values(), ids=list(WIRING_CASES))
def test_te_gets_each_case_as_te_defines_it(stand_in_te, fields, layout):
    case = make_case(**{"heads": 4, "head_dim": 16, "dtype": "fp32", **fields})
    spec = BackendSpec("te.fused", "te", {"path": "fused"})
    caches = Caches(torch.device("cpu"))
    rows = []
    for one, where in ((select(["local"])[0], "contiguous"), (spec, layout)):
        from attn_doctor.backends import build

        coords = Coords.call(case, one, where)
        if coords.unsupported():
            pytest.skip(coords.unsupported())
        outcome = run_probe(build(one), coords, caches)
        assert outcome.status == "ok", outcome.reason
        rows.append(Row(coords=coords, verdict="", ran=outcome.ran, metrics=outcome.metrics, extra=outcome.extra))
    te_row = judge(rows)[1]
    assert te_row.verdict == PASS, te_row.reason
    assert f"layout {case.qkv_format}" in te_row.ran
    if case.softmax == "learnable":
        assert te_row.tensors["dsink"].verdict == PASS and te_row.tensors["dsink"].rel_err < 1e-5
    if case.return_max_logit:  # TE's max logit reached the verdict, and is what TE documents
        assert te_row.tensors["max_logit"].verdict == PASS and te_row.tensors["max_logit"].rel_err < 1e-5
    if case.forward_only:
        assert set(te_row.tensors) <= {"out", "max_logit"}


def test_mxfp8_is_a_skip_with_te_s_own_reason_where_te_has_none(stand_in_te):
    from attn_doctor.backends import build

    te_backend._te.te.is_mxfp8_available = lambda return_reason=False: (
        (False, "MXFP8 (for all gemm layouts) is not supported on 9.0+ architectures yet.") if return_reason else False)
    case = make_case(batch=2, seq=24, heads=4, head_dim=32, mask="causal", fp8="mxfp8")
    spec = BackendSpec("te.fused", "te", {"path": "fused"})
    outcome = run_probe(build(spec), Coords.call(case, spec, "contiguous"), Caches(torch.device("cpu")))
    assert outcome.status == "skip"
    assert outcome.reason == "TE: MXFP8 is not available here: MXFP8 (for all gemm layouts) is not supported on 9.0+ " \
                             "architectures yet."


@pytest.mark.parametrize("ran_unfused", [True, False])
def test_the_f16_backward_on_te_s_unfused_path_is_a_skip_as_it_ran_not_as_it_was_asked(stand_in_te, monkeypatch,
                                                                                       ran_unfused):
    """TE's unfused path emulates FP8 in its backward whatever NVTE_FP8_DPA_BWD says: read back, its row is a SKIP
    (judged as an F16 backward its FP8 gradients failed). FusedAttention, which honours the flag, is judged."""
    import contextlib

    from attn_doctor.backends import build, te_call

    class Unfused(StandInDotProductAttention):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            te_backend._te.state.update(use_fused_attention=False, use_unfused_attention=True)
            return out

    if ran_unfused:
        te_backend._te.te.DotProductAttention = Unfused
    monkeypatch.setattr(te_call, "fp8_autocast", lambda te, recipe: contextlib.nullcontext())
    case = make_case(batch=2, seq=24, heads=4, head_dim=32, mask="causal", fp8="current", fp8_backward="f16")
    spec = BackendSpec("te.unfused" if ran_unfused else "te.fused", "te",
                       {"path": "unfused" if ran_unfused else "fused"})
    outcome = run_probe(build(spec), Coords.call(case, spec, "contiguous"), Caches(torch.device("cpu")))
    if ran_unfused:
        assert outcome.status == "skip" and "whatever NVTE_FP8_DPA_BWD says" in outcome.reason
    else:
        assert outcome.status == "ok", outcome.reason
        assert os.environ[te_call.FP8_BACKWARD_FLAG] == "0"
