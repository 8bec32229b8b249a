"""The depth plot: dQ error (first layer) against depth, one line per backend, the local baseline dashed."""

from __future__ import annotations

from pathlib import Path

from attn_doctor.backends import BASELINE
from attn_doctor.verdict.depth import DepthLine


def plot_depth(lines: list[DepthLine], path: Path) -> Path | None:
    """dQ error (first layer) against depth, one line per backend, the local baseline dashed."""
    if not lines or len({line.layers for line in lines}) < 1:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    series: dict[str, list[DepthLine]] = {}
    for line in lines:
        label = line.backend + (f" TP={line.tp}" if line.tp > 1 else "")
        series.setdefault(label, []).append(line)
    for label, group in sorted(series.items()):
        group.sort(key=lambda line: line.layers)
        style = {"linestyle": "--", "color": "black", "linewidth": 2} if label == BASELINE.name else {"marker": "o"}
        ax.plot([g.layers for g in group], [g.dq_first for g in group], label=label, **style)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("layers")
    ax.set_ylabel("dQ relative error vs float64 (layer 1)")
    ax.set_title("dQ error against depth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
