"""`attn-doctor bisect`: the pure engine with fake predicates, the CLI on kernels with known trigger
conditions (tests/kernels/conditional.py), the standalone repro in a fresh interpreter, and bad input.

The engine tests need no kernel and take milliseconds. The CLI tests run real worker processes in a
temporary working directory; each conditional kernel is bisected once per module and the tests read
that bisect's --json document, its stdout and its repro script.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attn_doctor.backends.kernel import parse_kernel_spec
from attn_doctor.bisect.engine import Bisector, NothingToBisect, Outcome, TensorFailure, valid_config
from attn_doctor.bisect.knobs import coords_at
from attn_doctor.core.coords import Coords
from attn_doctor.core.case import Case, make_case
from attn_doctor.results.bisect_record import Condition
from cli_checks import one_line_error

COND = Path(__file__).resolve().parent / "kernels" / "conditional.py"
DOC_KEYS = {"start_case", "minimal_case", "necessary", "probes", "repro"}
TE_FACT_KEYS = {"knob", "tried", "config", "verdict", "fails"}


# --- the engine, with fake predicates ----------------------------------------------------------------

def _recording(predicate, calls=None):
    """probe(config) -> FAIL when predicate(config) else PASS; every call appended to `calls`."""
    calls = [] if calls is None else calls

    def probe(config: Coords) -> Outcome:
        calls.append(config)
        return Outcome("FAIL", "dq: error 0.05 > 3 x baseline 0.004", ("dq",)) if predicate(config) else Outcome("PASS")

    return probe, calls


def _necessary(result) -> dict[str, tuple]:
    knobs = [c.knob for c in result.necessary]
    assert len(knobs) == len(set(knobs)), f"a knob listed twice: {result.necessary}"
    return {c.knob: (c.failing_value, c.passing_value) for c in result.necessary}


def _gqa(config: Coords) -> bool:
    return config.case.kv_heads < config.case.heads


def four_conditions(config: Coords) -> bool:
    """seq >= 513, batch >= 3, a non-contiguous layout and GQA, all four needed."""
    case = config.case
    return case.seq >= 513 and case.batch >= 3 and config.layout != "contiguous" and _gqa(config)


BIG_START = coords_at(make_case(batch=4, seq=1024, heads=8, kv_heads=2, head_dim=64, dtype="bf16", mask="causal"),
                   "head_slice")


def _failing(tensors: dict[str, tuple[str, float]]) -> Outcome:
    """A FAIL whose tensors fail as given: name -> (kind, error)."""
    return Outcome("FAIL", "", tuple(tensors), failures={
        name: TensorFailure(kind, 10.0, error) for name, (kind, error) in tensors.items()})


def _changes(result) -> dict[str, str]:
    return {c.knob: c.what for c in result.changes}


def test_a_step_that_fails_differently_is_a_change_never_a_boundary():
    """The start fails on dq by 5%; below seq 64 a different failure (dq's rows far less wrong) shows up. The
    bisect keeps seq 64 as the smallest case that fails the start's way, and reports that seq 63 changes the
    failure: not that seq is necessary, since the case never passed."""
    def probe(config: Coords) -> Outcome:
        seq = config.case.seq
        if seq >= 64:
            return _failing({"dq": ("error", 0.05)})
        if seq >= 16:
            return _failing({"dq": ("error", 0.0004)})  # two orders of magnitude smaller: not the same fault
        if seq >= 4:
            return _failing({"out": ("error", 0.05), "dq": ("error", 0.05)})  # now the forward fails too
        return _failing({"dq": ("bias", 0.05)})

    start = coords_at(make_case(batch=1, seq=256, heads=1, head_dim=8, dtype="fp32", mask="none"), "contiguous")
    result = Bisector(probe, valid=valid_config).run(start)
    assert result.minimal.case.seq == 64
    assert "seq" not in _necessary(result)
    assert _changes(result)["seq"].startswith("fails differently: dq's error is 0.0004, the start's 0.05")
    different = [step for step in result.steps if step.verdict == "FAIL" and not step.fails]
    assert different and all("not the start's failure" in step.note for step in different)


def test_a_crash_or_a_skip_is_a_change_never_a_condition():
    """Simplifying the layout crashes, and the plainer mask cannot run: neither is the failure going away."""
    def probe(config: Coords) -> Outcome:
        if config.layout == "contiguous":
            return Outcome("ERROR", "RuntimeError: misaligned address")
        if config.case.mask == "no_mask":
            return Outcome("SKIP", "the kernel does not take this mask")
        return _failing({"dq": ("error", 0.05)})

    start = coords_at(make_case(batch=1, seq=8, heads=1, head_dim=8, dtype="fp32", mask="causal"), "transposed")
    result = Bisector(probe, valid=valid_config).run(start)
    assert _necessary(result) == {}
    changes = _changes(result)
    assert changes["layout"] == "crashes instead (RuntimeError)"
    assert changes["mask"].startswith("cannot run there (the kernel does not take this mask")
    assert (result.minimal.layout, result.minimal.case.mask) == ("transposed", "causal")


def _rows_wrong(config: Coords, wrong: int) -> Outcome:
    """dq's rows wrong from position `wrong` on, each row 50% off: the whole-tensor error shrinks with the share
    of wrong rows, the worst row's does not."""
    seq = config.case.seq
    if seq <= wrong:
        return Outcome("PASS")
    share = (seq - wrong) / seq
    return Outcome("FAIL", "", ("dq",), failures={"dq": TensorFailure("error", 100 * share, 0.5 * share ** 0.5,
                                                                       row_error=0.5)})


def test_a_fault_on_fewer_rows_is_the_same_failure():
    """The issue's late-token fault: at seq 513 one row in 513 is wrong (whole-tensor error 0.022, 23x below the
    start's 0.5), and it is still the start's failure: the boundary is exactly 512/513, and nothing else is
    necessary."""
    start = coords_at(make_case(batch=2, seq=1024, heads=4, head_dim=16, dtype="bf16", mask="none"), "transposed")
    result = Bisector(lambda c: _rows_wrong(c, 512), valid=valid_config).run(start)
    assert _necessary(result) == {"seq": (513, "512")}
    assert result.changes == []
    minimal = result.minimal
    assert (minimal.case.seq, minimal.case.heads, minimal.case.batch, minimal.case.head_dim) == (513, 1, 1, 8)


def test_same_failure_is_what_the_fault_does_to_a_row():
    start = _failing({"dq": ("error", 0.05)})
    assert _failing({"dq": ("error", 0.02), "dk": ("error", 0.3)}).differs_from(start) is None
    assert "error" in _failing({"dq": ("error", 0.004)}).differs_from(start)
    assert "forward" in _failing({"out": ("error", 0.05), "dq": ("error", 0.05)}).differs_from(start)
    assert "passes" in _failing({"dk": ("error", 0.05)}).differs_from(start)
    assert "bias" in _failing({"dq": ("bias", 0.05)}).differs_from(start)
    cancelled = Outcome("FAIL", "", ("dq",), failures={"dq": TensorFailure("error", 10.0, 0.05, cancelled=True)})
    assert "degenerate" in cancelled.differs_from(start)
    # where the worst rows are known, they decide: 30x less error over the tensor, each wrong row as wrong
    by_rows = Outcome("FAIL", "", ("dq",), failures={"dq": TensorFailure("error", 10.0, 0.5, row_error=0.5)})
    fewer_rows = Outcome("FAIL", "", ("dq",), failures={"dq": TensorFailure("error", 4.0, 0.016, row_error=0.4)})
    assert fewer_rows.differs_from(by_rows) is None
    weaker = Outcome("FAIL", "", ("dq",), failures={"dq": TensorFailure("error", 4.0, 0.5, row_error=0.01)})
    assert "worst row is off by 0.01, the start's 0.5" in weaker.differs_from(by_rows)


def test_a_relation_between_lengths_is_reported_as_the_relation():
    """A kernel wrong whenever seq_kv < seq: the seq boundary sits at seq_kv + 1 wherever seq_kv is, so the
    condition is the relation, and both lengths shrink together."""
    start = coords_at(make_case(batch=2, seq=320, seq_kv=192, heads=4, head_dim=16, dtype="bf16", mask="none"))
    result = Bisector(_recording(lambda c: c.case.seq_kv < c.case.seq)[0], valid=valid_config).run(start)
    assert [(c.knob, c.relation, c.failing_value, c.passing_value) for c in result.necessary] == [
        ("seq", "seq > seq_kv", "seq 2, seq_kv 1", "seq 1, seq_kv 1")]
    assert (result.minimal.case.seq, result.minimal.case.seq_kv) == (2, 1)
    assert result.necessary[0].sentence() == "fails when seq > seq_kv (seq 2, seq_kv 1), passes at seq 1, seq_kv 1"


def test_a_threshold_on_one_length_is_not_a_relation():
    """Wrong in cross-attention from seq 193 on, whatever seq_kv: the boundary happens to sit at seq_kv + 1 at the
    start, and the shifted try shows it does not move with seq_kv. Both conditions carry the minimal case's
    values, not those of the moment they were found (seq_kv was 192 then, 1 now)."""
    start = coords_at(make_case(batch=1, seq=320, seq_kv=192, heads=1, head_dim=8, dtype="fp32", mask="none"))
    cross = lambda c: c.case.seq >= 193 and c.case.seq_kv != c.case.seq  # noqa: E731
    result = Bisector(_recording(cross)[0], valid=valid_config).run(start)
    assert _necessary(result) == {"seq": (193, "192"), "seq_kv": (1, "193")}
    assert all(not c.relation for c in result.necessary)
    assert (result.minimal.case.seq, result.minimal.case.seq_kv) == (193, 1)


def test_the_other_relation_more_keys_than_queries():
    start = coords_at(make_case(batch=1, seq=100, seq_kv=300, heads=1, head_dim=8, dtype="fp32", mask="none"))
    result = Bisector(_recording(lambda c: c.case.seq_kv > c.case.seq)[0], valid=valid_config).run(start)
    assert [(c.knob, c.relation) for c in result.necessary] == [("seq_kv", "seq_kv > seq")]
    assert (result.minimal.case.seq, result.minimal.case.seq_kv) == (1, 2)


def test_conditions_are_confirmed_by_rerunning_both_sides():
    """Every condition is rerun on the minimal case: kept it fails, simplified it passes. A kernel that fails
    at seq 300 only on its first run there cannot be confirmed, and seq is not printed as necessary."""
    seen: dict[int, int] = {}

    def probe(config: Coords) -> Outcome:
        seq = config.case.seq
        seen[seq] = seen.get(seq, 0) + 1
        fails = config.layout != "contiguous" and (seq >= 301 or (seq == 300 and seen[seq] == 1))
        return Outcome("FAIL", "dq: error 0.05", ("dq",)) if fails else Outcome("PASS")

    start = coords_at(make_case(batch=1, seq=320, heads=1, head_dim=8, dtype="fp32", mask="none"), "transposed")
    result = Bisector(probe, valid=valid_config).run(start)
    confirming = [step for step in result.steps if step.knob == "confirm"]
    assert [step.tried for step in confirming][:1] == ["the minimal case again"]
    assert "not confirmed" in _changes(result).get("layout", "") + _changes(result).get("seq", "")
    assert result.necessary == [] or all(c.knob != "seq" or c.failing_value != 300 for c in result.necessary)

    # a deterministic kernel: each condition is confirmed by two fresh probes (kept, simplified)
    result = Bisector(_recording(_seq_and_layout)[0], valid=valid_config).run(SEQ_START)
    confirming = [step for step in result.steps if step.knob == "confirm"]
    assert [(s.tried, s.fails) for s in confirming] == [
        ("the minimal case again", True), ("layout contiguous", False), ("seq 299", False)]


def test_engine_finds_exactly_the_conditions_with_exact_integer_boundaries():
    probe, calls = _recording(four_conditions)
    result = Bisector(probe, valid=valid_config).run(BIG_START)
    necessary = _necessary(result)
    assert set(necessary) == {"layout", "kv_heads", "batch", "seq"}
    assert necessary["layout"] == ("head_slice", "contiguous")
    assert necessary["batch"] == (3, "2")
    assert necessary["seq"] == (513, "512")
    failing_kv, passing_kv = necessary["kv_heads"]
    assert failing_kv < int(passing_kv) and int(passing_kv) % failing_kv == 0  # GQA fails, kv_heads == heads passes
    minimal = result.minimal
    # Everything that is not a condition went to its plainest / smallest value; the conditions sit on their boundary.
    assert (minimal.layout, minimal.tp, minimal.layers) == ("head_slice", 1, 0)
    assert minimal.case == make_case(batch=3, seq=513, heads=4, kv_heads=1, head_dim=8, dtype="fp32", mask="none",
                                     seed=BIG_START.case.seed)
    assert four_conditions(minimal) and result.minimal_outcome.verdict == "FAIL"
    # the boundary claims are backed by probes: the passing side was probed and passed
    assert any(s.knob == "seq" and s.tried == "512" and not s.fails for s in result.steps)
    assert any(s.knob == "batch" and s.tried == "2" and not s.fails for s in result.steps)
    # the start is probed first, no configuration is probed twice, and every probe was a valid configuration
    assert calls[0] == BIG_START and result.steps[0].knob == "start" and result.steps[0].fails
    # the confirmation reruns the minimal case and one simplification per condition; nothing else is probed twice
    reruns = [s for s in result.steps if s.knob == "confirm"]
    assert len(reruns) == 1 + len(result.necessary) and all(s.fails == (i == 0) for i, s in enumerate(reruns))
    searched = calls[:len(calls) - len(reruns)]
    assert len(searched) == len(set(searched))
    assert all(valid_config(c) for c in calls)


def test_engine_to_dict_has_the_json_shape():
    probe, _ = _recording(four_conditions)
    document = Bisector(probe, valid=valid_config).run(BIG_START).to_dict()
    assert {"start_case", "minimal_case", "necessary", "probes"} <= set(document)
    assert document["start_case"]["case"]["seq"] == 1024 and document["minimal_case"]["case"]["seq"] == 513
    assert {"knob": "seq", "failing_value": 513, "passing_value": "512"} in document["necessary"]
    assert all(TE_FACT_KEYS <= set(p) for p in document["probes"])
    json.dumps(document)  # serialisable as it is


@pytest.mark.parametrize("start_dim, threshold, failing, passing", [
    (64, 40, 48, "40"),  # multiples of 8: the boundary between two steps
    (64, 8, 16, "8"),
    (20, 13, 14, "13"),  # not a multiple of 8: steps of 1, exact value
])
def test_engine_head_dim_boundary(start_dim, threshold, failing, passing):
    start = coords_at(make_case(batch=2, seq=64, heads=4, head_dim=start_dim, dtype="fp32", mask="none"))
    probe, calls = _recording(lambda c: c.case.head_dim > threshold)
    result = Bisector(probe, valid=valid_config).run(start)
    assert _necessary(result) == {"head_dim": (failing, passing)}
    assert result.minimal.case.head_dim == failing
    assert (result.minimal.case.batch, result.minimal.case.seq, result.minimal.case.heads) == (1, 1, 1)


def test_engine_respects_what_the_backend_accepts():
    """A kernel taking head dims in multiples of 16 only: the search never probes 8, 24, 40, 56."""
    start = coords_at(make_case(batch=1, seq=8, heads=2, head_dim=64, dtype="fp32", mask="none"))
    accepts = lambda c: c.case.head_dim % 16 == 0  # noqa: E731
    probe, calls = _recording(lambda c: c.case.head_dim > 20)
    result = Bisector(probe, valid=accepts).run(start)
    assert all(accepts(c) for c in calls), sorted({c.case.head_dim for c in calls})
    assert _necessary(result) == {"head_dim": (32, "16")}


def test_engine_tp_condition_keeps_heads_divisible():
    start = coords_at(make_case(batch=2, seq=32, heads=8, kv_heads=4, head_dim=16, dtype="bf16"), "head_slice", tp=2)
    probe, calls = _recording(lambda c: c.tp >= 2)
    result = Bisector(probe, valid=valid_config).run(start)
    assert _necessary(result) == {"tp": (2, "1")}
    assert result.minimal.tp == 2 and result.minimal.layout == "contiguous"
    assert all(valid_config(c) for c in calls)
    assert all(c.case.heads % c.tp == 0 and c.case.kv_heads % c.tp == 0 for c in calls)


def test_engine_categorical_values_toward_the_plainest_dtype():
    """Every dtype fails: the plainest (fp32) is adopted; only fp16 fails: dtype is necessary, both others pass."""
    start = coords_at(make_case(batch=1, seq=4, heads=1, head_dim=8, dtype="fp16", mask="none"))
    probe, _ = _recording(lambda c: True)
    assert Bisector(probe).run(start).minimal.case.dtype == "fp32"
    probe, _ = _recording(lambda c: c.case.dtype == "fp16")
    result = Bisector(probe).run(start)
    failing, passing = _necessary(result)["dtype"]
    assert failing == "fp16" and set(passing.split(", ")) == {"fp32", "bf16"}
    assert result.minimal.case.dtype == "fp16"


class _EveryOtherCall:
    """FAIL only on the odd-numbered (or even-numbered) calls, and only where `condition` holds."""

    def __init__(self, condition, odd: bool = True):
        self.condition, self.odd, self.count = condition, odd, 0

    def __call__(self, config: Coords) -> Outcome:
        self.count += 1
        if self.condition(config) and (self.count % 2 == 1) == self.odd:
            return Outcome("FAIL", "dq: error 0.05 > 3 x baseline 0.004")
        return Outcome("PASS")


def _seq_and_layout(config: Coords) -> bool:
    return config.case.seq >= 300 and config.layout != "contiguous"


SEQ_START = coords_at(make_case(batch=2, seq=320, heads=4, kv_heads=2, head_dim=16, dtype="fp16"), "head_slice")


def test_engine_repeats_guards_against_a_nondeterministic_kernel():
    deterministic = Bisector(_recording(_seq_and_layout)[0]).run(SEQ_START)
    assert _necessary(deterministic) == {"layout": ("head_slice", "contiguous"), "seq": (300, "299")}
    flaky = Bisector(_EveryOtherCall(_seq_and_layout), repeats=2).run(SEQ_START)
    assert flaky.minimal == deterministic.minimal
    assert _necessary(flaky) == _necessary(deterministic)
    # without repeats the same kernel looks fixed by luck on some probes, so the answer is wrong: the
    # guard above is what makes it right
    lucky = Bisector(_EveryOtherCall(_seq_and_layout), repeats=1).run(SEQ_START)
    assert (lucky.minimal, _necessary(lucky)) != (deterministic.minimal, _necessary(deterministic))


def test_engine_repeats_apply_to_the_start_too():
    """A flaky kernel that passes on the first run of the start and fails on the second: --repeats 2 must
    see the failure ('any failing run counts'), not report nothing to bisect."""
    result = Bisector(_EveryOtherCall(_seq_and_layout, odd=False), repeats=2).run(SEQ_START)
    assert _necessary(result)["seq"] == (300, "299")


@pytest.mark.parametrize("same_a, same_b, other", [
    ("RuntimeError: CUDA error: an illegal memory access at 0x7f00", "RuntimeError: misaligned address at 0x10",
     "TypeError: unsupported strides"),
    ("worker kernel died while running it (signal SIGSEGV): Fatal Python error: Segmentation fault",
     "worker kernel died while running it (signal SIGSEGV): free(): invalid pointer",
     "worker kernel died while running it (signal SIGABRT): Aborted"),
    ("hung: no answer within --timeout 5 s; worker killed", "hung: no answer within --timeout 300 s; worker killed",
     "RuntimeError: hung kernel detected"),
], ids=["exception", "died", "hung"])
def test_engine_error_start_counts_only_the_same_error_class(same_a, same_b, other):
    """From a crashing start: a probe that crashes the same way (same class, other details) still fails; one
    that crashes differently (layout contiguous here) is a change, not a condition: the crash did not go away."""

    def probe(config: Coords) -> Outcome:
        case = config.case
        if config.layout == "contiguous":
            return Outcome("ERROR", other)
        if case.batch >= 3:
            return Outcome("ERROR", same_a)
        if case.batch == 2:  # the boundary is found only if this other wording of the same crash counts
            return Outcome("ERROR", same_b)
        return Outcome("PASS")

    start = coords_at(make_case(batch=4, seq=129, heads=2, head_dim=16, dtype="bf16"), "head_slice")
    result = Bisector(probe, valid=valid_config).run(start)
    necessary = _necessary(result)
    assert necessary == {"batch": (2, "1")}
    assert _changes(result)["layout"].startswith("crashes differently (")
    assert result.minimal.layout == "head_slice" and result.minimal.case.seq == 1  # seq 1 crashes the same way
    assert result.minimal_outcome == Outcome("ERROR", same_b)


@pytest.mark.parametrize("verdict", ["PASS", "SKIP"])
def test_engine_start_that_does_not_fail_raises_nothing_to_bisect(verdict):
    calls = []

    def probe(config: Coords) -> Outcome:
        calls.append(config)
        return Outcome(verdict, "not on this device" if verdict == "SKIP" else "")

    with pytest.raises(NothingToBisect, match=verdict):
        Bisector(probe, repeats=3).run(SEQ_START)
    assert calls and set(calls) == {SEQ_START}  # nothing but the start was probed


def test_engine_every_categorical_knob_left_unsimplified_is_named():
    """An either-or fault (causal mask OR bf16): the minimizer keeps one of the two, and simplifying that one
    from the minimal case makes the failure disappear, so it must be a necessary condition."""
    start = coords_at(make_case(batch=1, seq=8, heads=1, head_dim=8, dtype="bf16", mask="causal"))
    probe, _ = _recording(lambda c: c.case.mask == "causal" or c.case.dtype == "bf16")
    result = Bisector(probe).run(start)
    minimal = result.minimal.case
    assert (minimal.mask, minimal.dtype) in (("no_mask", "bf16"), ("causal", "fp32"))
    kept = "dtype" if minimal.dtype == "bf16" else "mask"
    assert kept in _necessary(result)


def test_engine_names_each_knob_once():
    start = coords_at(make_case(batch=1, seq=8, heads=1, head_dim=8, dtype="fp32", mask="none"), "contiguous", layers=12)
    probe, _ = _recording(lambda c: c.layers >= 5)
    result = Bisector(probe).run(start)
    assert result.minimal.layers == 5
    assert _necessary(result) == {"layers": (5, "4")}


# --- the CLI on kernels with known trigger conditions -------------------------------------------------

# The start of each kernel's bisect: a case where it fails, with knobs to simplify that do not matter.
STARTS = {
    "seq_ge_300_noncontig": ["--batch", 2, "--seq", 320, "--heads", 4, "--kv-heads", 2, "--head-dim", 16,
                             "--dtype", "fp16", "--layout", "head_slice"],
    "gqa_only": ["--batch", 2, "--seq", 48, "--heads", 4, "--kv-heads", 2, "--head-dim", 16, "--dtype", "bf16",
                 "--layout", "transposed"],
    "fp16_only": ["--batch", 2, "--seq", 48, "--heads", 4, "--head-dim", 16, "--dtype", "fp16",
                  "--layout", "head_slice"],
    "head_dim_gt_40": ["--batch", 1, "--seq", 32, "--heads", 2, "--kv-heads", 1, "--head-dim", 64, "--dtype", "bf16",
                       "--layout", "sbh3d_packed"],
    # Correct with a flash kernel's rounding noise where dq cancels (seq 1, window 0,0), wrong past seq 256:
    # the bisect must find 256, not a degenerate case where every kernel is noisy (issue 15).
    "flash_dq_seq_ge_256": ["--batch", 2, "--seq", 320, "--heads", 4, "--head-dim", 16, "--dtype", "bf16",
                            "--mask", "causal", "--layout", "transposed"],
    # Faults on some tokens or heads only (issue 33): fewer rows touched is the same failure, so the conditions
    # are exactly the token and head boundaries, nothing that merely shrinks the error.
    "late_tokens_dq_zero": ["--batch", 2, "--seq", 1024, "--heads", 4, "--head-dim", 16, "--dtype", "bf16",
                            "--layout", "transposed"],
    "late_heads_out_zero": ["--batch", 2, "--seq", 64, "--heads", 6, "--head-dim", 16, "--dtype", "bf16",
                            "--layout", "transposed"],
    "late_tokens_and_heads_out_zero": ["--batch", 2, "--seq", 1024, "--heads", 4, "--head-dim", 16,
                                       "--dtype", "bf16", "--layout", "transposed"],
    # Wrong whenever seq_kv < seq (TE's unfused path's fault of issue 16): the relation, not a threshold.
    "fewer_keys_than_queries": ["--batch", 2, "--seq", 320, "--seq-kv", 192, "--heads", 4, "--head-dim", 16,
                                "--dtype", "bf16", "--layout", "transposed"],
}

# What each bisect must reach: the necessary conditions (knob -> failing, passing, with the minimal case's
# values) and the minimal case.
PLAIN = dict(batch=1, seq=1, heads=1, kv_heads=1, seq_kv=1, head_dim=8, dtype="fp32", mask="no_mask", window=None,
             seed=1234)
EXPECTED = {
    "seq_ge_300_noncontig": ({"layout": ("head_slice", "contiguous"), "seq": (300, "299")},
                             {**PLAIN, "seq": 300, "seq_kv": 300}, "head_slice"),
    "gqa_only": ({"kv_heads": (1, "2")}, {**PLAIN, "heads": 2, "kv_heads": 1}, "contiguous"),
    "fp16_only": ({"dtype": ("fp16", "fp32, bf16")}, {**PLAIN, "dtype": "fp16"}, "contiguous"),
    "head_dim_gt_40": ({"head_dim": (48, "40")}, {**PLAIN, "head_dim": 48}, "contiguous"),
    "flash_dq_seq_ge_256": ({"seq": (256, "255")}, {**PLAIN, "seq": 256, "seq_kv": 256}, "contiguous"),
    "late_tokens_dq_zero": ({"seq": (513, "512")}, {**PLAIN, "seq": 513, "seq_kv": 513}, "contiguous"),
    "late_heads_out_zero": ({"heads": (3, "2")}, {**PLAIN, "heads": 3, "kv_heads": 3}, "contiguous"),
    "late_tokens_and_heads_out_zero": ({"seq": (513, "512"), "heads": (3, "2")},
                                       {**PLAIN, "seq": 513, "seq_kv": 513, "heads": 3, "kv_heads": 3}, "contiguous"),
    "fewer_keys_than_queries": ({"seq": ("seq 2, seq_kv 1", "seq 1, seq_kv 1")}, {**PLAIN, "seq": 2}, "contiguous"),
}
RELATIONS = {"fewer_keys_than_queries": "seq > seq_kv"}


def _kernel(func: str) -> str:
    return f"{COND}:{func}"


@pytest.fixture(scope="module")
def bisected(tmp_path_factory, run_cli):
    """bisected(func) -> (click result, --json document, out dir): each kernel bisected once per module."""
    done = {}

    def get(func: str):
        if func not in done:
            workdir = tmp_path_factory.mktemp(f"bisect-{func}")
            out, json_path = workdir / "out", workdir / "bisect.json"
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(workdir)
                result = run_cli(["bisect", "--kernel", _kernel(func), *STARTS[func], "--device", "cpu",
                                  "--out", out, "--json", json_path])
            assert result.exit_code == 0, result.output
            done[func] = (result, json.loads(json_path.read_text()), out)
        return done[func]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("func", list(EXPECTED))
def test_bisect_reaches_exactly_the_kernels_conditions(bisected, func):
    result, doc, out = bisected(func)
    conditions, minimal_case, minimal_layout = EXPECTED[func]
    assert DOC_KEYS <= set(doc)
    necessary = {n["knob"]: (n["failing_value"], n["passing_value"]) for n in doc["necessary"]}
    assert len(necessary) == len(doc["necessary"]), doc["necessary"]
    if func == "fp16_only":  # the order of the passing dtypes is not part of the claim
        failing, passing = necessary["dtype"]
        necessary["dtype"] = (failing, ", ".join(sorted(passing.split(", "), key=["fp32", "bf16"].index)))
    assert necessary == conditions
    assert [n.get("relation", "") for n in doc["necessary"]] == [RELATIONS.get(func, "")] * len(necessary)
    assert doc["changes"] == []  # every simplification either kept the failure or removed it
    assert doc["minimal_case"]["case"] == minimal_case
    assert (doc["minimal_case"]["layout"], doc["minimal_case"]["tp"], doc["minimal_case"]["layers"]) == (
        minimal_layout, 1, 0)
    assert doc["backend"] == func
    # the start is the case given on the command line, and it failed
    start = Case.from_dict(doc["start_case"]["case"])
    flags = dict(zip(STARTS[func][::2], STARTS[func][1::2]))
    assert (start.batch, start.seq, start.heads, start.head_dim, start.dtype) == (
        flags["--batch"], flags["--seq"], flags["--heads"], flags["--head-dim"], flags["--dtype"])
    assert doc["start_case"]["layout"] == flags["--layout"]
    first = doc["probes"][0]
    assert TE_FACT_KEYS <= set(first) and first["knob"] == "start" and first["verdict"] == "FAIL" and first["fails"]
    # the terminal says the same
    for condition in doc["necessary"]:
        if condition["knob"] != "dtype":
            assert Condition(**condition).sentence() in " ".join(result.output.split()), condition
    # each condition was confirmed by rerunning the minimal case kept (fails) and simplified (passes)
    reruns = [p for p in doc["probes"] if p["knob"] == "confirm"]
    assert [p["fails"] for p in reruns] == [True] + [False] * len(necessary)
    assert all(p["verdict"] == "PASS" for p in reruns[1:])
    assert "minimal failing case:" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("func, knob", [("seq_ge_300_noncontig", "seq"), ("head_dim_gt_40", "head_dim")])
def test_bisect_integer_boundary_is_backed_by_probes(bisected, func, knob):
    """Both sides of the reported boundary were probed with the kernel: the failing value FAILed, the one
    below it PASSed."""
    _, doc, _ = bisected(func)
    condition = next(n for n in doc["necessary"] if n["knob"] == knob)
    by_value = {p["tried"]: p for p in doc["probes"] if p["knob"] == knob}
    assert by_value[str(condition["failing_value"])]["verdict"] == "FAIL"
    assert by_value[condition["passing_value"]]["verdict"] == "PASS"
    assert not by_value[condition["passing_value"]]["fails"]


@pytest.mark.slow
@pytest.mark.parametrize("func, where", [("seq_ge_300_noncontig", "backward"), ("gqa_only", "forward")])
def test_bisect_says_whether_forward_or_backward_is_wrong(bisected, func, where):
    _, doc, _ = bisected(func)
    assert doc["diagnosis"]["first_wrong"].startswith(where), doc["diagnosis"]


def test_bisect_writes_the_repro_under_out(bisected):
    _, doc, out = bisected("seq_ge_300_noncontig")
    repro = Path(doc["repro"])
    assert repro.parent.resolve() == out.resolve()
    assert re.fullmatch(r"repro_seq_ge_300_noncontig_[0-9a-f]{8}\.py", repro.name), repro.name
    assert sorted(p.name for p in out.glob("repro_*.py")) == [repro.name]


# --- the repro, in a fresh interpreter without attn-doctor ------------------------------------------------

@pytest.fixture(scope="module")
def no_attn_doctor(tmp_path_factory) -> dict:
    """An environment where `import attn_doctor` fails loudly (a fake package first on PYTHONPATH)."""
    fake = tmp_path_factory.mktemp("fake-site")
    (fake / "attn_doctor").mkdir()
    (fake / "attn_doctor" / "__init__.py").write_text(
        'raise ImportError("the repro must not need attn_doctor")\n')
    env = {**os.environ, "PYTHONPATH": str(fake)}
    check = subprocess.run([sys.executable, "-c", "import attn_doctor"], cwd=fake, env=env, capture_output=True,
                           text=True)
    assert check.returncode != 0 and "must not need attn_doctor" in check.stderr  # the trap works
    return env


def _run_script(script: Path, cwd: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def _printed_rel_err(stdout: str, tensor: str) -> tuple[float, bool]:
    """The repro's printed relative error of `tensor`, and whether the line is marked WRONG."""
    for line in stdout.splitlines():
        words = line.split()
        if words and words[0] == tensor:
            return float(words[words.index("relative") + 1].rstrip(",")), "WRONG:" in words
    raise AssertionError(f"no {tensor} line in:\n{stdout}")


def test_repro_exits_1_for_the_faulty_kernel_without_attn_doctor(bisected, no_attn_doctor, tmp_path):
    _, doc, _ = bisected("seq_ge_300_noncontig")
    repro = Path(doc["repro"])
    text = repro.read_text()
    assert "attn_doctor" not in re.sub(r'""".*?"""', "", text, flags=re.S)  # no import outside the header
    assert f"TARGET, FUNC = {str(COND)!r}, 'seq_ge_300_noncontig'" in text  # the same file as the --kernel
    proc = _run_script(repro, tmp_path, no_attn_doctor)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "STILL WRONG: dq" in proc.stdout
    assert "Traceback" not in proc.stderr
    _, dq_wrong = _printed_rel_err(proc.stdout, "dq")
    assert dq_wrong
    assert not any(_printed_rel_err(proc.stdout, t)[1] for t in ("out", "dk", "dv"))


@pytest.mark.slow
def test_repro_of_the_long_sequence_fault_exits_1(bisected, no_attn_doctor, tmp_path):
    _, doc, _ = bisected("flash_dq_seq_ge_256")
    assert "sdpa.math passes" in doc["diagnosis"]["minimal_case_checked"]
    proc = _run_script(Path(doc["repro"]), tmp_path, no_attn_doctor)
    assert proc.returncode == 1 and "STILL WRONG: dq" in proc.stdout, proc.stdout + proc.stderr


def test_repro_of_a_cancelling_case_never_divides_by_zero(no_attn_doctor, tmp_path):
    """One query and one key: the exact dq and dk are 0. The repro judges them against their terms' scale,
    as the tool does, and a correct kernel exits 0."""
    from attn_doctor.bisect.repro import write_repro

    coords = coords_at(make_case(batch=1, seq=1, heads=1, head_dim=16, dtype="fp32", mask="none"),
                       backend=parse_kernel_spec(f"{COND}:flash_dq_seq_ge_256"))
    script = write_repro(tmp_path, coords, None, "test", "attn-doctor bisect")
    proc = _run_script(script, tmp_path, no_attn_doctor)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr and "FIXED" in proc.stdout


def test_repro_exits_0_once_the_kernel_is_fixed(bisected, no_attn_doctor, tmp_path):
    """The same script pointed at a fixed kernel (same function name, correct) says FIXED and exits 0."""
    _, doc, _ = bisected("seq_ge_300_noncontig")
    fixed = tmp_path / "fixed_kernel.py"
    fixed.write_text(
        "import importlib.util\n"
        f"_spec = importlib.util.spec_from_file_location('conditional_kernels', {str(COND)!r})\n"
        "_module = importlib.util.module_from_spec(_spec)\n"
        "_spec.loader.exec_module(_module)\n"
        "seq_ge_300_noncontig = _module.correct  # the fix\n")
    text = Path(doc["repro"]).read_text()
    patched, count = re.subn(r"^TARGET, FUNC = .*$", f"TARGET, FUNC = {str(fixed)!r}, 'seq_ge_300_noncontig'",
                             text, flags=re.M)
    assert count == 1
    script = tmp_path / "repro_fixed.py"
    script.write_text(patched)
    proc = _run_script(script, tmp_path, no_attn_doctor)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FIXED" in proc.stdout and "STILL WRONG" not in proc.stdout
    assert not any(_printed_rel_err(proc.stdout, t)[1] for t in ("out", "dq", "dk", "dv"))


DRIVER = r'''
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("repro", sys.argv[1])
repro = importlib.util.module_from_spec(spec)
spec.loader.exec_module(repro)  # defines everything; main() is behind __name__ == "__main__"
q, k, v, dout = repro.inputs()
ref = repro.reference(q, k, v, dout)
got = repro.attend(repro.kernel, repro.views(q, k, v), repro.to_fmt, repro.to_bshd, dout)
sbhd = lambda t, side: t.transpose(0, 1)
base = repro.attend(repro.local, [repro.leaf(sbhd(t, "q")) for t in (q, k, v)], sbhd, sbhd, dout)
measured = {name: (repro.figures(x, *ref[name]), repro.figures(b, *ref[name])) for name, x, b in zip(ref, got, base)}
print(json.dumps({name: {"rel": m["rel"], "ratio": repro.judge(m, b)[1]} for name, (m, b) in measured.items()}))
'''


@pytest.mark.slow
def test_repro_errors_match_the_tools_minimal_case(bisected, no_attn_doctor, run_cli, tmp_path, monkeypatch):
    """The repro's dq error is the one attn-doctor measures on the minimal case (`run --json` on it). On a CPU a
    kernel's rounding depends on how many threads it runs on (the tool's workers share the cores), so both run
    on one thread here, as a user comparing the two on a CPU would pin them."""
    _, doc, _ = bisected("seq_ge_300_noncontig")
    minimal = Case.from_dict(doc["minimal_case"]["case"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the workers keep a thread count the user set
    no_attn_doctor = {**no_attn_doctor, "OMP_NUM_THREADS": "1"}
    result = run_cli(["run", "--kernel", _kernel("seq_ge_300_noncontig"), *minimal.cli_flags().split(),
                      "--layout", doc["minimal_case"]["layout"], "--device", "cpu", "--json", "run.json"])
    assert result.exit_code == 1, result.output
    rows = json.loads((tmp_path / "run.json").read_text())["results"]
    row = next(r for r in rows if r["backend"] == "seq_ge_300_noncontig")
    assert row["verdict"] == "FAIL" and row["tensors"]["dq"]["verdict"] == "FAIL"
    tool_dq = row["tensors"]["dq"]["rel_err"]
    assert tool_dq == pytest.approx(0.05, rel=1e-3)  # the kernel's 5% fault, measured
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.run([sys.executable, str(driver), doc["repro"]], cwd=tmp_path, env=no_attn_doctor,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    script_errors = json.loads(proc.stdout.strip().splitlines()[-1])
    assert script_errors["dq"]["rel"] == pytest.approx(tool_dq, rel=1e-6)
    # out, dk and dv are right: their errors are fp32 rounding, which depends on every input value, so their
    # agreement shows the script rebuilt the same inputs (seed, views), not just the same 5% fault
    for name in ("out", "dk", "dv"):
        assert row["tensors"][name]["rel_err"] < 1e-5
        assert script_errors[name]["rel"] == pytest.approx(row["tensors"][name]["rel_err"], rel=1e-6), name
    for name in ("out", "dq", "dk", "dv"):  # and the ratio to the same yardstick
        assert script_errors[name]["ratio"] == pytest.approx(row["tensors"][name]["ratio"], rel=1e-6), name
    # and what the script prints (4 significant digits) is that number
    printed = _run_script(Path(doc["repro"]), tmp_path, no_attn_doctor)
    assert _printed_rel_err(printed.stdout, "dq")[0] == pytest.approx(tool_dq, rel=1e-3)


# --- nothing to bisect, and bad input ---------------------------------------------------------------------



def test_bisect_of_a_passing_case_exits_1_nothing_to_bisect(run_cli, tmp_path, monkeypatch, small_flags):
    monkeypatch.chdir(tmp_path)
    result = run_cli(["bisect", "--kernel", _kernel("correct"), *small_flags, "--layout", "head_slice",
                      "--out", "out", "--json", "bisect.json"])
    assert result.exit_code == 1, result.output
    assert "nothing to bisect" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "bisect.json").exists()
    assert not list(tmp_path.rglob("repro_*.py"))


@pytest.fixture(scope="module")
def results_files(tmp_path_factory, run_cli):
    """Two `run --json` results: fp16_only failing on two layouts, and the correct kernel passing."""
    workdir = tmp_path_factory.mktemp("from-results")
    flags = ["--batch", 1, "--seq", 16, "--heads", 2, "--head-dim", 16, "--dtype", "fp16", "--device", "cpu"]
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(workdir)
        failing = run_cli(["run", "--kernel", _kernel("fp16_only"), *flags, "--layout", "contiguous",
                           "--layout", "transposed", "--json", workdir / "faulty" / "results.json"])
        passing = run_cli(["run", "--kernel", _kernel("correct"), *flags, "--layout", "contiguous",
                           "--json", workdir / "passing" / "results.json"])
    assert failing.exit_code == 1, failing.output
    assert passing.exit_code == 0, passing.output
    return workdir / "faulty" / "results.json", workdir / "passing" / "results.json"


BAD_INPUTS = {
    "two backends": (["--backend", "local", "--backend", "sdpa.math"], "exactly one"),
    "backend and kernel": (["--backend", "local", "--kernel", _kernel("fp16_only")], "exactly one"),
    "unknown backend": (["--backend", "no-such-backend"], "unknown backend"),
    "repeats 0": (["--kernel", _kernel("fp16_only"), "--repeats", 0], "--repeats"),
    "two layouts": (["--kernel", _kernel("fp16_only"), "--layout", "contiguous", "--layout", "transposed"], "layout"),
    "missing --from": (["--from", "no-such-results.json"], "no-such-results.json"),
    "no failing row": (["--from", "{passing}"], "no failing row"),
    "row out of range": (["--from", "{faulty}", "--row", 2], "--row 2"),
    "negative row": (["--from", "{faulty}", "--row", -1], "--row -1"),
    "impossible start": (["--kernel", _kernel("fp16_only"), "--layout", "sb3hd_packed", "--heads", 4,
                          "--kv-heads", 2], "impossible"),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bisect_bad_input_exits_2_with_one_line(name, run_cli, results_files, tmp_path, monkeypatch):
    args, message = BAD_INPUTS[name]
    faulty, passing = results_files
    args = [str(a).format(faulty=faulty, passing=passing) for a in args]
    monkeypatch.chdir(tmp_path)
    result = run_cli(["bisect", *args, "--batch", 1, "--seq", 16, "--heads", 4, "--head-dim", 16, "--device", "cpu"]
                     if not any(a == "--from" for a in args) else ["bisect", *args, "--device", "cpu"])
    line = one_line_error(result)
    assert message in line, line
    assert not list(tmp_path.rglob("repro_*.py")) and not (tmp_path / "attn-doctor-results").exists()  # nothing was bisected


# --- --from RESULTS ---------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("row, layout", [(None, "contiguous"), (1, "transposed")])
def test_bisect_from_results_starts_at_the_failing_row(row, layout, run_cli, results_files, tmp_path, monkeypatch):
    faulty, _ = results_files
    rows = json.loads(faulty.read_text())["results"]
    failing_rows = [r for r in rows if r["verdict"] in ("FAIL", "ERROR")]
    assert [r["layout"] for r in failing_rows] == ["contiguous", "transposed"]
    monkeypatch.chdir(tmp_path)
    args = ["bisect", "--from", faulty, "--device", "cpu", "--json", tmp_path / "bisect.json"]
    if row is not None:
        args += ["--row", row]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    doc = json.loads((tmp_path / "bisect.json").read_text())
    chosen = failing_rows[row or 0]
    assert doc["backend"] == "fp16_only"
    assert doc["start_case"]["case"] == chosen["case"] and doc["start_case"]["layout"] == layout
    assert {n["knob"] for n in doc["necessary"]} == {"dtype"}
    assert doc["minimal_case"]["case"]["dtype"] == "fp16"
    repro = Path(doc["repro"])
    assert repro.is_file() and repro.resolve().parent == faulty.resolve().parent  # beside --from
    assert not (tmp_path / "attn-doctor-results").exists()


def test_a_minimal_case_a_correct_path_also_fails_is_set_aside(monkeypatch):
    """confirm_minimal walks back from the minimal case to the last simplification on which the correct
    path (sdpa.math) passes: that is the case reported."""
    from types import SimpleNamespace

    from attn_doctor.bisect import driver
    from attn_doctor.bisect.engine import BisectResult

    kernel = parse_kernel_spec(f"{COND}:correct")
    start, middle, smallest = (coords_at(make_case(batch=1, seq=seq, heads=2, head_dim=16), backend=kernel)
                               for seq in (64, 16, 1))
    outcomes = {c: Outcome("FAIL", f"seq {c.case.seq}", ("dq",)) for c in (start, middle, smallest)}
    result = BisectResult(start, outcomes[start], smallest, outcomes[smallest], [], [], [middle, smallest], outcomes)
    control_fails_at = {1}
    checked = []

    def probe_row(session, coords):
        checked.append((coords.backend.name, coords.case.seq))
        return SimpleNamespace(verdict="FAIL" if coords.case.seq in control_fails_at else "PASS")

    monkeypatch.setattr(driver, "probe_row", probe_row)
    note = driver.confirm_minimal(None, result)
    assert result.minimal == middle and result.minimal_outcome.reason == "seq 16"
    assert "set aside" in note and checked == [("sdpa.math", 1), ("sdpa.math", 16)]
    control_fails_at = {1, 16, 64}
    result = BisectResult(start, outcomes[start], smallest, outcomes[smallest], [], [], [middle, smallest], outcomes)
    assert "fails on every case tried" in driver.confirm_minimal(None, result)


def test_a_relation_the_start_contradicts_is_only_that_the_lengths_differ():
    """Wrong whenever seq_kv != seq, from a start with fewer keys than queries: the seq_kv search, run once seq is
    1, finds the boundary at seq_kv 2 / 1, which reads "seq_kv > seq"; the start (seq_kv 8 < seq 16) fails too,
    so the condition is only that the lengths differ."""
    start = coords_at(make_case(batch=1, seq=16, seq_kv=8, heads=1, head_dim=8, dtype="fp32", mask="none"))
    result = Bisector(_recording(lambda c: c.case.seq_kv != c.case.seq)[0], valid=valid_config).run(start)
    assert [(c.knob, c.relation, c.failing_value) for c in result.necessary] == [
        ("seq_kv", "seq_kv != seq", "seq_kv 2, seq 1")]
