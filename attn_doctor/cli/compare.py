"""`attn-doctor compare A B`: two captures of one model and seed run differently, layer by layer
(`attn_doctor.tracing.compare`). Exit 0 when they are the same within rounding, 1 when a run's attention is
far from float64 where the other's is not or the runs' inputs differ from the first layer, 2 on bad input."""

from __future__ import annotations

import json
from pathlib import Path

import click

from attn_doctor.cli.app import EXIT_FAULT, EXIT_OK, Application


@click.command()
@click.argument("capture_a", type=click.Path(file_okay=False, path_type=Path))
@click.argument("capture_b", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              help="Write every layer's numbers here.")
@click.pass_obj
def compare(app: Application, capture_a: Path, capture_b: Path, json_path: Path | None) -> int:
    """Compare two captures of one model and seed layer by layer (TP=1 against TP=2, say): out, dQ, dK, dV of
    every layer both recorded with --values, TP shards and CP chunks put back together. Says "same within
    rounding" or the first layer where one run's attention is far from float64, and on which rank."""
    from rich.table import Table

    from attn_doctor.results.files import write_atomic
    from attn_doctor.tracing.compare import compare_captures

    comparison = compare_captures(capture_a, capture_b, ("A", "B"))
    table = Table(title=f"A = {capture_a}, B = {capture_b}", title_justify="left")
    for header in ("step", "layer", "tensor", "A vs B", "inputs' part", "A vs f64", "B vs f64", ""):
        table.add_column(header, justify="right" if header not in ("tensor", "") else "left")
    for layer in comparison.layers:
        if layer.skipped:
            table.add_row(str(layer.step), str(layer.layer), "", "", "", "", "", f"not compared: {layer.skipped}")
        for m in layer.measured:
            mark = "" if m.faulty_run is None else f"{'AB'[m.faulty_run]} far"
            table.add_row(str(layer.step), str(layer.layer), m.tensor, f"{m.d:.2g}", f"{m.e_in:.2g}", f"{m.e[0]:.2g}",
                          f"{m.e[1]:.2g}", mark)
    app.console.print(table)
    app.console.print(comparison.answer().replace("A is", f"A ({capture_a}) is").replace(
        "B is", f"B ({capture_b}) is"))
    if json_path is not None:
        write_atomic(json_path, json.dumps({"answer": comparison.answer(), "same": comparison.same, "layers": [
            {"step": layer.step, "layer": layer.layer, "apis": layer.apis, "skipped": layer.skipped,
             "tensors": [{"tensor": m.tensor, "d": m.d, "e_in": m.e_in, "e_a": m.e[0], "e_b": m.e[1],
                          "shards_a": m.shard_e[0], "shards_b": m.shard_e[1], "floor": m.floor,
                          "far": None if m.faulty_run is None else "AB"[m.faulty_run]} for m in layer.measured]}
            for layer in comparison.layers]}, indent=1))
    return EXIT_OK if comparison.same else EXIT_FAULT
