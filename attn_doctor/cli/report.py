"""`attn-doctor report`: a results file, sweep folder or bisect rendered for a bug report."""

from __future__ import annotations

from pathlib import Path

import click

from attn_doctor.cli.app import EXIT_OK, RESULTS_DIR, Application
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import INPUT_ANY, OUTPUT_FILE, OUTPUT_FOLDER
from attn_doctor.core.errors import BadInput

PASTED_FORMATS = ("issue", "markdown")  # pasted where others read them: redacted and within GitHub's limit


@click.command(epilog=epilog("report"))
@click.argument("results", nargs=-1, type=INPUT_ANY)
@click.option("--format", "fmt", type=click.Choice(["markdown", "issue", "html", "csv", "json"]), default="markdown",
              show_default=True, help="issue: a GitHub issue body for NVIDIA/TransformerEngine's tracker.")
@click.option("--output", type=OUTPUT_FILE, help="Write here instead of stdout.")
@click.option("--merge-to", "merge_to", type=OUTPUT_FOLDER,
              help="With several sweep folders of one machine (the shards of a sweep): also write them as one sweep "
                   "folder here, which `sweep --resume` continues and `report` reads.")
@click.option("--no-redact", "keep_identity", is_flag=True,
              help="Keep home folders, hostnames, user names and secret-looking variables in the issue and markdown "
                   "formats (redacted by default).")
@click.pass_obj
def report(app: Application, results: tuple[Path, ...], fmt: str, output: Path | None, merge_to: Path | None,
           keep_identity: bool) -> int:
    """Render a run's results.json, a sweep directory or a bisect's folder or document (default: the newest
    results under attn-doctor-results/) for a bug report. Several are merged: one report per machine (the
    shards of a sweep, or one sweep on several machines)."""
    from attn_doctor.cli import known
    from attn_doctor.render.report_data import ReportData
    from attn_doctor.results.files import write_or_keep
    from attn_doctor.results.log import load_source
    from attn_doctor.results.merge import machine_key, machine_title, merge, merge_folders

    if merge_to is not None:
        if len(results) < 2:
            raise BadInput("--merge-to merges several sweep folders: give two or more")
        points = merge_folders(list(results), merge_to)
        app.console.print(f"merged {points} points of {len(results)} folders into {merge_to} (`attn-doctor sweep "
                          f"--resume {merge_to}` with the unsharded command runs the points none of them finished)")
    loaded = [load_source(path) for path in (results or (newest_results(),))]
    machines = merge([source.report for source in loaded])
    if len(machines) > 1 and fmt == "issue":
        raise BadInput(f"these results come from {len(machines)} machines; an issue is one machine's: report "
                       "each machine's folders on their own")
    texts, advice = [], []
    for number, document in enumerate(machines, start=1):
        first = next(source for source in loaded if machine_key(source.report.env) == machine_key(document.env))
        bisects = [b for source in loaded for b in source.bisects] if len(loaded) > 1 else first.bisects
        data = ReportData(document, first.directory, known=known.known_defects(document), bisects=bisects,
                          source=first.source)
        if fmt == "issue":  # one machine (above); its advice is for the reporter's terminal, not the body
            from attn_doctor.render.issue import issue_body

            body = issue_body(data)
            text, advice = body.text, body.advice
        else:
            text = _render(data, fmt)
        if len(machines) > 1:
            text = _titled(text, fmt, f"Machine {number} of {len(machines)}: {machine_title(document.env)}")
        texts.append(text)
    text = _joined(texts, fmt)
    if fmt in PASTED_FORMATS:
        from attn_doctor.render.fit import cap
        from attn_doctor.render.redact import identity_of, redact, this_machine

        identity = this_machine()
        for source in loaded:  # every document's: a machine's rows come from several
            identity = identity | identity_of(source.report.env)
        from attn_doctor.render.issue import ISSUE_CUT_NOTE, ISSUE_LIMIT

        text = text if keep_identity else redact(text, identity)
        text = cap(text, ISSUE_LIMIT, ISSUE_CUT_NOTE) if fmt == "issue" else cap(text)
    if output:
        saved, why = write_or_keep(output, text)
        if why:
            return app.kept_elsewhere(why, saved)
    else:
        click.echo(text, nl=False)
    for label, line in advice:  # on stderr: the body on stdout stays what is pasted
        app.err_console.print(f"{label:<8} {line}", soft_wrap=True)
    return EXIT_OK


def _render(data, fmt: str) -> str:
    if fmt == "markdown":
        from attn_doctor.render.markdown import report_markdown

        return report_markdown(data)
    if fmt == "html":
        from attn_doctor.render.html import report_html

        return report_html(data)
    if fmt == "csv":
        from attn_doctor.render.tabular import report_csv

        return report_csv(data.report)
    from attn_doctor.results.report import dumps

    return dumps(data.report.to_dict())


def _titled(text: str, fmt: str, title: str) -> str:
    """One machine's part of a merged report, under its heading (csv: a first column naming it)."""
    import html

    if fmt == "markdown":
        return f"# {title}\n\n{text}"
    if fmt == "html":
        return f"<h1>{html.escape(title)}</h1>\n{text}"
    if fmt == "csv":
        lines = text.splitlines()
        quoted = '"' + title.replace('"', '""') + '"'
        return "\n".join(["machine," + lines[0], *(f"{quoted},{line}" for line in lines[1:])]) + "\n"
    return text


def _joined(texts: list[str], fmt: str) -> str:
    if len(texts) == 1:
        return texts[0]
    if fmt == "json":
        import json

        return json.dumps({"format": "attn-doctor/merged-results", "machines": [json.loads(t) for t in texts]},
                          indent=2) + "\n"
    if fmt == "csv":
        return texts[0] + "".join(t.split("\n", 1)[1] for t in texts[1:])
    return "\n".join(texts)


def newest_results() -> Path:
    candidates = sorted({p.parent for p in RESULTS_DIR.glob("*/results.json*")}, key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise BadInput(f"no results under {RESULTS_DIR}/; run `attn-doctor run` first or pass a results file")
    return candidates[-1]
