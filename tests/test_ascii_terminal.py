"""A terminal that cannot print Unicode (`PYTHONIOENCODING=ascii`, a C locale without UTF-8, latin-1): every
command prints its tables, lines and reports in ASCII spellings, its boxes in ASCII, and never a traceback.

The commands run as real processes on such streams; their paths (a kernel, results, a capture) sit in a folder
named with characters ASCII cannot hold, and the verdicts hold × and ε, so each command has something to spell.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import click
import pytest
from rich.table import Table
from rich.text import Text

from attn_doctor.render.charset import PrintableStream, printable, printable_console, printable_standard_streams
from tests.conftest import FAULTY, SMALL_FLAGS

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = ROOT / "tests" / "models" / "tiny_gpt.py"
FOLDER = "résumé×ε"  # ASCII holds none of é, × and ε; latin-1 holds é and × but not ε
ASCII = {"PYTHONIOENCODING": "ascii"}
LATIN_1 = {"PYTHONIOENCODING": "latin-1"}
C_LOCALE = {"LC_ALL": "C", "LANG": "C", "PYTHONUTF8": "0", "PYTHONCOERCECLOCALE": "0"}  # no PEP 538/540 rescue
ENCODING_VARIABLES = ("PYTHONIOENCODING", "PYTHONUTF8", "PYTHONCOERCECLOCALE", "LC_ALL", "LC_CTYPE", "LANG")
KERNEL = "bad={work}/kernels/faulty.py:dq_two_percent"


@dataclass(frozen=True)
class Case:
    """A command (`{work}`: the folder with the unprintable name), its exit code and what it says on stdout and
    stderr (`{path}`: that folder, `{folder}`: its name, as the terminal spells them)."""

    args: list[str]
    exit_code: int
    says: list[str]
    terminal: dict[str, str] = field(default_factory=lambda: dict(ASCII))
    encoding: str = "ascii"  # what stdout and stderr must decode as
    says_on_stderr: list[str] = field(default_factory=list)
    needs: str | None = None  # the case whose files this one reads (run before it)


CASES = {
    "env": Case(["env", "--no-te"], 0, ["Environment", "NVTE_ATTN_DOCTOR_TEST={folder}"]),
    "run": Case(["run", *SMALL_FLAGS, "--layout", "contiguous", "--kernel", KERNEL, "--json", "{work}/run.json"], 1,
                ["FAIL", "bad", "xbase", "eps", "Faulty: bad [{path}/kernels/faulty.py", "results: {path}/run.json"]),
    "sweep": Case(["sweep", "--batch", "1", "--seq", "16", "--heads", "2", "--head-dim", "8", "--device", "cpu",
                   "--backend", "sdpa.math", "--layout", "contiguous", "--kernel", KERNEL, "--out", "{work}/sweep"], 1,
                  ["sweep summary", "bad", "Faulty: borderline: bad", "x rounding noise"]),
    "bisect": Case(["bisect", "--from", "{work}/run.json", "--device", "cpu", "--json", "{work}/bisect.json"], 0,
                   ["bisect of bad: probes", "minimal failing case", "3 x", "repro:   {path}/repro_bad_"], needs="run"),
    "report markdown": Case(["report", "{work}/run.json", "--format", "markdown"], 0,
                            ["FAIL", "bad", "xbase", "eps", "{path}/kernels/faulty.py"], needs="run"),
    "report issue": Case(["report", "{work}/run.json", "--format", "issue"], 0, ["FAIL", "bad", "eps"], needs="run"),
    "report csv": Case(["report", "{work}/run.json", "--format", "csv"], 0, ["FAIL", "{path}/kernels/faulty.py"],
                       needs="run"),
    "report json": Case(["report", "{work}/run.json", "--format", "json"], 0, ['"verdict": "FAIL"'], needs="run"),
    "report markdown, latin-1": Case(["report", "{work}/run.json", "--format", "markdown"], 0,
                                     ["FAIL", "×base", "eps", "{path}/kernels/faulty.py"], dict(LATIN_1), "latin-1",
                                     needs="run"),
    "report issue, C locale": Case(["report", "{work}/run.json", "--format", "issue"], 0, ["FAIL", "bad", "eps"],
                                   dict(C_LOCALE), needs="run"),
    "capture": Case(["capture", "--out", "{work}/capture", "--values", "--layers", "0", "--", sys.executable,
                     str(TINY_GPT), "--steps", "1", "--layers", "2"], 0,
                    ["2 attention calls recorded in {path}/capture"]),
    "replay": Case(["replay", "{work}/capture", "--backend", "sdpa.math", "--device", "cpu", "--out", "{work}/replay"],
                   0, ["2 calls, 1 distinct", "sweep summary", "sdpa.math", "results: {path}/replay/results.json"],
                   needs="capture"),
    "compare": Case(["compare", "{work}/capture", "{work}/capture"], 0, ["A = {path}/capture", "same within rounding"],
                    needs="capture"),
    "error line": Case(["report", "{work}/missing.json"], 2, [],
                       says_on_stderr=["attn-doctor: error: no results file {path}/missing.json"]),
}


class Terminal:
    """Every case run as a process whose stdout and stderr cannot encode Unicode, in `work`: those that need no
    other case's files side by side, then the rest side by side."""

    def __init__(self, work: Path):
        self.work = work
        self.done: dict[str, subprocess.CompletedProcess] = {}
        for wave in ([n for n, c in CASES.items() if not c.needs], [n for n, c in CASES.items() if c.needs]):
            started = {name: self._start(CASES[name]) for name in wave}
            for name, process in started.items():
                stdout, stderr = process.communicate(timeout=180)
                self.done[name] = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)

    def _start(self, case: Case) -> subprocess.Popen:
        env = {k: v for k, v in os.environ.items() if k not in ENCODING_VARIABLES}
        env.update({"NVTE_ATTN_DOCTOR_TEST": FOLDER, "COLUMNS": "200", **case.terminal})
        return subprocess.Popen([sys.executable, "-m", "attn_doctor", *(a.format(work=self.work) for a in case.args)],
                                cwd=self.work, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def spelled(self, text: str, case: Case) -> str:
        """`text` as the case's terminal prints it; in the C locale each of its non-ASCII bytes is one "?"."""
        if case.terminal == C_LOCALE:
            return "".join(char if char.isascii() else "?" * len(char.encode()) for char in text)
        return printable(text, case.encoding)


@pytest.fixture(scope="module")
def terminal(tmp_path_factory) -> Terminal:
    work = tmp_path_factory.mktemp("ascii") / FOLDER
    (work / "kernels").mkdir(parents=True)
    shutil.copy(FAULTY, work / "kernels" / "faulty.py")
    return Terminal(work)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_every_command_prints_on_a_terminal_that_cannot_print_unicode(terminal, name):
    case = CASES[name]
    done = terminal.done[name]
    stderr = done.stderr.decode(case.encoding)  # raises where the command wrote what the terminal cannot show
    stdout = done.stdout.decode(case.encoding)
    assert "Traceback" not in stderr, stderr
    assert done.returncode == case.exit_code, stdout + stderr
    names = {"path": terminal.spelled(str(terminal.work), case), "folder": terminal.spelled(FOLDER, case)}
    for text in case.says:
        assert text.format(**names) in stdout, (text.format(**names), stdout)
    for text in case.says_on_stderr:
        assert text.format(**names) in stderr, (text.format(**names), stderr)


@pytest.mark.slow
def test_json_on_such_a_terminal_keeps_its_data(terminal):
    """JSON escapes what ASCII cannot hold (\\u00d7): the document on stdout holds the path as it is, unspelled."""
    document = json.loads(terminal.done["report json"].stdout.decode("ascii"))
    assert {row["ran"] for row in document["results"] if row["backend"] == "bad"} == {
        f"{terminal.work}/kernels/faulty.py:dq_two_percent"}


def test_what_an_encoding_cannot_hold_is_spelled_and_the_rest_kept():
    assert printable("3 × ε ≠ 2.1e-07 — µs → ≤ ≥ …", "ascii") == "3 x eps != 2.1e-07 - us -> <= >= ..."
    assert printable("3 × ε µs", "latin-1") == "3 × eps µs"
    assert printable("café ✓", "ascii") == "caf? ?"  # in no table: errors="replace"
    assert printable("3 × ε", "utf-8") == "3 × ε"


def _ascii_stream() -> tuple[io.BytesIO, PrintableStream]:
    raw = io.BytesIO()
    return raw, PrintableStream(io.TextIOWrapper(raw, encoding="ascii", write_through=True))


def test_a_table_keeps_its_shape_and_styles_in_ascii():
    raw, stream = _ascii_stream()
    console = printable_console(file=stream, width=40, force_terminal=True, color_system="standard")
    table = Table(title="dQ ≠ dQ_TP1")
    table.add_column("err\n×base", justify="right")
    table.add_column("verdict")
    table.add_row(Text("0.58×", style="red"), Text("≠ repeats", style="bold"))
    console.print(table)
    text = raw.getvalue().decode("ascii")
    plain = click.unstyle(text).splitlines()
    assert plain == [  # the columns measured on the spellings: "!= repeats" widens its column, shifts nothing
        "     dQ != dQ_TP1     ",
        "+-------+------------+",
        "|   err |            |",
        "| xbase | verdict    |",
        "+-------+------------+",
        "| 0.58x | != repeats |",
        "+-------+------------+"]
    assert "\x1b[31m0.58x\x1b[0m" in text and "\x1b[1m!= repeats\x1b[0m" in text  # the spelling keeps its style


def test_click_echo_on_an_ascii_stdout_writes_ascii_not_utf8(monkeypatch):
    """click writes UTF-8 into the buffer of a stdout it takes for misconfigured ASCII; the PrintableStream that
    stands for it has no buffer, so the spelled text is what arrives."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii", write_through=True))
    with printable_standard_streams():
        click.echo("dQ 4.3× rounding noise, 0.25 ε")
    assert raw.getvalue() == b"dQ 4.3x rounding noise, 0.25 eps\n"
