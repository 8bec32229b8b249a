"""Reading a document (JSON, TOML) from a file: its two failures, a file that cannot be read and text that
does not parse, become the caller's one-line errors, never a traceback."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

Parsed = TypeVar("Parsed")
ParseError = TypeVar("ParseError", bound=Exception)


def read_document(
    path: Path,
    parse: Callable[[str], Parsed],
    parse_error: type[ParseError],
    unreadable: Callable[[OSError | UnicodeDecodeError], Exception],
    malformed: Callable[[ParseError], Exception],
) -> Parsed:
    """`parse` of the file's UTF-8 text. Raises ``unreadable(exc)`` when the file cannot be read (missing
    included) and ``malformed(exc)`` when `parse` raises `parse_error`."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise unreadable(exc) from None
    try:
        return parse(text)
    except parse_error as exc:
        raise malformed(exc) from None
