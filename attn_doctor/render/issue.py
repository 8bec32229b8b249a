"""A GitHub issue body for NVIDIA/TransformerEngine's tracker: the one fault a maintainer should look at,
said the way TE's bug-report template asks (.github/ISSUE_TEMPLATE/bug_report.md: describe the bug, steps or
code to reproduce it, expected behavior, environment overview and details, additional context).

The fault is the bisected one where a bisect was run (its minimal case and the conditions it needs), else
the worst failing row (`ReportData.fault`); every faulty path of a large run is one line at the end. The
short standalone repro is inline, folded. The body stays within ISSUE_LIMIT characters, one screen: the lists are
cut to fit (`attn_doctor.render.fit`), what they leave out is in the results file the body names, and the repro is
named to attach when it alone would not fit. The body speaks to the maintainer; what the reporter should do
(bisect first, attach files) is `IssueBody.advice`, for the reporter's terminal.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from attn_doctor.results.bisect_record import Condition
from attn_doctor.render.fit import Section
from attn_doctor.render.format import TENSOR_TITLES, ratio, sci
from attn_doctor.render.markdown import (
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
from attn_doctor.verdict.rule import FAIL

# A body a maintainer reads in one screen: the template's sections, the short repro inline, within this many
# characters (TE's tracker takes GitHub's 65,536). What does not fit is in the files the body names.
ISSUE_LIMIT = 12_000
ISSUE_SLACK = 100  # left for the redaction's replacements (the last guard, `cap`, cuts at a line beyond it)
PRIORITY = (1, 2, 3, 0)  # of the lists (right paths, known issue, code location, every fault): which keep a place
NEEDS = {2: 1}  # a list shown only beside another
NAMED_ROOM = 200  # a list's least room beyond its first item: for the note of what it left out
ISSUE_CUT_NOTE = "_… the rest is left out to keep this body one screen; the attached results file holds it all._"
NOT_ASKED = ("CPU",)  # environment rows TE's template does not ask for and no attention path depends on
DETAIL_CHARS = 3_000  # of a crash's detail (its last lines: where it died)


@dataclass(frozen=True)
class IssueBody:
    """The issue body, the files it asks the reporter to attach, and the advice for the reporter's terminal (never
    in the body: the body speaks to the maintainer)."""
    text: str
    attach: list[str]
    advice: list[tuple[str, str]]  # (label, line): a line the reporter copies, such as the bisect command


def issue_body(data: ReportData) -> IssueBody:
    """The issue body (one plain paragraph when nothing failed: no issue to file) within ISSUE_LIMIT: the fault, the short repro inline (named to attach when even it does not
    fit), the template's sections; lists cut to fit, what they leave out named in the attached results file."""
    from attn_doctor.backends import is_te_family

    fault = data.fault
    if fault is None:
        return IssueBody(no_issue(data.report), [], [])
    results = data.source.name if data.source is not None else "the results file"
    top = [f"**Title:** {escape(issue_title(fault, data.report))}", ""]
    if not is_te_family(fault.row.family):
        top += [(f"_{escape(fault.row.backend)} is not a Transformer Engine path: this report belongs with the "
                 "tracker of the library that provides it._"), ""]
    top += ["**Describe the bug**", "", summary(fault), ""]
    layer = fault.row.extra.get("layer")
    if isinstance(layer, dict) and layer.get("where"):  # a layer path's row: where in the layer (verdict/layer.py)
        top += [f"In the layer: {escape(layer['where'])}.", ""]
    top += minimal_case(fault)
    after = expected(fault)
    bottom = environment(data.report, fault.builds) + additional_context(data.report)
    sections = [right_paths_section(fault), known_section(data.known), locations_section(data.known),
                faults_section(fault)]
    # The repro comes first; the lists get what it leaves.
    present = [section for section in sections if section is not None]

    def left_out_line(dropped: list[Section]) -> list[str]:
        titles = ", ".join(section.name() for section in dropped)
        return [f"_Left out (one screen), in the attached {escape(results)}: {titles}._", ""] if dropped else []

    # Room is kept for the line naming the lists left out, at its longest (every list left out).
    fixed = sum(len(line) + 1 for line in top + after + bottom + left_out_line(present))
    steps, attach = reproduce(fault, room=ISSUE_LIMIT - ISSUE_SLACK - fixed)
    top += steps + after
    left = ISSUE_LIMIT - ISSUE_SLACK - sum(len(line) + 1 for line in top + bottom + left_out_line(present))

    def left_out(count: int) -> str:
        attach.append(results)
        return f"_… and {count} more, in the attached {escape(results)}._"

    def least(section: Section) -> int:  # its heading and first item, with room for the note when more are left
        return section.size(1) + (NAMED_ROOM if len(section.items) > 1 else 0)

    # In order of what tells a maintainer most, each list gets what it needs of what is left once the lists after
    # it that still fit have their least; a list whose least does not fit is named instead.
    kept = []
    for i in PRIORITY:
        needs = NEEDS.get(i)  # the code location is the known defect's: never without it
        if sections[i] is not None and (needs is None or needs in kept) and least(sections[i]) <= left - sum(
                least(sections[k]) for k in kept):
            kept.append(i)
    rendered = {}
    for n, i in enumerate(kept):
        budget = min(sections[i].size(), left - sum(least(sections[k]) for k in kept[n + 1:]))
        rendered[i] = sections[i].render(budget, left_out)
        left -= sum(len(line) + 1 for line in rendered[i])
    dropped = [s for i, s in enumerate(sections) if s is not None and i not in rendered]
    if dropped:
        attach.append(results)
        bottom = [*left_out_line(dropped), *bottom]
    text = "\n".join(top + [line for i in sorted(rendered) for line in rendered[i]] + bottom)
    attach = list(dict.fromkeys(attach))
    advice = [("paste:", "the title line into the issue's title field, the rest as its body; fill in the "
                         "environment overview")]
    if fault.bisect is None and fault.bisect_command is not None:
        advice += [("bisect:", f"{fault.bisect_command}  (first: the body then states the minimal case and the "
                               "conditions it needs; report the bisect's folder with --format issue)")]
    if attach:
        advice += [("attach:", ", ".join(attach) + "  (the body names them)")]
    return IssueBody(text, attach, advice)


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
    from attn_doctor.backends import is_te_family

    row = fault.row
    tensors = fault.failing_tensors
    from attn_doctor.verdict.layer import FORWARD  # out, and a layer row's forward stages

    forward = any(name in FORWARD for name in tensors)
    what = f"computes wrong {tensors_text(tensors)} ({'forward' if forward else 'backward'})" if tensors \
        else "crashes"
    when = f"on {row.case.short()}" + (f", {row.layout} q/k/v" if row.layout != "contiguous" else "")
    if fault.bisect is not None and fault.bisect.necessary:
        when = "when " + ", ".join(condition_text(c) for c in fault.bisect.necessary)
    env = report.env
    # the row's own release (`--te`) first; where other releases ran too, what they did says it ("reproduced with TE
    # 2.18.0 and 2.20.2"), as the cuDNN builds' outcome replaces the one build
    te = None if fault.builds.te_elsewhere else fault.builds.te or (env.te.value if env is not None else None)
    versions = [*([f"TE {te}"] if te else []), *fault.builds.versions(),
                *(g.name for g in env.gpus[:1] if env is not None)]
    prefix = "[PyTorch] " if is_te_family(row.family) else ""
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
    if fault.found_on is not None and fault.bisect is None:  # a bisect says so under "Minimal case"
        text += f" attn-doctor bisected it from {escape(fault.found_on.coords.describe())} down to this case."
    builds = fault.builds.sentence("It", elsewhere=False)  # named at the paragraph's start; the title says the rest
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
    return (f"{title}'s {what} is {amount(measured)} where a correct {dtype} implementation gets "
            f"{amount(worst.correct)} ({escape(worst.yardstick.split(':')[0])}): {ratio(worst.ratio)} that.")


# --- the template's sections --------------------------------------------------------------------------------

def minimal_case(fault: Fault) -> list[str]:
    lines = ["**Minimal case**", ""]
    if fault.bisect is not None:
        return lines + bisect_facts(fault.bisect)
    if fault.bisect_command is None:
        return lines + ["Not bisected: `attn-doctor bisect` follows one process, and this fault ran on several ranks.",
                        ""]
    return lines + ["Not bisected: the case is the run's own, above.", ""]


def bisect_facts(bisect) -> list[str]:
    """What a bisect found, for a maintainer: the minimal case, the conditions it needs, the confirmations run on
    them at the end, where the fault first shows, the check on a correct path (the simplifications that changed the
    failure are in the bisect document)."""
    lines = [(f"`attn-doctor bisect` shrank {escape(bisect.start.describe())} to "
              f"**{escape(bisect.minimal.describe())}**, which still fails the same way."), ""]
    if bisect.necessary:
        lines += ["Necessary conditions (simplifying any one of them removes the failure):", ""]
        lines += [f"- {escape(c.knob)}: {escape(c.clause())}" for c in bisect.necessary] + [""]
    else:
        lines += ["No condition is necessary among the knobs attn-doctor turns: it fails on the plainest case tried.",
                  ""]
    confirms = [step for step in bisect.probes if step.knob == "confirm"]
    confirmed = "; ".join(part for part in (
        "fails again" if any(step.fails for step in confirms) else "",
        "passes at " + ", ".join(step.tried for step in confirms if not step.fails)
        if any(not step.fails for step in confirms) else "") if part)
    facts = [("Confirmed at the end", confirmed), ("First wrong", bisect.diagnosis.get("first_wrong")),
             ("Checked on a correct path", bisect.diagnosis.get("minimal_case_checked"))]
    return lines + [f"- {label}: {escape(value)}." for label, value in facts if value] + [""]


def reproduce(fault: Fault, room: int) -> tuple[list[str], list[str]]:
    """The standalone repro script folded (while it fits `room`), and the attn-doctor command; the files the
    reporter is to attach."""
    lines = ["**Steps/Code to reproduce bug**", ""]
    script, name = fault.repro_script, fault.repro_name
    attach = []
    inline = [] if script is None else ["A script needing PyTorch (and TE) alone; it exits 1 while the path is wrong, "
                                        "0 once it is fixed:", "", *repro_lines(name, script)]
    if script is not None and sum(len(line) + 1 for line in inline) <= room:
        return lines + inline, attach  # the script is the check: attn-doctor's own command would only repeat it
    elif script is not None:
        lines += [f"The standalone repro script, {escape(name)} ({script.count(chr(10))} lines), is attached.", ""]
        attach.append(name)
    elif name:
        lines += [f"The standalone repro script, {escape(name)}, is attached.", ""]
        attach.append(name)
    return lines + ["With attn-doctor installed, the same check:", "", "```bash", fault.row.repro_command(), "```",
                    ""], attach


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
    lines += [(f"Errors against float64 from the same {dtype} inputs on {escape(row.coords.describe())}; a correct "
               f"{dtype} implementation's is Megatron-LM's local attention's (never below rounding noise), and "
               f"above {fault.figures[0].multiple:g}× it is wrong:"), ""]
    # One screen: the per-(batch, head) column where there is more than one slice, NaN/Inf where there are any
    slices = row.case.batch * row.case.heads > 1
    nonfinite = any(f.nan or f.inf for f in fault.figures)
    header = ["tensor", f"correct {dtype} error", "measured", "× correct",
              *(["worst (b, h): measured / baseline"] if slices else []), *(["NaN / Inf"] if nonfinite else []),
              "verdict"]
    body = []
    for f in fault.figures:
        failed = f.verdict == FAIL
        measured = sci(f.measured) + ("*" if f.scale != "relative" else "")
        body.append([TENSOR_TITLES.get(f.tensor, f.tensor), sci(f.correct),
                     f"**{measured}**" if failed else measured, f"**{ratio(f.ratio)}**" if failed else ratio(f.ratio),
                     *([f"{sci(f.worst_head)} / {sci(f.baseline_worst_head)}"] if slices else []),
                     *([f"{f.nan} / {f.inf}"] if nonfinite else []), f"**{f.verdict}**" if failed else f.verdict])
    notes = []
    if any(f.scale != "relative" for f in fault.figures):
        notes.append("*: against the scale of the terms the tensor is summed from, where the exact tensor cancels.")
    if fault.bisect is not None and fault.bisect.rebuilt:
        notes.append("This bisect predates recorded rows: the figures are those its probe notes state (n/a where they "
                     "do not); the repro prints every one.")
    return lines + [table(header, body), ""] + ([" ".join(notes), ""] if notes else [])


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
                    "The same q, k, v and output gradient (same case and seed), on the same views where the layout is:",
                    "",
                    *rows[:2]], rows[2:], [""], share=0.35, table=True)


def known_section(known: list[str]) -> Section:
    if not known:
        return Section(["**Known issue**", "", ("No entry of attn-doctor's table of known TE/cuDNN defects "
                                                "(attn_doctor/data/known_bugs.toml) matches this machine and case."),
                        ""], [], [], share=0.05)
    return Section(["**Known issue**", "", ("attn-doctor matches this machine and case to known defects (if one is "
                                            "this fault, add to that issue rather than filing a new one):"), ""],
                   [f"- {escape(line)}" for line in known], [""], share=0.15,
                   named=f"known issue ({len(known)} matching known defect{'s' if len(known) > 1 else ''})")


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
                    "The fault above is one of these; each line is one kernel path:", ""], items, [""], share=0.30)


def environment(report: RunReport, builds: RowBuilds | None = None) -> list[str]:
    """The template's environment overview (what attn-doctor cannot know is asked for) and details, with the
    builds the failing row read back (`builds`)."""
    env = report.env
    lines = ["**Environment overview**", ""]
    if env is None:
        return lines + ["Not recorded in these results: run `attn-doctor env` on the machine and paste its output.",
                        ""]
    lines += ["- Environment location: _(bare-metal, Docker image and tag, or cloud)_",
              f"- Method of Transformer Engine install: {escape(te_install(env, builds))} _(the exact command)_", "",
              "**Environment details**", ""]
    return lines + [table(["", ""], [[escape(label), escape(value)] for label, value in
                                     template_environment(env, builds) if label not in NOT_ASKED]), ""]


def additional_context(report: RunReport) -> list[str]:
    made = ", ".join(x for x in (f"attn-doctor {report.tool_version}" if report.tool_version else "", report.created)
                     if x)
    return ["**Additional context**", "", f"<sub>Found with {escape(report.command)}{' — ' + escape(made) if made else ''}</sub>", ""]
