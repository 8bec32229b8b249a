"""`attn-doctor report`: a results file, sweep folder or bisect rendered for a bug report."""

from __future__ import annotations

from pathlib import Path

import click

from attn_doctor.cli.app import EXIT_OK, RESULTS_DIR, Application
from attn_doctor.core.errors import BadInput

PASTED_FORMATS = ("issue", "markdown")  # pasted where others read them: redacted and within GitHub's limit


@click.command()
@click.argument("results", required=False, type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["markdown", "issue", "html", "csv", "json"]), default="markdown",
              show_default=True, help="issue: a GitHub issue body for NVIDIA/TransformerEngine's tracker.")
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here instead of stdout.")
@click.option("--no-redact", "keep_identity", is_flag=True,
              help="Keep home folders, hostnames, user names and secret-looking variables in the issue and markdown "
                   "formats (redacted by default).")
@click.pass_obj
def report(app: Application, results: Path | None, fmt: str, output: Path | None, keep_identity: bool) -> int:
    """Render a run's results.json, a sweep directory or a bisect's folder or document (default: the newest
    results under attn-doctor-results/) for a bug report."""
    from attn_doctor.cli import known
    from attn_doctor.render.report_data import ReportData
    from attn_doctor.results.files import check_writable, write_or_keep
    from attn_doctor.results.log import load_source

    if output is not None:
        check_writable(output, "--output")
    loaded = load_source(results if results is not None else newest_results())
    document = loaded.report
    data = ReportData(document, loaded.directory, known=known.known_defects(document), bisects=loaded.bisects,
                      source=loaded.source)
    if fmt == "markdown":
        from attn_doctor.render.markdown import report_markdown

        text = report_markdown(data)
    elif fmt == "issue":
        from attn_doctor.render.issue import report_issue

        text = report_issue(data)
    elif fmt == "html":
        from attn_doctor.render.html import report_html

        text = report_html(data)
    elif fmt == "csv":
        from attn_doctor.render.tabular import report_csv

        text = report_csv(document)
    else:
        from attn_doctor.results.report import dumps

        text = dumps(document.to_dict())
    if fmt in PASTED_FORMATS:
        from attn_doctor.render.fit import cap
        from attn_doctor.render.redact import identity_of, redact, this_machine

        text = cap(text if keep_identity else redact(text, identity_of(document.env) | this_machine()))
    if output:
        saved, why = write_or_keep(output, text)
        if why:
            return app.kept_elsewhere(why, saved)
    else:
        click.echo(text, nl=False)
    return EXIT_OK


def newest_results() -> Path:
    candidates = sorted({p.parent for p in RESULTS_DIR.glob("*/results.json*")}, key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise BadInput(f"no results under {RESULTS_DIR}/; run `attn-doctor run` first or pass a results file")
    return candidates[-1]
