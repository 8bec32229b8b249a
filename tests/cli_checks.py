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
