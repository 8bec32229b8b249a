"""A comparison of two captures (`attn_doctor.tracing.compare.Comparison`) on a terminal and as JSON: whether the
runs are the same model, data and settings (`attn_doctor.tracing.upstream`, printed before the table); per layer
call, how far the runs' q, k, v are apart, and for out, dQ, dK, dV the runs' distance, the part the inputs
explain and each run's error against float64 (marked "far" when it is a fault, "flash" when it is above the
other run's but what a flash-style backward makes on its inputs; neither while the runs differ upstream); then the
answer and its account in words."""

from __future__ import annotations

from typing import Any

from rich.table import Table

from attn_doctor.tracing.compare import INPUTS, Comparison, Measured


def _far(comparison: Comparison, m: Measured) -> str | None:
    """"A" or "B": the run named far from float64 on this tensor (`Comparison.far_run`), else None."""
    run = comparison.far_run(m)
    return None if run is None else "AB"[run]


def comparison_table(comparison: Comparison, title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for header in ("step", "layer", "tensor", "A vs B", "inputs' part", "A vs f64", "B vs f64", ""):
        table.add_column(header, justify="right" if header not in ("tensor", "") else "left")
    for layer in comparison.layers:
        if layer.skipped:
            table.add_row(str(layer.step), str(layer.layer), "", "", "", "", "", f"not compared: {layer.skipped}")
        if layer.inputs_apart:
            table.add_row(str(layer.step), str(layer.layer), "q,k,v", f"{layer.inputs_distance:.2g}", "", "", "", "")
        for m in layer.measured:
            far = _far(comparison, m)
            mark = (f"{far} far" if far is not None else
                    f"{'AB'[m.flash_run]} flash" if m.flash_run is not None and comparison.judges_kernels else "")
            table.add_row(str(layer.step), str(layer.layer), m.tensor, f"{m.d:.2g}", f"{m.e_in:.2g}", f"{m.e[0]:.2g}",
                          f"{m.e[1]:.2g}", mark)
    return table


def comparison_document(comparison: Comparison) -> dict[str, Any]:
    """Every layer's numbers, the answer and its account."""
    return {"answer": comparison.answer(), "account": comparison.account(), "same": comparison.same,
            "upstream": [{"topic": f.topic, "differs": f.differs, "text": f.text} for f in comparison.upstream.findings],
            "layers": [
        {"step": layer.step, "layer": layer.layer, "layer_numbers": list(layer.layer_numbers), "apis": layer.apis,
         "skipped": layer.skipped, "inputs_apart": {n: layer.inputs_apart[n] for n in INPUTS if n in layer.inputs_apart},
         "tensors": [{"tensor": m.tensor, "d": m.d, "e_in": m.e_in, "e_a": m.e[0], "e_b": m.e[1],
                      "shards_a": m.shard_e[0], "shards_b": m.shard_e[1], "floor": m.floor,
                      "flash_a": m.flash_e[0], "flash_b": m.flash_e[1],
                      "far": _far(comparison, m)}
                     for m in layer.measured]}
        for layer in comparison.layers]}
