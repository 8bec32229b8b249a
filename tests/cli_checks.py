"""Checks shared by the CLI tests."""

from __future__ import annotations


def one_line_error(result) -> str:
    """A refused command: exit 2, exactly one line on stderr, no traceback; returns that line."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attn-doctor: error: ")
    return lines[0]


# Lines the tool prints for the reader to copy whole (a file it wrote, the next command): never wrapped, so only
# these may be wider than 80 columns (`Application.say`).
COPYABLE = ("results:", "report:", "plot:", "repro:", "bisect:", "json:", "issue:", "replay:")


def wrapped_lines(text: str) -> list[str]:
    """The lines of `text` the tool fits to the terminal's width: all but the copyable ones."""
    return [line for line in text.splitlines() if not line.startswith(COPYABLE)]
