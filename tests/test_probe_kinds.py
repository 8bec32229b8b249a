"""The table of what each kind of probe accepts (`attn_doctor.core.probe_kinds`): each entry on both sides, in
`Coords.unsupported` and on the command line, and every refusal run, sweep and bisect print for a kind made of
the table's words (the command adding only how to fix it)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import attn_doctor
from attn_doctor.core.case import Case, make_case
from attn_doctor.core.coords import BackendSpec, Coords
from attn_doctor.core.layouts import CAPTURED, LAYOUTS
from attn_doctor.core.probe_kinds import (
    KIND_RULES,
    ProbeKind,
    context_parallel_unsupported,
    dense_api_refusal,
    dense_api_skip,
    layout_choices,
    rules_for,
)
from cli_checks import one_line_error

SIZES = {"batch": 2, "seq": 16, "heads": 4, "head_dim": 8}
TINY = ["--batch", "2", "--seq", "16", "--heads", "4", "--head-dim", "8", "--device", "cpu", "--backend", "sdpa.math"]
THD = ["--qkv-format", "thd", "--seqlens", "8,4", "--mask", "padding"]
LOCAL = BackendSpec("local", "local")

PLAIN = make_case(**SIZES)
THD_CASE = make_case(seqlens=(8, 4), seq=16, heads=4, head_dim=8, mask="padding", qkv_format="thd")
REPLAYED = dataclasses.replace(PLAIN, replay="capture@0.1.0")  # Coords read the field only: no capture needed
CALL, REPLAY, TP, DEPTH, DISTRIBUTED = (rules_for(ProbeKind.CALL, PLAIN), rules_for(ProbeKind.CALL, REPLAYED),
                                        rules_for(ProbeKind.TP, PLAIN), rules_for(ProbeKind.DEPTH, PLAIN),
                                        rules_for(ProbeKind.DISTRIBUTED, PLAIN))


def case(**fields) -> Case:
    return make_case(**{**SIZES, **fields})


# --- the table ----------------------------------------------------------------------------------------------

def test_one_entry_per_kind_and_one_for_the_single_calls_of_a_replayed_case():
    assert [(rules.kind, rules.replayed) for rules in KIND_RULES] == [
        (ProbeKind.CALL, False), (ProbeKind.CALL, True), (ProbeKind.TP, False), (ProbeKind.DEPTH, False),
        (ProbeKind.DISTRIBUTED, False)]
    assert (CALL, REPLAY, TP, DEPTH, DISTRIBUTED) == KIND_RULES
    assert rules_for(ProbeKind.TP, REPLAYED) is TP  # a replayed case's TP shards are TP shards


def test_every_entry_that_refuses_something_carries_its_words():
    for rules in KIND_RULES:
        assert rules.layouts
        if not (rules.repeats and rules.takes_layout and rules.inputs):
            assert rules.flag in rules.name  # the fix-its ("drop --inputs or --layers") name the refused option
        if not rules.inputs:
            assert rules.inputs_reason and "{inputs}" in rules.inputs_skip


def test_layout_names_the_layouts_of_the_kinds_it_chooses_for():
    assert CALL.layouts == LAYOUTS and set(REPLAY.layouts) == {CAPTURED, *LAYOUTS}
    assert layout_choices() == LAYOUTS + (CAPTURED,)


def test_only_kinds_that_take_repeats_run_more_than_once():
    from attn_doctor.backends.local import LocalAttention
    from attn_doctor.execution.session import repeats_of
    from attn_doctor.probes import run_probe

    for coords in (Coords.call(PLAIN, LOCAL), Coords.call(REPLAYED, LOCAL, CAPTURED)):
        assert coords.kind_rules.repeats and repeats_of(coords, 3) == 3
    for coords in (Coords.tp_shards(PLAIN, LOCAL, 2, as_views=True), Coords.depth(PLAIN, LOCAL, 2),
                   Coords.distributed(PLAIN, LOCAL, 2, 1, None)):
        assert not coords.kind_rules.repeats and repeats_of(coords, 3) == 1
        with pytest.raises(ValueError, match="repeats apply to single calls only"):
            run_probe(LocalAttention(LOCAL), coords, caches=None, repeats=3)


# --- each entry on both sides: the coordinates' SKIP reasons ------------------------------------------------

@pytest.mark.parametrize("coords, reason", [
    # single calls: any layout that holds the case, any distribution and API feature
    (Coords.call(case(inputs="outliers"), LOCAL, "transposed"), None),
    (Coords.call(THD_CASE, LOCAL, "kv_2hd"), None),
    (Coords.call(THD_CASE, LOCAL, "transposed"),
     "transposed is a layout of padded sbhd/bshd tensors; thd packs tokens (use qkv_3hd, kv_2hd, ...)"),
    (Coords.call(PLAIN, LOCAL, CAPTURED), "the captured layout is a replayed call's (attn-doctor replay)"),
    # a replayed call: its own views too
    (Coords.call(REPLAYED, LOCAL, CAPTURED), None),
    (Coords.call(REPLAYED, LOCAL, "transposed"), None),
    # TP shards: views or copies, any distribution; the dense API, heads that split
    (Coords.tp_shards(case(inputs="outliers"), LOCAL, 2, as_views=True), None),
    (Coords.tp_shards(PLAIN, LOCAL, 4, as_views=False), None),
    (Coords(PLAIN, LOCAL, "transposed", ProbeKind.TP, tp=2), TP.off_layout),
    (Coords.tp_shards(THD_CASE, LOCAL, 2, as_views=True), dense_api_skip(THD_CASE)),
    (Coords.tp_shards(REPLAYED, LOCAL, 2, as_views=True), dense_api_skip(REPLAYED)),
    (Coords.tp_shards(case(heads=3), LOCAL, 2, as_views=True), "TP=2 needs heads (3) and kv heads (3) divisible by 2"),
    # depth stacks: self-attention on their own q, k, v, the dense API, heads that split
    (Coords.depth(PLAIN, LOCAL, 2, tp=2), None),
    (Coords.depth(case(seq_kv=24), LOCAL, 2), DEPTH.self_attention),
    (Coords.depth(case(inputs="outliers"), LOCAL, 2), DEPTH.inputs_skip.format(inputs="outliers")),
    (Coords.depth(case(bias="alibi"), LOCAL, 2), dense_api_skip(case(bias="alibi"))),
    (Coords.depth(case(heads=3), LOCAL, 2, tp=2), "TP=2 needs heads (3) and kv heads (3) divisible by 2"),
    # ranks: any distribution; cross-attention without CP; the dense API, heads and a sequence that split
    (Coords.distributed(case(inputs="outliers", seq_kv=24), LOCAL, 2, 1, None), None),
    (Coords.distributed(PLAIN, LOCAL, 2, 2, "a2a"), None),
    (Coords.distributed(case(seq_kv=24), LOCAL, 1, 2, "p2p"),
     "CP=2 splits one sequence for q, k and v: it needs self-attention (seq_kv == seq)"),
    (Coords.distributed(case(seq=18), LOCAL, 1, 2, "p2p"),
     "CP=2 splits the sequence into 4 equal chunks: seq (18) must be divisible by 4"),
    (Coords.distributed(case(heads=2, kv_heads=1), LOCAL, 1, 2, "a2a"),
     "CP a2a regroups heads over 2 ranks: heads per TP rank (2) and kv heads per TP rank (1) must be divisible by 2"),
    (Coords.distributed(case(mask="padding"), LOCAL, 1, 1, None), dense_api_skip(case(mask="padding"))),
], ids=lambda value: value.describe() if isinstance(value, Coords) else None)
def test_the_coordinates_of_each_kind_hold_what_its_entry_accepts(coords, reason):
    assert coords.unsupported() == reason


def test_the_skip_reasons_that_name_the_case_say_what_it_uses():
    assert dense_api_skip(THD_CASE) == ("TP shards, depth stacks and ranks model the dense API only; this case uses "
                                        "seqlens, mask padding, thd (check it as a single call)")
    assert DEPTH.inputs_skip.format(inputs="outliers") == (
        "the depth stack's q, k, v come from its seeded weights: inputs outliers applies to one attention call, TP "
        "shards and ranks, not to --layers")
    assert context_parallel_unsupported(PLAIN, 1, 2, "p2p") is None


# --- each entry on both sides: the command line -------------------------------------------------------------

class PassedTheChecks(Exception):
    """Raised where a command starts its first probe: everything before it accepted the request."""


@pytest.fixture
def checked_only(monkeypatch, tmp_path):
    """Commands stop where their probes would start; the reports they would write go under tmp_path."""
    def stop(*args, **kwargs):
        raise PassedTheChecks()

    monkeypatch.chdir(tmp_path)
    for target in ("attn_doctor.execution.session.Session", "attn_doctor.distributed.launch_many",
                   "attn_doctor.workflows.sweep.run", "attn_doctor.bisect.driver.Session"):
        monkeypatch.setattr(target, stop)


@pytest.fixture(scope="module")
def captured(tmp_path_factory) -> tuple[Path, str]:
    """A capture of one SDPA call, and the reference of that call."""
    from attn_doctor.tracing.replay_case import case_of
    from attn_doctor.tracing.store import read_capture

    root = tmp_path_factory.mktemp("capture")
    q = torch.randn(1, 2, 8, 4)
    with attn_doctor.capture(root):
        torch.nn.functional.scaled_dot_product_attention(q, q, q)
    (call,) = read_capture(root)
    return root, case_of(call, root).replay


REPEATS_FIX_SWEEP = "--layers/--tp (or the recipe's grid.layers/grid.tp)"
DENSE_FIX_RUN = ": check it as a single call (drop --tp/--nproc)"
NOTHING_TESTED = "nothing was tested: every requested path was skipped here; sdpa.math: "
TP_LAYOUT = ("--layout does not apply to TP shards (they are fed as head-sliced views and as contiguous copies); drop "
             "--layout or --tp")
DENSE_THD_RUN = ("--tp and --nproc model the dense API; this case uses seqlens, mask padding, thd: check it as a "
                 "single call (drop --tp/--nproc)")
DENSE_THD_SKIP = ("TP shards, depth stacks and ranks model the dense API only; this case uses seqlens, mask padding, "
                  "thd (check it as a single call)")

# (arguments, the table's words, the whole line the command prints after "attn-doctor: error: ")
REFUSED = {
    "run-tp-repeats": (["run", *TINY, "--tp", "2", "--repeats", "2"], TP.repeats_refusal(without="--tp"),
                       "--repeats applies to single calls (the layouts); TP shards (--tp) run once: drop --repeats, "
                       "or run the layouts without --tp"),
    "run-nproc-repeats": (["run", *TINY, "--nproc", "2", "--tp", "2", "--repeats", "2"],
                          DISTRIBUTED.repeats_refusal(without="--nproc"),
                          "--repeats applies to single calls (the layouts); --nproc ranks run once: drop --repeats, "
                          "or run the layouts without --nproc"),
    "sweep-tp-repeats": (["sweep", *TINY, "--tp", "1", "--repeats", "2"], TP.repeats_refusal(without=REPEATS_FIX_SWEEP),
                         "--repeats applies to single calls (the layouts); TP shards (--tp) run once: drop --repeats, "
                         "or run the layouts without --layers/--tp (or the recipe's grid.layers/grid.tp)"),
    "sweep-layers-repeats": (["sweep", *TINY, "--layers", "2", "--repeats", "2"],
                             DEPTH.repeats_refusal(without=REPEATS_FIX_SWEEP),
                             "--repeats applies to single calls (the layouts); depth stacks (--layers) run once: drop "
                             "--repeats, or run the layouts without --layers/--tp (or the recipe's "
                             "grid.layers/grid.tp)"),
    "run-tp-layout": (["run", *TINY, "--tp", "2", "--layout", "head_slice"], TP.layout_refusal(explained=True),
                      TP_LAYOUT),
    "run-nproc-layout": (["run", *TINY, "--nproc", "1", "--layout", "transposed"],
                         DISTRIBUTED.layout_refusal(explained=True),
                         "--layout does not apply to --nproc runs (every rank gets its shard as a contiguous copy); "
                         "drop --layout or --nproc"),
    # ranks holding TP shards: refused in the shards' words
    "run-nproc-tp-layout": (["run", *TINY, "--nproc", "2", "--tp", "2", "--layout", "transposed"],
                            TP.layout_refusal(explained=True), TP_LAYOUT),
    "sweep-tp-layout": (["sweep", *TINY, "--tp", "2", "--layout", "head_slice"], TP.layout_refusal(explained=False),
                        "--layout does not apply to TP shards (--tp); drop --layout, or sweep the layouts without "
                        "--layers/--tp"),
    "sweep-layers-layout": (["sweep", *TINY, "--layers", "2", "--layout", "transposed"],
                            DEPTH.layout_refusal(explained=False),
                            "--layout does not apply to depth stacks (--layers); drop --layout, or sweep the layouts "
                            "without --layers/--tp"),
    "sweep-layers-inputs": (["sweep", *TINY, "--layers", "2", "--inputs", "normal,outliers"], DEPTH.inputs_refusal(),
                            "--inputs does not apply to depth stacks (--layers): each layer's q, k, v come from the "
                            "stack's seeded weights; drop --inputs, or sweep the input distributions without --layers"),
    "bisect-layers-inputs": (["bisect", *TINY, "--layers", "2", "--inputs", "outliers"], DEPTH.inputs_refusal(),
                             "--inputs does not apply to depth stacks (--layers): each layer's q, k, v come from the "
                             "stack's seeded weights; drop --inputs or --layers"),
    "run-tp-thd": (["run", *TINY, "--tp", "2", *THD], dense_api_refusal("--tp and --nproc", THD_CASE),
                   DENSE_THD_RUN),
    "run-nproc-thd": (["run", *TINY, "--nproc", "1", *THD], dense_api_refusal("--tp and --nproc", THD_CASE),
                      DENSE_THD_RUN),
    # SKIP rows: every requested path skipped, with the entry's reason
    "sweep-tp-thd": (["sweep", *TINY, "--tp", "2", *THD], dense_api_skip(THD_CASE),
                     NOTHING_TESTED + DENSE_THD_SKIP),
    "sweep-layers-thd": (["sweep", *TINY, "--layers", "2", *THD], dense_api_skip(THD_CASE),
                         NOTHING_TESTED + DENSE_THD_SKIP),
    "sweep-layers-cross": (["sweep", *TINY, "--layers", "2", "--seq-kv", "24"], DEPTH.self_attention,
                           NOTHING_TESTED + "the depth stack is self-attention: it needs seq_kv == seq"),
    "run-cp-cross": (["run", *TINY, "--nproc", "2", "--cp", "2", "--seq-kv", "24"],
                     context_parallel_unsupported(case(seq_kv=24), 1, 2, "p2p"),
                     NOTHING_TESTED + "CP=2 splits one sequence for q, k and v: it needs self-attention (seq_kv == "
                     "seq)"),
    "bisect-tp-layout": (["bisect", *TINY, "--tp", "2", "--layout", "transposed"], TP.off_layout,
                         "the starting point is impossible: b2 s16 h4 d8 bf16 causal layout=transposed tp=2 (TP "
                         "shards are head-sliced views (layout head_slice) or contiguous copies (contiguous)); check "
                         "--layout, --tp and the heads"),
    "bisect-tp-thd": (["bisect", *TINY, "--tp", "2", *THD], dense_api_skip(THD_CASE),
                      "the starting point is impossible: b2 s16 h4 d8 bf16 padding thd lens 8,4 layout=contiguous tp=2 "
                      f"({DENSE_THD_SKIP}); check --layout, --tp and the heads"),
    "bisect-layers-cross": (["bisect", *TINY, "--layers", "2", "--seq-kv", "24"], DEPTH.self_attention,
                            "the starting point is impossible: b2 s16 skv24 h4 d8 bf16 causal layout=sbh3d_packed "
                            "layers=2 (the depth stack is self-attention: it needs seq_kv == seq); check --layout, "
                            "--tp and the heads"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_every_refusal_of_a_kind_is_the_tables_words(name, run_cli, checked_only, tmp_path):
    args, words, line = REFUSED[name]
    out = ["--out", tmp_path / "out"] if args[0] in ("sweep", "bisect") else []
    assert one_line_error(run_cli([*args, *out])) == f"attn-doctor: error: {line}"
    assert words in line


def test_a_replayed_case_is_refused_as_tp_shards_in_the_tables_words(run_cli, checked_only, captured):
    from attn_doctor.tracing.replay_case import case_of_reference

    _, reference = captured
    replayed = case_of_reference(reference)
    assert "replay" in replayed.api_features()
    line = one_line_error(run_cli(["run", "--replay", reference, "--tp", "2", "--device", "cpu"]))
    assert line == f"attn-doctor: error: {dense_api_refusal('--tp and --nproc', replayed)}{DENSE_FIX_RUN}"


ACCEPTED = {
    "run-call-repeats-layout": ["run", *TINY, "--repeats", "2", "--layout", "transposed"],
    "run-call-inputs-thd": ["run", *TINY, "--inputs", "outliers", *THD],
    "run-tp-inputs": ["run", *TINY, "--tp", "2", "--inputs", "outliers"],
    "run-nproc-inputs": ["run", *TINY, "--nproc", "2", "--tp", "2", "--inputs", "outliers"],
    "sweep-call-repeats-layout-inputs": ["sweep", *TINY, "--repeats", "2", "--layout", "transposed", "--inputs",
                                         "normal,outliers"],
    "sweep-call-thd": ["sweep", *TINY, *THD],
    "sweep-tp-inputs": ["sweep", *TINY, "--tp", "2", "--inputs", "normal,outliers"],
    "sweep-layers-tp": ["sweep", *TINY, "--layers", "2", "--tp", "2"],
    "bisect-call-layout-inputs-thd": ["bisect", *TINY, "--layout", "kv_2hd", "--inputs", "outliers", *THD],
    "bisect-tp-inputs-views": ["bisect", *TINY, "--tp", "2", "--layout", "head_slice", "--inputs", "outliers"],
    # bisect's own --repeats (any failing run counts) re-probes every kind
    "bisect-layers-repeats": ["bisect", *TINY, "--layers", "2", "--repeats", "2"],
}


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_what_each_kind_accepts_passes_every_check(name, run_cli, checked_only, tmp_path):
    args = ACCEPTED[name]
    with pytest.raises(PassedTheChecks):
        run_cli([*args, *(["--out", tmp_path / "out"] if args[0] in ("sweep", "bisect") else [])])


@pytest.mark.parametrize("command", ["run", "replay"])
def test_a_replayed_call_takes_repeats_and_its_own_layout(command, run_cli, checked_only, captured, tmp_path):
    root, reference = captured
    args = (["run", "--replay", reference] if command == "run" else ["replay", root, "--out", tmp_path / "out"])
    with pytest.raises(PassedTheChecks):
        run_cli([*args, "--repeats", "2", "--layout", CAPTURED, "--backend", "sdpa.math", "--device", "cpu"])
