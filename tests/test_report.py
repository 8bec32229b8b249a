"""`attn-doctor report`: goldens, well-formed GitHub tables, a parseable self-contained HTML page, CSV, JSON.

Everything renders the fixed results document tests/data/results-fixed.json (how it was built:
tests/golden/README.md) through click's CliRunner, in-process: no probe runs, so the module takes about
a second. The document holds PASS, FAIL (one with NaN), ERROR and SKIP rows, depth-sweep rows, a fixed GPU
environment, and one row whose backend, `ran` and `reason` are markdown- and HTML-hostile.

Update the goldens deliberately: ATTN_DOCTOR_UPDATE_GOLDEN=1 pytest tests/test_report.py -k golden
"""

from __future__ import annotations

import base64
import copy
import csv
import difflib
import html
import io
import json
import os
import re
import shlex
import string
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest

from attn_doctor.cli import known as cli_known
from attn_doctor.render.markdown import escape as md_escape
from attn_doctor.results.report import RunReport

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "results-fixed.json"
GOLDEN = HERE / "golden"
UPDATE = os.environ.get("ATTN_DOCTOR_UPDATE_GOLDEN") == "1"

SCRIPT = "<script>alert(1)</script>"
HOSTILE_BACKEND = "evil<script>alert(1)</script>a|b**x**&amp;"
HOSTILE_TEXT = "<script>alert(1)</script> a|b **x** &amp;\nsecond line"
HOSTILE_RAN = "ran " + HOSTILE_TEXT
HOSTILE_REASON = "dq: " + HOSTILE_TEXT
# What the report shows for matching known defects is fixed here, so the golden pins the report, not the
# known-bug data file (tests/test_known_defects.py covers that); the entry is made up and hostile on purpose.
KNOWN = ["EXAMPLE (test fixture, not a real defect): TE 2.20.2 + cuDNN 9.14.0 on sm_90 <b>bold</b> a|b"]
MD_ALLOWED_TAGS = {"details", "summary", "sub", "br"}  # the HTML the markdown writer itself emits
FAILING = ("FAIL", "ERROR")


# --- fixtures and helpers ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def doc() -> dict:
    return json.loads(DATA.read_text())


@pytest.fixture(scope="module")
def report(doc) -> RunReport:
    return RunReport.from_dict(doc)


@pytest.fixture
def fixed_known(monkeypatch):
    monkeypatch.setattr(cli_known, "known_defects", lambda report: list(KNOWN))


@pytest.fixture
def render(run_cli, fixed_known):
    """render(path, fmt) -> stdout of `attn-doctor report PATH --format FMT`, which must exit 0."""

    def go(path, fmt: str) -> str:
        result = run_cli(["report", path, "--format", fmt])
        assert result.exit_code == 0, result.output
        assert result.stderr == ""
        return result.stdout

    return go


def tiny_png() -> bytes:
    """A valid 1x1 grey PNG, built from its chunks."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", 1, 1, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\x00\x80")) + chunk(b"IEND", b"")


@pytest.fixture
def plot_dir(tmp_path, doc) -> Path:
    """A run folder: the fixed document as results.json with its depth plot beside it."""
    (tmp_path / "results.json").write_text(json.dumps(doc))
    (tmp_path / doc["artifacts"]["plot"]).write_bytes(tiny_png())
    return tmp_path


def write_doc(path: Path, document: dict) -> Path:
    path.write_text(json.dumps(document))
    return path


def check_golden(name: str, text: str) -> None:
    path = GOLDEN / name
    if UPDATE:
        path.write_bytes(text.encode())
        return
    expected = path.read_bytes().decode()
    if text != expected:
        diff = "".join(difflib.unified_diff(expected.splitlines(True), text.splitlines(True),
                                            f"tests/golden/{name}", "rendered", n=2))
        pytest.fail(f"report output differs from tests/golden/{name}; if the change is intended, run "
                    f"ATTN_DOCTOR_UPDATE_GOLDEN=1 pytest tests/test_report.py -k golden and review the diff:\n{diff}")


def strip_code(md: str) -> str:
    """The markdown without fenced blocks and inline code spans (whose text GitHub shows literally)."""
    out, fenced = [], False
    for line in md.splitlines():
        if line.startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "", line))
    return "\n".join(out)


def outside_fences(md: str) -> list[str]:
    lines, fenced = [], False
    for line in md.splitlines():  # splits at \r too, as GitHub does
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def table_blocks(md: str) -> list[list[str]]:
    """Runs of consecutive lines starting with '|', outside code fences."""
    blocks, current = [], []
    for line in outside_fences(md) + [""]:
        if line.startswith("|"):
            current.append(line)
        elif current:
            blocks.append(current)
            current = []
    return blocks


def split_cells(line: str) -> list[str]:
    """A GitHub table line's cells: split at '|' not escaped by a backslash (cmark-gfm's rule)."""
    cells, cell, i = [], "", 0
    while i < len(line):
        if line[i] == "\\" and i + 1 < len(line):
            cell += line[i:i + 2]
            i += 2
            continue
        if line[i] == "|":
            cells.append(cell)
            cell = ""
        else:
            cell += line[i]
        i += 1
    cells.append(cell)
    assert cells[0] == "" and cells[-1].strip() == "", f"a table line must start and end with '|': {line!r}"
    return [c.strip() for c in cells[1:-1]]


DELIMITER = re.compile(r"^\|(\s*:?-{3,}:?\s*\|)+$")


def md_tables(md: str) -> list[tuple[list[str], list[list[str]]]]:
    """(header, body rows) of every table, after checking each is a well-formed GitHub table."""
    tables = []
    for block in table_blocks(md):
        assert len(block) >= 3, "a table needs a header, a delimiter row and a body:\n" + "\n".join(block)
        assert DELIMITER.match(block[1]), f"second line is not a delimiter row: {block[1]!r}"
        header = split_cells(block[0])
        assert len(split_cells(block[1])) == len(header)
        body = [split_cells(line) for line in block[2:]]
        for line, cells in zip(block[2:], body):
            assert len(cells) == len(header), f"{len(cells)} cells under {len(header)} columns: {line!r}"
        tables.append((header, body))
    return tables


def md_table(md: str, first_column: str, second_column: str) -> tuple[list[str], list[list[str]]]:
    (found,) = [t for t in md_tables(md) if t[0][:2] == [first_column, second_column]]
    return found


def cell_text(cell: str) -> str:
    """What GitHub shows for a table cell, or a NUL where the cell holds live markup (emphasis, a raw tag)."""
    out, i = [], 0
    while i < len(cell):
        if cell[i] == "\\" and i + 1 < len(cell) and cell[i + 1] in string.punctuation:
            out.append(cell[i + 1])
            i += 2
            continue
        if cell.startswith("<br>", i):
            out.append("\n")
            i += 4
            continue
        entity = re.match(r"&(#\d+|#x[0-9a-fA-F]+|[A-Za-z][A-Za-z0-9]*);", cell[i:])
        if entity:
            out.append(html.unescape(entity.group()))
            i += len(entity.group())
            continue
        out.append("\0" if cell[i] in "*<`" else cell[i])
        i += 1
    return "".join(out)


class PageParser(HTMLParser):
    """Tags (balanced, checked as they come), attributes, text, script bodies and tables of an HTML page."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.stack: list[str] = []
        self.problems: list[str] = []
        self.starts: list[tuple[str, dict]] = []
        self.text: list[str] = []
        self.scripts: list[str] = []
        self.tables: list[list[list[str]]] = []  # rows of cell texts; the header row first

    def handle_starttag(self, tag, attrs):
        self.starts.append((tag, dict(attrs)))
        if tag == "script":
            self.scripts.append("")
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("td", "th") and self.tables:
            self.tables[-1][-1].append("")
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):
        self.starts.append((tag, dict(attrs)))
        if tag not in self.VOID:
            self.problems.append(f"self-closed <{tag}/>")

    def handle_endtag(self, tag):
        if tag in self.VOID:
            self.problems.append(f"end tag of void element </{tag}>")
        elif not self.stack or self.stack[-1] != tag:
            self.problems.append(f"</{tag}> closes {self.stack[-1] if self.stack else 'nothing'}")
        else:
            self.stack.pop()

    def handle_data(self, data):
        if self.stack and self.stack[-1] == "script":
            self.scripts[-1] += data
            return
        self.text.append(data)
        if self.tables and {"td", "th"} & set(self.stack[-1:]):
            self.tables[-1][-1][-1] += data


def parse_html(page: str) -> PageParser:
    parser = PageParser()
    parser.feed(page)
    parser.close()
    assert not parser.problems, parser.problems
    assert parser.stack == [], f"unclosed: {parser.stack}"
    return parser


def html_table(parser: PageParser, first_column: str, second_column: str) -> list[list[str]]:
    (found,) = [t for t in parser.tables if t and t[0][:2] == [first_column, second_column]]
    return found


def measured(report: RunReport):
    return [row for row in report.rows if row.tensors]


def failing_rows(report: RunReport):
    return [row for row in report.rows if row.verdict in FAILING]


# --- the fixed document itself ----------------------------------------------------------------------------

def test_fixed_document_covers_what_the_report_must_show(report):
    verdicts = {row.verdict for row in report.rows}
    assert verdicts == {"PASS", "FAIL", "ERROR", "SKIP"}
    assert report.env is not None and report.env.gpus[0].name == "NVIDIA H200" and report.env.gpus[0].sm == "sm_90"
    assert report.env.te_cudnn.value.startswith("9.14.0") and "differs" in report.env.te_cudnn.note
    assert report.env.env_vars["NVTE_DEBUG"] == "1"
    depth = [row for row in report.rows if row.coords.params().get("probe") == "depth"]
    assert {row.coords.params()["layers"] for row in depth} == {1, 2}
    assert all(set(row.tensors) == {"dq_first", "dq_last"} for row in depth)
    (hostile,) = [row for row in report.rows if row.backend == HOSTILE_BACKEND]
    assert (hostile.ran, hostile.reason, hostile.verdict) == (HOSTILE_RAN, HOSTILE_REASON, "FAIL")
    assert not any(str(row.options.get("target", "")).startswith("/") for row in report.rows)


# --- goldens ------------------------------------------------------------------------------------------------

def test_golden_markdown(render):
    check_golden("report.md", render(DATA, "markdown"))


def test_golden_csv(render):
    check_golden("report.csv", render(DATA, "csv"))


# --- markdown -----------------------------------------------------------------------------------------------

def test_markdown_tables_are_well_formed(render):
    md = render(DATA, "markdown")
    tables = md_tables(md)
    headers = [header[:2] for header, _ in tables]
    assert ["backend", "ran"] in headers  # results
    assert ["backend", "TP"] in headers  # depth
    assert ["fact", "value"] in headers  # full environment
    assert len(tables) == 4  # and the compact environment
    for _, body in tables:
        assert body


def test_markdown_has_no_raw_html_from_the_input(render):
    md = render(DATA, "markdown")
    text = strip_code(md)
    assert "<script" not in text.lower()
    assert "<b>" not in text  # from the known-defect line
    tags = {m.group(1).lower() for m in re.finditer(r"</?([A-Za-z][A-Za-z0-9-]*)", text)}
    assert tags <= MD_ALLOWED_TAGS, tags - MD_ALLOWED_TAGS
    # Wherever the raw name still appears, it is inside code, which GitHub shows as text.
    for line in md.splitlines():
        if SCRIPT in line and not line.startswith("attn-doctor "):
            assert re.search(r"`[^`]*" + re.escape(SCRIPT) + r"[^`]*`", line), line


def test_markdown_verdict_comes_first(render):
    md = render(DATA, "markdown")
    lines = [line for line in md.splitlines() if line.strip()]
    assert lines[0] == "## attn-doctor report"
    assert lines[1].startswith("**Verdict:** Faulty: dq_two_percent")
    assert md.index("**Verdict:**") < md.index("|") and md.index("**Verdict:**") < md.index("###")


def test_markdown_known_defects_are_listed_escaped(render):
    md = render(DATA, "markdown")
    assert "**Known defects matching this machine and case:**" in md
    assert md.index("**Known defects") < md.index("### Environment")
    assert "- EXAMPLE (test fixture, not a real defect): TE 2.20.2 + cuDNN 9.14.0 on sm_90 &lt;b>bold&lt;/b> a\\|b" in md


def test_markdown_failing_rows_come_first(render, report):
    md = render(DATA, "markdown")
    header, body = md_table(md, "backend", "ran")
    verdicts = [cell_text(row[header.index("verdict")]).strip("\0") for row in body]
    assert set(verdicts) == {"PASS", "FAIL", "ERROR", "SKIP"}
    ranks = [0 if v in FAILING else 1 for v in verdicts]
    assert ranks == sorted(ranks), verdicts
    assert verdicts[-1] == "SKIP"
    assert len(body) == len([r for r in report.rows if r.coords.params().get("probe") != "depth"]) - 1  # te.flash: "all"


def test_markdown_shows_errors_in_units_of_epsilon(render, report):
    md = render(DATA, "markdown")
    header, body = md_table(md, "backend", "ran")
    column = header.index("dQ err / ε")
    layout = header.index("layout")
    for row in measured(report):
        if row.coords.params().get("probe") == "depth":
            continue
        (line,) = [cells for cells in body if cells[0] == md_escape(row.backend) and cells[layout] == row.layout]
        assert line[column] == f"{row.tensors['dq'].err_in_eps:.2f}"
    (two_percent,) = [c for c in body if c[0] == "dq_two_percent" and c[layout] == "contiguous"]
    assert two_percent[column] == "2.55"
    assert two_percent[header.index("dQ err (×base)")] == "**2.0e-2 (5.04×)**"  # the failing tensor stands out


def test_markdown_reproduces_each_failing_path(render, report):
    md = render(DATA, "markdown")
    section = md[md.index("### Reproduce"):]
    commands = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    for row in failing_rows(report):
        command = row.repro_command()
        assert command.startswith("attn-doctor ")
        assert command in commands, command
        assert f"--layout {row.layout}" in command and "--seed 1234" in command
    assert all(c.startswith("attn-doctor ") and "\n" not in c for c in commands)
    assert len(commands) == len(failing_rows(report))


def test_markdown_details_blocks(render):
    md = render(DATA, "markdown")
    assert md.count("<details>") == md.count("</details>") == 4
    assert "- te.flash (all layouts): disabled by NVTE_FLASH_ATTN=0" in md
    assert "terminate called after throwing an instance of 'std::runtime_error'" in md  # the ERROR row's detail
    assert "| env vars | CUDA_VISIBLE_DEVICES=0<br>NVTE_DEBUG=1<br>" in md


def test_markdown_hostile_cells_show_the_exact_text(render):
    md = render(DATA, "markdown")
    header, body = md_table(md, "backend", "ran")
    (row,) = [cells for cells in body if "evil" in cells[0]]
    assert cell_text(row[0]) == HOSTILE_BACKEND
    assert cell_text(row[1]) == HOSTILE_RAN


def test_markdown_table_survives_crlf_in_a_reason(render, doc, tmp_path):
    document = copy.deepcopy(doc)
    (row,) = [r for r in document["results"] if r["verdict"] == "ERROR"]
    row["reason"] = "worker died\r\nTraceback (most recent call last):"
    md = render(write_doc(tmp_path / "crlf.json", document), "markdown")
    header, body = md_table(md, "backend", "ran")
    assert len(body) == 9


def test_markdown_of_a_large_sweep_fits_githubs_limit_and_says_what_it_folded(render, doc, tmp_path):
    """400 cases' worth of the fixture's rows: the passing and skipped rows are folded into counts per
    backend, the failing rows stay whole (as many as fit, the rest counted), and the page fits GitHub's limit."""
    from attn_doctor.render.markdown import GITHUB_LIMIT, results_markdown
    from attn_doctor.results.log import load_results

    document = copy.deepcopy(doc)
    rows = document["results"]
    document["results"] = [dict(copy.deepcopy(row), case={**row["case"], "seed": seed})
                           for seed in range(400) for row in rows]
    md = render(write_doc(tmp_path / "large.json", document), "markdown")
    assert len(md) <= GITHUB_LIMIT
    header, body = md_table(md, "backend", "ran")  # still one well-formed results table
    verdicts = [cell_text(cells[-1]).strip("*\x00") for cells in body]
    assert set(verdicts) <= set(FAILING)  # failing rows only, each whole
    assert all(cells[header.index("dQ err (×base)")] for cells, v in zip(body, verdicts) if v == "FAIL")
    report = load_results(tmp_path / "large.json")[0]
    failing_table = results_markdown(report.rows, only_failing=True).count("\n") - 1
    left_out = [int(n) for n in re.findall(r"_… and (\d+) more, left out", md)]
    assert len(body) + left_out[0] == failing_table == 5 * 400  # the failing rows are the first list cut
    calls = [row for row in report.rows if row.coords.params().get("probe") != "depth"]
    folded = sum(1 for row in calls if row.verdict not in FAILING)
    assert f"_{folded} passing and skipped rows are folded into these counts" in md
    counts_header, counts = md_table(md, "backend", "PASS")
    totals = {cells[0]: [int(c) for c in cells[1:]] for cells in counts}
    for backend in {row.backend for row in calls}:
        mine = [row for row in calls if row.backend == backend]
        assert totals[md_escape(backend)] == [sum(1 for r in mine if r.verdict == v)
                                              for v in counts_header[1:]], backend


def test_markdown_of_a_small_report_leaves_nothing_out(render):
    assert "left out to fit" not in render(DATA, "markdown")


def test_markdown_escapes_hostile_environment_values(render, doc, tmp_path):
    document = copy.deepcopy(doc)
    document["env"]["env_vars"]["NVTE_HOSTILE"] = "<script>alert(1)</script> C:\\dir\\|x"
    md = render(write_doc(tmp_path / "env.json", document), "markdown")
    md_tables(md)
    assert "<script" not in strip_code(md).lower()


def test_reproduce_commands_are_shell_safe(report):
    for row in failing_rows(report):
        command = row.repro_command()
        assert shlex.join(shlex.split(command)) == command, command


def test_markdown_names_the_depth_plot_to_attach_when_it_exists(render, plot_dir):
    """A relative link breaks once the markdown is pasted, and GitHub shows no data: URI in an issue: the
    plot is named, with its path, for attaching."""
    md = render(plot_dir, "markdown")  # a run folder, as a sweep directory is given
    note = next(line for line in md.splitlines() if "depth.png" in line)
    assert note.startswith("_The plot of dQ error against depth is not embedded: attach depth.png (")
    assert md.index("### dQ against depth") < md.index(note) < md.index("### Reproduce")
    assert "![" not in md and "](depth.png)" not in md
    assert "depth.png" not in render(DATA, "markdown")  # no depth.png beside tests/data/results-fixed.json


# --- HTML ---------------------------------------------------------------------------------------------------

def test_html_parses_with_balanced_tags(render):
    page = render(DATA, "html")
    assert page.startswith("<!DOCTYPE html>")
    parser = parse_html(page)
    assert sum(1 for tag, _ in parser.starts if tag == "table") == 4
    for rows in parser.tables:
        header = rows[0]
        assert all(len(r) == len(header) for r in rows), [len(r) for r in rows]


def test_html_has_one_script_and_it_is_the_sorter(render):
    parser = parse_html(render(DATA, "html"))
    assert [tag for tag, _ in parser.starts].count("script") == 1
    (script,) = parser.scripts
    assert "table.sortable th" in script and "addEventListener" in script
    assert "alert" not in script and "evil" not in script
    sortable = [attrs for tag, attrs in parser.starts if tag == "table" and attrs.get("class") == "sortable"]
    assert len(sortable) == 2  # results and depth


def test_html_shows_hostile_strings_as_text(render):
    page = render(DATA, "html")
    parser = parse_html(page)
    text = "".join(parser.text)
    assert SCRIPT in text  # the parser saw it as text data ...
    assert "<script>alert" not in page  # ... because the page holds it escaped
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert not {tag for tag, _ in parser.starts} - {
        "html", "head", "meta", "title", "style", "body", "h1", "h2", "p", "strong", "small", "ul", "li", "code",
        "pre", "details", "summary", "table", "thead", "tbody", "tr", "th", "td", "script", "img"}
    assert not [name for _, attrs in parser.starts for name in attrs if name.startswith("on")]
    assert "<b>" not in page and "&lt;b&gt;bold&lt;/b&gt;" in page  # the known-defect line
    rows = html_table(parser, "backend", "ran")
    (hostile,) = [r for r in rows if r[0].startswith("evil")]
    assert hostile[0] == HOSTILE_BACKEND  # '&amp;' shown exactly, not as '&'
    assert hostile[1] == HOSTILE_RAN
    assert HOSTILE_REASON in text


def test_html_failing_rows_come_first(render):
    parser = parse_html(render(DATA, "html"))
    rows = html_table(parser, "backend", "ran")
    verdicts = [r[-1] for r in rows[1:]]
    ranks = [0 if v in FAILING else 1 for v in verdicts]
    assert ranks == sorted(ranks) and set(verdicts) == {"PASS", "FAIL", "ERROR", "SKIP"}
    classes = [attrs.get("class") for tag, attrs in parser.starts if tag == "tr" and attrs.get("class")]
    assert classes[:len(verdicts)] == verdicts


def test_html_is_self_contained(render, plot_dir):
    for page in (render(DATA, "html"), render(plot_dir, "html")):
        parser = parse_html(page)
        tags = {tag for tag, _ in parser.starts}
        assert not tags & {"link", "iframe", "object", "embed", "base", "frame"}
        for tag, attrs in parser.starts:
            for name in ("src", "href", "srcset", "action", "poster", "data"):
                if name in attrs:
                    assert attrs[name].startswith("data:"), (tag, name, attrs[name][:60])
        assert "@import" not in page and "url(" not in page


def test_html_inlines_the_depth_plot(render, plot_dir):
    parser = parse_html(render(plot_dir, "html"))
    images = [attrs for tag, attrs in parser.starts if tag == "img"]
    assert len(images) == 1
    src = images[0]["src"]
    assert src.startswith("data:image/png;base64,")
    assert base64.b64decode(src.split(",", 1)[1]) == tiny_png()
    assert not [t for t, _ in parse_html(render(DATA, "html")).starts if t == "img"]  # no PNG, no image


@pytest.mark.parametrize("named", ["../secret.png", "/{outside}/secret.png", "link.png"],
                         ids=["dot-dot", "absolute", "symbolic link"])
def test_html_embeds_no_file_outside_its_results_folder(render, doc, tmp_path, named):
    """Issue 44: a document naming a plot outside its folder gets nothing embedded, and the page says so."""
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(tiny_png())
    folder = tmp_path / "run"
    folder.mkdir()
    (tmp_path / "secret.png").write_bytes(tiny_png())
    (folder / "link.png").symlink_to(outside / "secret.png")
    name = named.format(outside=str(outside).strip("/"))
    (folder / "results.json").write_text(json.dumps({**doc, "artifacts": {**doc["artifacts"], "plot": name}}))
    page = render(folder, "html")
    assert not [t for t, _ in parse_html(page).starts if t == "img"]
    assert "names a plot outside its folder" in page


def test_html_shows_errors_in_units_of_epsilon(render):
    parser = parse_html(render(DATA, "html"))
    rows = html_table(parser, "backend", "ran")
    column = rows[0].index("dQ err / ε")
    (two_percent,) = [r for r in rows if r[0] == "dq_two_percent" and r[2] == "contiguous"]
    assert two_percent[column] == "2.55"


# --- CSV ----------------------------------------------------------------------------------------------------

def test_csv_one_row_per_backend_case_tensor(render, report):
    text = render(DATA, "csv")
    records = list(csv.DictReader(io.StringIO(text, newline="")))
    frame = pd.read_csv(io.StringIO(text), keep_default_na=False, dtype=str)
    assert len(frame) == len(records)
    assert list(frame.columns) == list(records[0])
    tensorless = [row for row in report.rows if not row.tensors]
    assert len(records) == sum(len(row.tensors) for row in measured(report)) + len(tensorless)
    for row in measured(report):
        for name, verdict in row.tensors.items():
            (rec,) = [r for r in records if r["backend"] == row.backend and r["layout"] == row.layout
                      and r["tensor"] == name and r["coord_layers"] == str(row.coords.params().get("layers", ""))]
            assert rec["verdict"] == verdict.verdict
            assert rec["row_verdict"] == row.verdict
            assert float(rec["rel_err"]) == pytest.approx(verdict.rel_err, rel=1e-5)
            assert rec["case_dtype"] == row.case.dtype and int(rec["case_seq"]) == row.case.seq
    (hostile_record, *_) = [r for r in records if r["backend"] == HOSTILE_BACKEND]
    assert hostile_record["ran"] == HOSTILE_RAN  # quoted, newline and all


def test_csv_skip_rows_have_an_empty_tensor(render):
    records = list(csv.DictReader(io.StringIO(render(DATA, "csv"), newline="")))
    skips = [r for r in records if r["row_verdict"] == "SKIP"]
    assert {(r["backend"], r["layout"]) for r in skips} == {("te.flash", "contiguous"), ("te.flash", "head_slice")}
    assert all(r["tensor"] == "" and r["rel_err"] == "" and r["reason"] == "disabled by NVTE_FLASH_ATTN=0"
               for r in skips)
    (error,) = [r for r in records if r["row_verdict"] == "ERROR"]
    assert error["tensor"] == "" and "SIGABRT" in error["reason"]


# --- JSON ---------------------------------------------------------------------------------------------------

def test_json_round_trips(render, doc, report):
    out = json.loads(render(DATA, "json"))
    again = RunReport.from_dict(out)
    assert again.rows == report.rows
    assert again.faulty == report.faulty
    assert again.env == report.env
    assert out == doc  # the fixed document is already normalised


# --- bad input ----------------------------------------------------------------------------------------------

def _bad_missing(tmp_path, doc):
    return [tmp_path / "nope.json"], "no results file"


def _bad_truncated(tmp_path, doc):
    text = DATA.read_text()
    path = tmp_path / "truncated.json"
    path.write_text(text[: len(text) // 2])
    return [path], "not valid JSON"


def _bad_foreign(tmp_path, doc):
    return [write_doc(tmp_path / "foreign.json", {"hello": 1})], "not an attn-doctor results document"


def _bad_empty_dir(tmp_path, doc):
    (tmp_path / "empty").mkdir()
    return [tmp_path / "empty"], "no results.json or results.jsonl"


def _bad_format(tmp_path, doc):
    return [DATA, "--format", "pdf"], "--format"


def _bad_jsonl_list(tmp_path, doc):
    (tmp_path / "list.jsonl").write_bytes(b"[1, 2]\n")
    return [tmp_path / "list.jsonl"], "list.jsonl:1: the document is [1, 2], not an object"


def _bad_jsonl_utf8(tmp_path, doc):
    (tmp_path / "bytes.jsonl").write_bytes(b"\xff\xfe garbage\n")
    return [tmp_path / "bytes.jsonl"], "bytes.jsonl:1 is not JSON"


@pytest.mark.parametrize("case", [_bad_missing, _bad_truncated, _bad_foreign, _bad_empty_dir, _bad_format,
                                  _bad_jsonl_list, _bad_jsonl_utf8],
                         ids=["missing-file", "truncated-json", "foreign-json", "dir-without-results",
                              "unknown-format", "jsonl-list", "jsonl-invalid-utf8"])
def test_bad_input_exits_2_with_one_line(case, tmp_path, doc, run_cli):
    args, needle = case(tmp_path, doc)
    result = run_cli(["report", *args])
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("attn-doctor: error: ") and needle in lines[0], lines[0]


def _damage_null_error(document):
    document["results"][0]["tensors"]["dq"]["rel_err"] = None


def _damage_depth_without_layers(document):
    next(r for r in document["results"] if r["coords"].get("probe") == "depth")["coords"].pop("layers")


@pytest.mark.parametrize("damage", [_damage_null_error, _damage_depth_without_layers],
                         ids=["null-rel-err", "depth-without-layers"])
def test_damaged_rows_exit_2(damage, doc, tmp_path, cli_runner):
    from attn_doctor.cli import cli

    document = copy.deepcopy(doc)
    damage(document)
    result = cli_runner.invoke(cli, ["report", str(write_doc(tmp_path / "damaged.json", document))])
    assert result.exit_code == 2 and "Traceback" not in result.output


# --- an interrupted sweep: results.jsonl only ---------------------------------------------------------------

def sweep_jsonl(doc) -> str:
    """The depth rows of the fixed document as a sweep streams them: one record per row, per point."""
    lines = []
    depth = [r for r in doc["results"] if r["coords"].get("probe") == "depth"]
    for layers in (1, 2):
        point = [r for r in depth if r["coords"]["layers"] == layers]
        for index, row in enumerate(point):
            record = {"point": f"depth-{layers}", **row}
            if index == len(point) - 1:
                record["point_complete"] = True
            lines.append(json.dumps(record))
    return "\n".join(lines) + "\n"


def test_interrupted_sweep_directory_renders(tmp_path, doc, render, run_cli, monkeypatch):
    sweep = tmp_path / "attn-doctor-results" / "sweep-1"
    sweep.mkdir(parents=True)
    (sweep / "results.jsonl").write_text(sweep_jsonl(doc))
    md = render(sweep, "markdown")
    assert [l for l in md.splitlines() if l.strip()][1].startswith("**Verdict:** All 4 tested paths agree")
    header, body = md_table(md, "backend", "TP")
    assert [(row[0], row[2]) for row in body] == [("local", "1"), ("local", "2"), ("sdpa.math", "1"), ("sdpa.math", "2")]
    assert "### Environment" not in md  # a stream holds no environment
    parse_html(render(sweep, "html"))
    assert len(list(csv.DictReader(io.StringIO(render(sweep, "csv"), newline="")))) == 8
    assert len(RunReport.from_dict(json.loads(render(sweep, "json"))).rows) == 4
    monkeypatch.chdir(tmp_path)  # and it is what `report` with no argument picks
    result = run_cli(["report"])
    assert result.exit_code == 0 and result.stdout == md


def test_interrupted_sweep_with_a_torn_last_line_renders(tmp_path, doc, run_cli):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    text = sweep_jsonl(doc)
    (sweep / "results.jsonl").write_text(text[: len(text) - 200])
    result = run_cli(["report", sweep])
    assert result.exit_code == 0, result.stderr
    assert len(md_table(result.stdout, "backend", "TP")[1]) == 3
