"""Two of issue 44's classes. An option that would be ignored is bad input: exit 2, one line on stderr naming the
option and what to do, nothing run (the same options where they do apply are accepted). A command `capture`
cannot start (empty, not found, a folder, not executable, a RANK that is not a number): exit 2, one line."""

from __future__ import annotations

import sys

import pytest

from tests.conftest import SMALL_FLAGS

IGNORED = [  # (arguments, the option the line must name, words it must say)
    (["run", *SMALL_FLAGS, "--cp-comm-type", "a2a"], "--cp-comm-type", "--cp"),
    (["sweep", *SMALL_FLAGS, "--layers", "1,2", "--workers", "2"], "--workers", "one worker"),
    (["bisect", *SMALL_FLAGS, "--backend", "sdpa.math", "--row", "1"], "--row", "--from"),
    (["capture", "--out", "{tmp}/cap", "--max-bytes", "1MB", "--", sys.executable, "-c", "pass"], "--max-bytes",
     "--values"),
    (["capture", "--out", "{tmp}/cap", "--values", "--max-bytes", "0", "--", sys.executable, "-c", "pass"],
     "--max-bytes", "above 0"),
]


@pytest.mark.parametrize("arguments, option, words", IGNORED, ids=[" ".join(a[:1] + [o]) for a, o, _ in IGNORED])
def test_an_option_that_would_be_ignored_is_refused(run_cli, tmp_path, arguments, option, words):
    result = run_cli([a.format(tmp=tmp_path) for a in arguments])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert len(line.splitlines()) == 1 and "Traceback" not in result.output
    assert option in line and words in line, line
    assert not (tmp_path / "cap").exists()  # nothing ran


def test_the_same_options_where_they_apply_are_accepted(run_cli, tmp_path):
    attention = "import torch; torch.nn.functional.scaled_dot_product_attention(*[torch.ones(1, 1, 2, 4)] * 3)"
    result = run_cli(["capture", "--out", tmp_path / "cap", "--values", "--max-bytes", "1MB", "--", sys.executable,
                      "-c", attention])
    assert result.exit_code == 0, result.output


COMMANDS = [  # (the command after --, words the line must say); "{tmp}" is the test's folder
    ([""], "no command to run"),
    (["no-such-program-anywhere"], "is not a program on PATH"),
    (["{tmp}"], "is a folder"),
    (["{tmp}/script.py"], "is not executable"),
]


@pytest.mark.parametrize("command, words", COMMANDS, ids=["empty", "not found", "a folder", "not executable"])
def test_a_command_capture_cannot_start_is_one_line(run_cli, tmp_path, command, words):
    """Issue 44's class "capture's command": exit 2, one line, no capture folder made."""
    (tmp_path / "script.py").write_text("print('hi')\n")
    result = run_cli(["capture", "--out", tmp_path / "cap", "--", *[c.format(tmp=tmp_path) for c in command]])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and words in result.stderr
    assert not (tmp_path / "cap").exists()


def test_a_rank_that_is_not_a_number_is_one_line(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "first")
    result = run_cli(["capture", "--out", tmp_path / "cap", "--", sys.executable, "-c", "pass"])
    assert result.exit_code == 2 and "RANK='first'" in result.stderr and not (tmp_path / "cap").exists()
