"""`attn-doctor compare A B`: two captures of one model and seed run differently, layer by layer
(`attn_doctor.tracing.compare`), after whether they are the same model, data and settings
(`attn_doctor.tracing.upstream`). Exit 0 when they are the same within rounding, 1 when they differ upstream
(weights, data, dropout), when a run's attention is far from float64 where the other's is not, or when the runs'
inputs differ from the first layer; 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import click

from attn_doctor.cli.app import EXIT_FAULT, EXIT_OK, Application
from attn_doctor.cli.epilogs import epilog
from attn_doctor.cli.options import INPUT_FOLDER, OUTPUT_FILE


@click.command(epilog=epilog("compare"))
@click.argument("capture_a", type=INPUT_FOLDER)
@click.argument("capture_b", type=INPUT_FOLDER)
@click.option("--json", "json_path", type=OUTPUT_FILE,
              help="Write every layer's numbers here.")
@click.pass_obj
def compare(app: Application, capture_a: Path, capture_b: Path, json_path: Path | None) -> int:
    """Compare two captures of one model and seed layer by layer (TP=1 against TP=2, say). First whether the runs
    are the same model (weights' fingerprints), data and settings (dropout, softmax scale): while they are not, no
    kernel is named. Then out, dQ, dK, dV of every layer both recorded with --values, TP shards and CP chunks put
    back together, and the q, k, v each run's attention got. Says "same within rounding" or the first layer
    where one run's attention is far from float64, and on which rank; then in words whether the runs got the
    same q, k, v, whether each run's attention is right on its own inputs, and whether their difference is what
    their inputs' explains."""
    from attn_doctor.render.compare_view import comparison_document, comparison_table
    from attn_doctor.results.files import write_atomic
    from attn_doctor.tracing.compare import compare_captures

    comparison = compare_captures(capture_a, capture_b, (f"A ({capture_a})", f"B ({capture_b})"))
    for line in comparison.upstream.lines():  # the same model, data and settings? before any kernel
        app.console.print(f"- {line}")
    table = comparison_table(comparison, f"A = {capture_a}, B = {capture_b}")
    if table.row_count:  # runs that differ upstream may have no layer both recorded: no empty table
        app.console.print(table)
    for line in comparison.account():  # the three questions, then the answer
        app.console.print(f"- {line}")
    app.console.print(comparison.answer())
    if json_path is not None:
        write_atomic(json_path, json.dumps(comparison_document(comparison), indent=1))
    return EXIT_OK if comparison.same else EXIT_FAULT
