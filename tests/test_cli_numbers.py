"""Every numeric option of every command is checked for range and finiteness when it is parsed: a bad value
(nan, inf, a negative or huge number, a word, past its documented bound) is exit 2 with one line on stderr that
names the option, never a traceback, and nothing runs. The options typed as numbers are found by looking at
the commands themselves (a new one is covered without editing this file); the options that take numbers as
text (comma lists, LEFT,RIGHT, random:P, sizes) are listed. Also: "nothing would be judged" is refused
(sweep --tp 3 with 2 heads), and what `sweep --out` does with an existing folder."""

from __future__ import annotations

import json
import math
import sys
import time

import click
import pytest

from attn_doctor.cli import cli
from attn_doctor.cli.options import MAX_REPEATS, MAX_SEED, MAX_TIMEOUT_S, Number
from cli_checks import one_line_error

TINY = ["--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu"]
HUGE = "9" * 30  # past every bound, and past what an int64 (or a float's exact range) holds

# Arguments each command needs besides the option under test ({tmp}: the test's folder). Nothing runs:
# a bad value is refused first.
BASE = {
    "run": [*TINY, "--backend", "sdpa.math", "--json", "{tmp}/r.json"],
    "sweep": [*TINY, "--backend", "sdpa.math", "--out", "{tmp}/sweep"],
    "bisect": [*TINY, "--backend", "sdpa.math", "--out", "{tmp}/bisect"],
    "replay": ["{tmp}/capture", "--device", "cpu", "--out", "{tmp}/replay"],
    "capture": ["--out", "{tmp}/capture", "--values"],
    "compare": ["{tmp}/a", "{tmp}/b"],
    "report": ["{tmp}/results.json"],
    "env": ["--no-te"],
}
TAIL = {"capture": ["--", sys.executable, "-c", "raise SystemExit(3)"]}  # were it run, the test would see 1


def _bad_values(number: Number) -> list[str]:
    """Values `number` must refuse: words, nan and the infinities, and the numbers just past its bounds."""
    values = ["x", "nan", "inf", "-inf", HUGE, f"-{HUGE}"]
    if number.low is not None:
        values.append(f"{number.low:g}" if number.low_open else f"{number.low - 1:g}")
    if number.high is not None:
        values.append(f"{number.high + 1}" if number.kind is int else f"{number.high * 2:g}")
    if number.kind is int:
        values.append("1.5")
    if number.kind is float and number.high is not None and number.high < 1e12:
        values.append("1e12")
    return list(dict.fromkeys(values))


def _typed_options() -> list[tuple[str, str, str]]:
    """(command, option, bad value) for every option of every command that click parses as a number."""
    cases = []
    for name, command in sorted(cli.commands.items()):
        for param in command.params:
            if isinstance(param, click.Option) and isinstance(param.type, Number):
                cases += [(name, param.opts[0], value) for value in _bad_values(param.type)]
    return cases


# Options that take numbers inside text: (command, option, bad value, arguments the value needs).
TEXT_OPTIONS = [
    *[(command, option, value, [])
      for command in ("run", "bisect", "sweep")
      for option in ("--head-dim-v", "--softmax-scale")
      for value in ("nan", "inf", "-inf", "0", "-1", HUGE, "x", ",")],
    *[(command, "--window", value, ["--mask", "none"])
      for command in ("run", "bisect", "sweep")
      for value in ("nan,0", "inf,0", "-2,0", "0,-2", f"{HUGE},0", "1e12,0", "a,b", "1.5,0")],
    *[(command, option, value, ["--mask", "padding"])
      for command in ("run", "bisect", "sweep")
      for option in ("--seqlens", "--seqlens-kv")
      for value in ("-1,4", "4,nan", "inf", HUGE, "x", "1.5")],
    *[(command, "--mask-source", value, ["--mask", "arbitrary"])
      for command in ("run", "bisect", "sweep")
      for value in ("random:nan", "random:inf", "random:-1", "random:2", "random:x")],
    *[("sweep", option, value, [])
      for option in ("--batch", "--seq", "--seq-kv", "--heads", "--kv-heads", "--head-dim", "--layers", "--tp")
      for value in ("0", "-1", "1,0", "nan", "inf", "1e12", HUGE, "16,x", "1.5", ",")],
    *[("sweep", "--seed", value, [])
      for value in ("-1", "0,-1", "nan", "inf", str(MAX_SEED + 1), str(2**64), HUGE, "1.5", "x")],
    *[("capture", option, value, [])
      for option in ("--layers", "--steps", "--ranks")
      for value in ("-1", "0,-1", "nan", "inf", HUGE, "x", "1.5")],
    *[("capture", "--max-bytes", value, []) for value in ("nan", "inf", "-1", "-1MB", "x", "1XB", "")],
    *[("sweep", "--shard", value, []) for value in ("0/4", "5/4", "1/0", "nan/2", "1/inf", f"1/{HUGE}", "x", "1",
                                                    "1.5/2", "/")],
]

CASES = [(command, option, value, []) for command, option, value in _typed_options()] + TEXT_OPTIONS


@pytest.mark.parametrize("command, option, value, extra", CASES,
                         ids=[f"{c}{o}={v[:12]}" for c, o, v, _ in CASES])
def test_a_bad_number_is_refused_with_one_line_naming_the_option(command, option, value, extra, run_cli, tmp_path,
                                                                  monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = [a.format(tmp=tmp_path) for a in BASE[command]]
    started = time.perf_counter()
    result = run_cli([command, *args, *extra, option, value, *TAIL.get(command, [])])
    line = one_line_error(result)  # exit 2, one line on stderr, no traceback
    assert option in line, line
    assert time.perf_counter() - started < 10  # refused, not run
    assert not (tmp_path / "attn-doctor-results").exists()
    assert not any(tmp_path.iterdir())  # nothing written


def test_every_numeric_option_is_a_checked_number():
    """No command parses a number with click's plain types (they take nan, inf and any size)."""
    plain = (click.types.IntParamType, click.types.FloatParamType)
    loose = [f"{name} {param.opts[0]}" for name, command in cli.commands.items() for param in command.params
             if isinstance(param.type, plain) and not isinstance(param.type, Number)]
    assert loose == []
    assert {"run", "sweep", "bisect", "replay", "capture", "compare", "report", "env"} <= set(cli.commands)
    assert MAX_TIMEOUT_S == 7 * 24 * 3600 and MAX_REPEATS == 1000 and MAX_SEED == 2**63 - 1


@pytest.mark.parametrize("option, value", [("--timeout", str(MAX_TIMEOUT_S)), ("--seed", str(MAX_SEED)),
                                           ("--seed", "0")])
def test_the_bounds_themselves_are_accepted(option, value):
    """The documented maximum and minimum parse (the run itself is not started here)."""
    context = cli.commands["run"].make_context("run", [*TINY, option, value], obj=None)
    assert str(context.params[option.lstrip("-")]) in (value, f"{float(value)}")


# --- nothing would be judged ------------------------------------------------------------------------------

@pytest.mark.parametrize("args", [["sweep", *TINY, "--tp", "3", "--out", "s"],
                                  ["sweep", *TINY, "--tp", "3", "--backend", "sdpa.math", "--out", "s"],
                                  ["sweep", *TINY, "--tp", "3", "--layers", "2", "--out", "s"],
                                  ["run", *TINY, "--tp", "3", "--json", "r.json"]],
                         ids=["sweep-tp", "sweep-tp-one-backend", "sweep-tp-layers", "run-tp"])
def test_tp_that_cannot_split_the_heads_is_refused(args, run_cli, tmp_path, monkeypatch):
    """With 2 heads no TP=3 probe can run: the baseline's own single call (or TP=1 stack), run only as their
    reference, does not make the request judged."""
    monkeypatch.chdir(tmp_path)
    line = one_line_error(run_cli(args))
    assert "nothing was tested" in line and "TP=3 needs heads (2)" in line, line
    assert not any(tmp_path.iterdir())


# --- sweep --out and an existing folder -------------------------------------------------------------------

def test_sweep_out_takes_an_empty_folder_and_never_overwrites_results(run_cli, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    out.mkdir()  # exists and is empty: it becomes the sweep's folder
    args = ["sweep", *TINY, "--backend", "sdpa.math", "--layout", "contiguous", "--out", out]
    result = run_cli(args)
    assert result.exit_code == 0, result.output
    assert {p.name for p in out.iterdir()} >= {"results.jsonl", "results.json", "sweep.json"}
    assert json.loads((out / "results.json").read_text())["results"]
    assert not (tmp_path / "attn-doctor-results").exists()

    again = one_line_error(run_cli(args))  # a folder holding a sweep: continue it or choose another
    assert "already holds a sweep" in again and "--resume" in again

    (out / "results.jsonl").unlink()  # results.json alone (a run's --json, say) is not written over
    before = (out / "results.json").read_bytes()
    line = one_line_error(run_cli(args))
    assert "results.json" in line and "new or empty --out" in line, line
    assert (out / "results.json").read_bytes() == before


@pytest.mark.parametrize("timeout", [math.inf, math.nan, 0, -1, 1e12, True, "300"])
def test_the_python_api_checks_the_timeout_as_the_command_line_does(timeout):
    """A request made in Python (not through click) is held to --timeout's range too: no traceback deep in a
    worker's deadline arithmetic, one BadInput naming it."""
    from attn_doctor.backends import select
    from attn_doctor.core.case import make_case
    from attn_doctor.core.errors import BadInput
    from attn_doctor.workflows.run import RunRequest, run

    request = RunRequest(make_case(batch=1, seq=4, heads=1, head_dim=8), select(["sdpa.math"]), ["contiguous"],
                         "cpu", "test", timeout)
    with pytest.raises(BadInput, match="--timeout takes a number of seconds above 0 and at most 604800"):
        run(request)
