"""Errors that reach the user as one line and exit code 2 (bad input), never a traceback; and the one-line
form every other caught exception is reported in."""

from __future__ import annotations


class BadInput(Exception):
    """Something the user gave us is wrong; the message says what and how to fix it."""


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (the type name alone for an empty message)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
