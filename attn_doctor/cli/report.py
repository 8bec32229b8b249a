"""`attn-doctor report`: a results file or sweep folder rendered for a bug report."""

from __future__ import annotations

from pathlib import Path

import click

from attn_doctor.cli.app import EXIT_OK, REPORTS_DIR, Application
from attn_doctor.core.errors import BadInput


@click.command()
@click.argument("results", required=False, type=click.Path(path_type=Path))
@click.option("--format", "fmt", type=click.Choice(["markdown", "html", "csv", "json"]), default="markdown",
              show_default=True)
@click.option("--output", type=click.Path(dir_okay=False, path_type=Path), help="Write here instead of stdout.")
@click.pass_obj
def report(app: Application, results: Path | None, fmt: str, output: Path | None) -> int:
    """Render a run's results.json or a sweep directory (default: the newest under reports/) for a bug report."""
    from attn_doctor.cli import known
    from attn_doctor.render.report_data import ReportData
    from attn_doctor.results.files import check_writable, write_or_keep
    from attn_doctor.results.log import load_results

    if output is not None:
        check_writable(output, "--output")
    document, directory = load_results(results if results is not None else newest_results())
    data = ReportData(document, directory, known=known.known_defects(document))
    if fmt == "markdown":
        from attn_doctor.render.markdown import report_markdown

        text = report_markdown(data)
    elif fmt == "html":
        from attn_doctor.render.html import report_html

        text = report_html(data)
    elif fmt == "csv":
        from attn_doctor.render.tabular import report_csv

        text = report_csv(document)
    else:
        from attn_doctor.results.report import dumps

        text = dumps(document.to_dict())
    if output:
        saved, why = write_or_keep(output, text)
        if why:
            return app.kept_elsewhere(why, saved)
    else:
        click.echo(text, nl=False)
    return EXIT_OK


def newest_results() -> Path:
    candidates = sorted({p.parent for p in REPORTS_DIR.glob("*/results.json*")}, key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise BadInput("no results under reports/; run `attn-doctor run` first or pass a results file")
    return candidates[-1]
