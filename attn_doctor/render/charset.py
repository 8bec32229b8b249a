"""What a terminal that cannot print Unicode gets: ASCII spellings of the symbols attn-doctor writes.

Tables, verdicts and reports use ×, ≠, ε, —, →, ≤, ≥, … and µ, and rich draws boxes with line-drawing
characters. A stream whose encoding cannot hold them (`PYTHONIOENCODING=ascii`, a C locale without UTF-8,
latin-1) ended the command in a UnicodeEncodeError traceback, after the run had finished but before its
results were saved. Here each character such a stream cannot encode is spelled from one table (`×` -> `x`,
`≠` -> `!=`, box drawings -> `-`, `|`, `+`), and one that is in no table becomes `?`: never a traceback.

Two places apply it, both only to a stream that cannot encode Unicode (a UTF-8 stream gets every character
unchanged, and so do files: results, --output and reports are written as UTF-8 elsewhere):

- the consoles (`printable_console`) spell a table's cells, title, caption and box before rich lays the
  table out, so that a longer spelling (`≠` -> `!=`) widens its column instead of shifting the row;
- the standard streams themselves (`printable_standard_streams`), for what reaches them otherwise: click.echo
  (reports and error lines), rich's own ellipsis, warnings.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import itertools
import sys
import unicodedata
from collections.abc import Iterator
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console, ConsoleRenderable
    from rich.table import Table
    from rich.text import Text

ASCII_SPELLINGS: dict[str, str] = {
    "×": "x",
    "≠": "!=",
    "≤": "<=",
    "≥": ">=",
    "≈": "~",
    "±": "+/-",
    "ε": "eps",
    "µ": "u",  # MICRO SIGN
    "μ": "u",  # GREEK SMALL LETTER MU
    "√": "sqrt",
    "Σ": "sum",
    "∞": "inf",
    "‖": "||",  # DOUBLE VERTICAL LINE (a norm)
    "−": "-",  # MINUS SIGN
    "—": "-",  # EM DASH
    "–": "-",  # EN DASH
    "‐": "-",  # HYPHEN
    "→": "->",
    "←": "<-",
    "⇒": "=>",
    "…": "...",
    "·": ".",  # MIDDLE DOT
    "•": "*",
    "‘": "'",
    "’": "'",
    "“": '"',
    "”": '"',
    "\u00a0": " ",  # NO-BREAK SPACE
}
UNKNOWN = "?"  # what a character in no table becomes (what errors="replace" writes)
ERROR_HANDLER = "attn-doctor-ascii"  # the codecs error handler that spells what an encoding cannot hold


def ascii_spelling(char: str) -> str:
    """`char` in ASCII: its spelling in the table; a box-drawing character as `-`, `|` or `+` (one column, so
    that a box keeps its shape); else `?`."""
    if char in ASCII_SPELLINGS:
        return ASCII_SPELLINGS[char]
    name = unicodedata.name(char, "")
    if name.startswith("BOX DRAWINGS "):
        strokes = name.removeprefix("BOX DRAWINGS ")
        if " AND " not in strokes and "HORIZONTAL" in strokes and "VERTICAL" not in strokes:
            return "-"
        if " AND " not in strokes and "VERTICAL" in strokes and "HORIZONTAL" not in strokes:
            return "|"
        return "+"
    return UNKNOWN


def _spell(error: UnicodeError) -> tuple[str, int]:
    if not isinstance(error, UnicodeEncodeError):
        raise error
    return "".join(ascii_spelling(char) for char in error.object[error.start:error.end]), error.end


codecs.register_error(ERROR_HANDLER, _spell)


def unicode_capable(encoding: str | None) -> bool:
    """Whether a stream of `encoding` can print every character (the UTF encodings, and GB18030)."""
    try:
        name = codecs.lookup(encoding or "ascii").name
    except LookupError:
        return False
    return name.startswith("utf") or name == "gb18030"


def printable(text: str, encoding: str) -> str:
    """`text` as a stream of `encoding` can print it: what the encoding holds unchanged, every other character
    spelled in ASCII (`ascii_spelling`)."""
    try:
        return text.encode(encoding, ERROR_HANDLER).decode(encoding)
    except LookupError:  # an encoding Python does not know: ASCII prints on any terminal
        return text.encode("ascii", ERROR_HANDLER).decode("ascii")


class PrintableStream:
    """A text stream that spells what its `stream`'s encoding cannot hold (`printable`) and is otherwise that
    stream (its encoding, fileno, isatty, flush).

    It has no `buffer`, on purpose: click writes UTF-8 bytes straight into the buffer of a stream whose
    encoding is ASCII, which a terminal that cannot print Unicode shows as garbage."""

    def __init__(self, stream: IO[str]):
        self._stream = stream

    def write(self, text: str) -> int:
        if not isinstance(text, str):  # click probes whether a stream takes bytes
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._stream.write(printable(text, self.encoding))
        return len(text)

    def writelines(self, lines: Iterator[str]) -> None:
        for line in lines:
            self.write(line)

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "ascii"

    def __getattr__(self, name: str) -> Any:
        if name == "buffer":
            raise AttributeError("a PrintableStream takes text only (see its docstring)")
        return getattr(self._stream, name)


@contextlib.contextmanager
def printable_standard_streams() -> Iterator[None]:
    """sys.stdout and sys.stderr as `PrintableStream`s while the block runs, where their encoding cannot
    print Unicode (left as they are where it can); the streams they were, after."""
    before = sys.stdout, sys.stderr
    try:
        sys.stdout, sys.stderr = (_guarded(stream) for stream in before)
        yield
    finally:
        sys.stdout, sys.stderr = before


def _guarded(stream: IO[str] | None) -> Any:
    if stream is None or isinstance(stream, PrintableStream) or unicode_capable(getattr(stream, "encoding", None)):
        return stream
    return PrintableStream(stream)


def printable_renderable(renderable: Any, encoding: str) -> Any:
    """A str, rich Text or rich Table (its cells, headers, title, caption and box) spelled for `encoding`, with
    the Text's styles kept on the spelled characters; anything else as it is (the stream spells it then)."""
    from rich.table import Table
    from rich.text import Text

    if isinstance(renderable, str):
        return printable(renderable, encoding)
    if isinstance(renderable, Text):
        return _printable_text(renderable, encoding)
    if isinstance(renderable, Table):
        return _printable_table(renderable, encoding)
    return renderable


def _printable_text(text: Text, encoding: str) -> Text:
    from rich.text import Span

    plain = text.plain
    if printable(plain, encoding) == plain:
        return text
    pieces = [printable(char, encoding) for char in plain]
    offsets = list(itertools.accumulate((len(piece) for piece in pieces), initial=0))  # old index -> new index
    spelled = text.blank_copy("".join(pieces))
    spelled.spans = [Span(offsets[min(span.start, len(plain))], offsets[min(span.end, len(plain))], span.style)
                     for span in text.spans]
    return spelled


def _printable_table(table: Table, encoding: str) -> Table:
    import copy

    from rich.box import Box

    spelled = copy.copy(table)
    spelled.title = printable_renderable(table.title, encoding)
    spelled.caption = printable_renderable(table.caption, encoding)
    if table.box is not None and not table.box.ascii:
        # ascii=True: printable on this stream, so that rich keeps this box's shape instead of its full ASCII grid.
        spelled.box = Box(printable(str(table.box), encoding), ascii=True)
    # Column keeps its cells in `_cells` (its `cells` property only reads them).
    spelled.columns = [dataclasses.replace(column, header=printable_renderable(column.header, encoding),
                                           footer=printable_renderable(column.footer, encoding),
                                           _cells=[printable_renderable(cell, encoding) for cell in column.cells])
                       for column in table.columns]
    return spelled


class _PrintableRenderables:
    """rich's render hook (rich.console.RenderHook): what a console prints, spelled for its stream's encoding
    before rich measures and lays it out."""

    def __init__(self, console: Console):
        self._console = console

    def process_renderables(self, renderables: list[ConsoleRenderable]) -> list[ConsoleRenderable]:
        encoding = self._console.encoding
        if unicode_capable(encoding):
            return renderables
        return [printable_renderable(renderable, encoding) for renderable in renderables]


def printable_console(**options: Any) -> Console:
    """A rich Console (`options` as rich takes them) that prints on a stream that cannot encode Unicode in
    ASCII spellings, its tables in ASCII boxes of the same shape."""
    from rich.console import Console

    console = Console(**options)
    console.push_render_hook(_PrintableRenderables(console))  # type: ignore[arg-type]
    return console
