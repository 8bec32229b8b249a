"""A GitHub issue body for NVIDIA/TransformerEngine's tracker: the one fault a maintainer should look at,
said the way TE's bug-report template asks (.github/ISSUE_TEMPLATE/bug_report.md: describe the bug, steps or
code to reproduce it, expected behavior, environment overview and details, additional context).

The fault is the bisected one where a bisect was run (its minimal case and the conditions it needs), else
the worst failing row (`ReportData.fault`); every faulty path of a large run is one line at the end. The
standalone repro is inline, folded. The body stays under GitHub's 65,536 characters: the lists are cut to
fit (`attn_doctor.render.fit`), and the repro is left to attach when it alone would not fit.
"""

from __future__ import annotations

import math
import re

from attn_doctor.results.bisect_record import Condition
from attn_doctor.render.fit import GITHUB_LIMIT, SLACK, Section, fit_sections
from attn_doctor.render.format import TENSOR_TITLES, ratio, sci
from attn_doctor.render.markdown import (
    bisect_lines,
    detail_lines,
    escape,
    repro_lines,
    table,
    tensor_text,
)
from attn_doctor.render.report_data import (
    Fault,
    Figure,
    ReportData,
    RowBuilds,
    code_locations,
    te_install,
    template_environment,
    tensor_names,
)
from attn_doctor.results.report import RunReport
from attn_doctor.results.row import Row
from attn_doctor.verdict.rule import FAIL, rule_sentence

# The repro is inlined while the rest of the body keeps what its lists need, or at least this much room for them
# (cut to fit what is left): 4,500 keeps a TE path's repro of a flash-style case (55,000 characters) inline.
LIST_ROOM = 4_500
DETAIL_CHARS = 3_000  # of a crash's detail (its last lines: where it died)


def report_issue(data: ReportData) -> str:
    """The issue body, or one plain paragraph when nothing failed (no issue to file)."""
    fault = data.fault
    if fault is None:
        return no_issue(data.report)
    top = [f"**Title:** {escape(issue_title(fault, data.report))}", "",
           ("<!-- Made by attn-doctor: paste the title above into the title field and the rest as the body; "
            "fill in the environment overview. -->"), ""]
    if fault.row.family != "te":
        top += [(f"_{escape(fault.row.backend)} is not a Transformer Engine path: this report belongs with the "
                 "tracker of the library that provides it._"), ""]
    top += ["**Describe the bug**", "", summary(fault), ""]
    top += minimal_case(fault)
    after = expected(fault)
    bottom = environment(data.report, fault.builds) + additional_context(data.report)
    sections = [right_paths_section(fault), known_section(data.known), locations_section(data.known),
                faults_section(fault)]
    shown = [s for s in sections if s is not None]
    lists = min(LIST_ROOM, sum(s.size() for s in shown))  # what the lists need, up to their reserved room
    fixed = sum(len(line) + 1 for line in top + after + bottom)
    top += reproduce(fault, room=GITHUB_LIMIT - SLACK - lists - fixed)
    top += after
    fitted = fit_sections(sum(len(line) + 1 for line in top + bottom), shown)
    return "\n".join(top + [line for lines in fitted for line in lines] + bottom)


def no_issue(report: RunReport) -> str:
    if report.untested is not None:
        return f"No issue to file: {report.untested}.\n"
    if any(row.verdict == "INCONCLUSIVE" for row in report.rows):
        return f"No issue to file yet: no path was found wrong, and some could not be judged. {report.summary}\n"
    return f"No issue to file: no tested path computes anything wrong here. {report.summary}\n"


# --- words ----------------------------------------------------------------------------------------------------

def path_name(row: Row) -> str:
    """What ran, as its library names it (the TE backend and sub-backend), else attn-doctor's name."""
    return row.ran.split(";")[0].strip() or row.backend


def tensors_text(names: list[str]) -> str:
    titles = [TENSOR_TITLES.get(n, n) for n in names]
    return ", ".join(titles[:-1]) + f" and {titles[-1]}" if len(titles) > 1 else "".join(titles)


def amount(value: float) -> str:
    """An error as a sentence writes it: 3 significant digits between 1e-3 and 1e3, else scientific."""
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.3g}" if 1e-3 <= abs(value) < 1e3 else sci(value)


def condition_text(condition: Condition) -> str:
    """A necessary condition in a few words: "layout transposed", "seq ≥ 2" (an integer knob that passes
    just below its failing value), a relation as it is: "seq > seq_kv"."""
    if condition.relation:
        return condition.relation
    failing, passing = condition.failing_value, str(condition.passing_value)
    below = re.fullmatch(r"\d+", passing)
    if isinstance(failing, int) and below and int(passing) < failing:
        return f"{condition.knob} ≥ {failing}"
    return f"{condition.knob} {failing}"


def issue_title(fault: Fault, report: RunReport) -> str:
    """What is wrong, where, when (the bisect's conditions, else the case) and on what (TE, cuDNN, GPU)."""
    row = fault.row
    tensors = fault.failing_tensors
    what = f"computes wrong {tensors_text(tensors)} ({'forward' if 'out' in tensors else 'backward'})" if tensors \
        else "crashes"
    when = f"on {row.case.short()}" + (f", {row.layout} q/k/v" if row.layout != "contiguous" else "")
    if fault.bisect is not None and fault.bisect.necessary:
        when = "when " + ", ".join(condition_text(c) for c in fault.bisect.necessary)
    env = report.env
    versions = [*([f"TE {env.te.value}"] if env is not None and env.te.value else []), *fault.builds.versions(),
                *(g.name for g in env.gpus[:1] if env is not None)]
    prefix = "[PyTorch] " if row.family == "te" else ""
    return f"{prefix}{path_name(row)} {what} {when}" + (f" ({', '.join(versions)})" if versions else "")


def summary(fault: Fault) -> str:
    """One paragraph: what is wrong, where (forward or backward), by how much against a correct
    implementation in the same dtype, and what is right on the same inputs."""
    row = fault.row
    name = escape(row.backend) + (f" — {escape(path_name(row))} —" if path_name(row) != row.backend else "")
    views = f" with q, k, v in the {escape(row.layout)} layout" if row.layout != "contiguous" else ""
    if fault.failing_tensors:
        text = (f"{name} computes a wrong {escape(tensors_text(fault.failing_tensors))} on "
                f"{escape(row.case.short())}{views}; the fault is in the {escape(fault.first_wrong)}.")
        if fault.worst is not None:
            text += " " + worst_sentence(fault.worst, row.case.dtype)
    else:
        text = f"{name} fails on {escape(row.case.short())}{views}: {escape(row.reason or row.verdict)}."
    others, layouts = fault.right_elsewhere
    on_layouts = f"on the {escape(', '.join(layouts))} layout{'s' if len(layouts) > 1 else ''}"
    if others:
        text += f" On the same inputs {escape(', '.join(others))} {'is' if len(others) == 1 else 'are'} right"
        text += f", and so is {escape(row.backend)} itself {on_layouts}." if layouts else "."
    elif layouts:
        text += f" On the same inputs {escape(row.backend)} itself is right {on_layouts}."
    if fault.found_on is not None:
        text += f" attn-doctor bisected it from {escape(fault.found_on.coords.describe())} down to this case."
    builds = fault.builds.sentence(path_name(row))
    return f"{text} {escape(builds)}" if builds else text


def worst_sentence(worst: Figure, dtype: str) -> str:
    title = TENSOR_TITLES.get(worst.tensor, worst.tensor)
    if worst.nan or worst.inf:
        return f"{title} holds {worst.nan} NaN and {worst.inf} Inf where float64 has none."
    if math.isnan(worst.measured):  # an old bisect's note that states the worst head's error alone
        what, measured = "worst (batch, head) slice's error", worst.worst_head
    else:
        what = "relative error" if worst.scale == "relative" else "error against its terms' scale"
        measured = worst.measured
    return (f"Against float64 computed from the same {dtype} inputs, {title}'s {what} is {amount(measured)} where a "
            f"correct {dtype} implementation gets {amount(worst.correct)} ({escape(worst.yardstick)}): "
            f"{ratio(worst.ratio)} that, where attn-doctor calls a tensor wrong above {worst.multiple:g}×.")


# --- the template's sections --------------------------------------------------------------------------------

def minimal_case(fault: Fault) -> list[str]:
    lines = ["**Minimal case**", ""]
    if fault.bisect is not None:
        return lines + bisect_lines(fault.bisect)
    if fault.bisect_command is None:
        return lines + ["Not bisected: `attn-doctor bisect` follows one process, and this fault ran on several ranks.",
                        ""]
    return lines + [("Not bisected yet. This command shrinks the case to the smallest one that still fails, names "
                     "the conditions it needs and writes a standalone repro; then report its folder with "
                     "`attn-doctor report FOLDER --format issue`:"), "", "```bash", fault.bisect_command, "```", ""]


def reproduce(fault: Fault, room: int) -> list[str]:
    """The standalone repro script folded (while it fits `room`), and the attn-doctor command."""
    lines = ["**Steps/Code to reproduce bug**", ""]
    script, name = fault.repro_script, fault.repro_name
    if script is not None and len(script) + 200 <= room:
        lines += [("A standalone script (PyTorch, and TE for a TE path; no attn-doctor): it rebuilds the inputs "
                   "from the seed and the same views, runs the path, compares it with float64 and Megatron's local "
                   "attention, and exits 1 while the path is wrong, 0 once it is fixed."), "",
                  *repro_lines(name, script)]
    elif script is not None:
        lines += [(f"The standalone repro script is too long to inline here ({len(script):,} characters): attach "
                   f"{escape(name)} to the issue."), ""]
    elif name:
        lines += [(f"The bisect's standalone repro script, {escape(name)}, was not found beside its document: attach "
                   "it from where the bisect wrote it."), ""]
    return lines + ["With attn-doctor installed, the same check:", "", "```bash", fault.row.repro_command(), "```", ""]


def expected(fault: Fault) -> list[str]:
    """Expected against measured, per tensor; for a crash, what it said."""
    row = fault.row
    dtype = row.case.dtype
    lines = ["**Expected behavior**", ""]
    if not fault.figures:
        lines += [f"The call returns its output and gradients; instead: {escape(row.reason or row.verdict)}.", ""]
        if row.detail:
            lines += ["<details><summary>Error details</summary>", "", *detail_lines(row.detail[-DETAIL_CHARS:]),
                      "</details>", ""]
        return lines
    lines += [(f"The output and the gradients agree with float64 (computed from the same {dtype} inputs) as closely "
               f"as a correct {dtype} implementation does on them: Megatron-LM's local attention, never credited "
               f"with less than rounding noise. Measured on {escape(row.coords.describe())}:"), ""]
    header = ["tensor", f"correct {dtype} error", "FAIL above", "measured", "× correct",
              "worst (b, h): measured / baseline", "cosine", "NaN / Inf", "verdict"]
    body = []
    for f in fault.figures:
        failed = f.verdict == FAIL
        measured = sci(f.measured) + ("*" if f.scale != "relative" else "")
        body.append([TENSOR_TITLES.get(f.tensor, f.tensor), sci(f.correct), sci(f.fail_above),
                     f"**{measured}**" if failed else measured, f"**{ratio(f.ratio)}**" if failed else ratio(f.ratio),
                     f"{sci(f.worst_head)} / {sci(f.baseline_worst_head)}", cosine_text(f.cosine),
                     f"{f.nan} / {f.inf}", f"**{f.verdict}**" if failed else f.verdict])
    note = ("Errors are relative L2 errors against float64 (*: against the scale of the terms the tensor is summed "
            "from, where the exact tensor cancels).")
    if fault.bisect is not None and fault.bisect.rebuilt:
        note += (" This bisect predates recorded rows: the figures are those its probe notes state (n/a where they do "
                 "not); the repro prints every one.")
    return lines + [table(header, body), "", note, ""]


def cosine_text(value: float) -> str:
    return "n/a" if value is None or math.isnan(value) else f"{value:.4f}"


def right_paths_section(fault: Fault) -> Section | None:
    if not fault.right:
        return None
    names = tensor_names([fault.row, *fault.right])
    header = ["path", "ran", "layout", "case"] + [f"{TENSOR_TITLES[n]} err (×correct)" for n in names]
    rows = table(header, [[escape(r.backend), escape(path_name(r)), escape(r.layout), escape(r.case.short())]
                          + [tensor_text(r, n) for n in names] for r in fault.right]).split("\n")
    return Section(["**Paths that are right on the same inputs**", "",
                    ("The same q, k, v and output gradient (same case and seed), on the same views where the layout "
                     "is the same: a path that passes here rules out the inputs, and a TE path that fails where "
                     "PyTorch's cuDNN path (sdpa.cudnn) passes points at TE's own code rather than cuDNN."), "",
                    *rows[:2]], rows[2:], [""], share=0.35, table=True)


def known_section(known: list[str]) -> Section:
    if not known:
        return Section(["**Known issue**", "", ("No entry of attn-doctor's table of known TE/cuDNN defects "
                                                "(attn_doctor/data/known_bugs.toml) matches this machine and case."),
                        ""], [], [], share=0.05)
    return Section(["**Known issue**", "", ("attn-doctor matches this machine and case to known defects (if one is "
                                            "this fault, add to that issue rather than filing a new one):"), ""],
                   [f"- {escape(line)}" for line in known], [""], share=0.15)


def locations_section(known: list[str]) -> Section | None:
    found = code_locations(known)
    if not found:
        return None
    return Section(["**Suspected code location**", "", "Named by the matching known-defect entry:", ""],
                   [f"- {escape(location)}" for location in found], [""], share=0.05)


def faults_section(fault: Fault) -> Section | None:
    """One line per faulty path of the run (the fault above among them)."""
    if not fault.faulty_paths:
        return None
    items = []
    for f in fault.faulty_paths:
        what = f"wrong {', '.join(TENSOR_TITLES.get(t, t) for t in f.tensors)}" if f.tensors else "crashed or hung"
        ran = f" ({escape(f.ran)})" if f.ran and f.ran != f.backend else ""
        cases = ", ".join(f.cases[:3]) + (f" and {len(f.cases) - 3} more" if len(f.cases) > 3 else "")
        worst = "" if math.isnan(f.worst_ratio) else f", up to {ratio(f.worst_ratio)} its yardstick"
        items.append(f"- {escape(f.backend)}{ran}: {what} on layout {escape(', '.join(f.layouts))}; {len(f.cases)} "
                     f"case{'s' if len(f.cases) != 1 else ''} ({escape(cases)}){worst}")
    return Section(["**Every fault in this run**", "",
                    ("The fault above is one of these; each line is one kernel path (`attn-doctor report RESULTS "
                     "--format html` shows every row):"), ""], items, [""], share=0.30)


def environment(report: RunReport, builds: RowBuilds | None = None) -> list[str]:
    """The template's environment overview (what attn-doctor cannot know is asked for) and details, with the
    builds the failing row read back (`builds`)."""
    env = report.env
    lines = ["**Environment overview**", ""]
    if env is None:
        return lines + ["Not recorded in these results: run `attn-doctor env` on the machine and paste its output.",
                        ""]
    lines += ["- Environment location: not recorded by attn-doctor; state bare-metal, Docker (image and tag) or cloud.",
              (f"- Method of Transformer Engine install: {escape(te_install(env))}; state the exact command (pip, or "
               "a source build)."), "", "**Environment details**", ""]
    return lines + [table(["", ""], [[escape(label), escape(value)]
                                     for label, value in template_environment(env, builds)]), ""]


def additional_context(report: RunReport) -> list[str]:
    made = ", ".join(x for x in (f"attn-doctor {report.tool_version}" if report.tool_version else "", report.created)
                     if x)
    return ["**Additional context**", "",
            ("How the verdict is reached: the reference is float64, computed from the very low-precision inputs the "
             f"path received; the yardstick is Megatron-LM's local attention on the same inputs. {rule_sentence()}"),
            "", f"<sub>Found with {escape(report.command)}{' — ' + escape(made) if made else ''}</sub>", ""]
