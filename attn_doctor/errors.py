"""Errors that reach the user as one line and exit code 2 (bad input), never a traceback."""

from __future__ import annotations


class BadInput(Exception):
    """Something the user gave us is wrong; the message says what and how to fix it."""
