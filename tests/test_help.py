"""The lines a person copies or reads first (issue 50): every command's --help ends with examples that parse and
its exit codes; a bare `attn-doctor` shows its help, not an error; a command the tool prints for the reader to run
next is one line whatever the width, in a pipe too, its paths quoted; `report` of a path that does not exist says
to check the path."""

from __future__ import annotations

import shlex

import pytest

from attn_doctor.cli import cli
from attn_doctor.cli.epilogs import EXAMPLES, EXIT_CODES
from cli_checks import one_line_error

COMMANDS = sorted(cli.commands)


def test_every_command_has_examples_and_exit_codes():
    assert set(EXAMPLES) == set(EXIT_CODES) == set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_help_ends_with_the_examples_and_the_exit_codes(command, run_cli):
    result = run_cli([command, "--help"])
    assert result.exit_code == 0
    tail = result.output[result.output.index("Examples:"):]
    for example in EXAMPLES[command]:
        assert example in tail, example  # each on one line, as written
    assert "Exit codes: 0 " in tail and " 2 " in tail


@pytest.mark.parametrize("command,example", [(c, e) for c in COMMANDS for e in EXAMPLES[c]])
def test_every_example_names_options_its_command_takes(command, example, run_cli):
    """The example's words, with --help where its options end (before a captured command's `--`): click refuses
    an option it does not know before it reaches --help."""
    words = shlex.split(example.split(" > ")[0])[1:]
    cut = words.index("--") if "--" in words else len(words)
    result = run_cli([*words[:cut], "--help"])
    assert result.exit_code == 0, result.output


def test_a_bare_command_shows_its_help_without_calling_it_an_error(run_cli):
    result = run_cli([])
    assert result.exit_code == 2
    assert result.output.startswith("Usage: ") and "error" not in result.output.split("\n")[0]
    assert "Commands:" in result.output


def test_the_next_command_printed_is_one_line_at_any_width(tmp_path, monkeypatch, run_cli):
    """In a pipe (CliRunner's output is no terminal) 40 columns wide, with a space in the path: the `report:` line
    is the whole command, its path quoted, and copying it runs it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "40")
    out = tmp_path / "a folder with a long name" / "results.json"
    result = run_cli(["run", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu",
                      "--backend", "sdpa.math", "--layout", "contiguous", "--json", out])
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    report = next(line for line in lines if line.startswith("report:"))
    assert report == f"report:  attn-doctor report {shlex.quote(str(out))} --format markdown"
    assert f"results: {out}" in lines
    again = run_cli(shlex.split(report.removeprefix("report:"))[1:])
    assert again.exit_code == 0, again.output


def test_report_of_a_path_that_does_not_exist_says_to_check_it(tmp_path, run_cli):
    line = one_line_error(run_cli(["report", tmp_path / "resluts.json"]))
    assert "does not exist; check the path" in line and "attn-doctor run --json" not in line
