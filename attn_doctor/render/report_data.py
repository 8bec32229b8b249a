"""What every report format shows, gathered once: the document, its plot, the known defects it matches."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from attn_doctor.core.coords import ProbeKind
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.render.env_view import fact_cell
from attn_doctor.render.format import display_rows
from attn_doctor.results.report import RunReport
from attn_doctor.results.row import Row
from attn_doctor.verdict.rule import CORE_TENSORS, TENSORS

FAILING_FIRST = {"FAIL": 0, "ERROR": 1, "PASS": 2, "SKIP": 3}


@dataclass
class ReportData:
    report: RunReport
    directory: Path  # where the document lives (the plot is beside it)
    known: list[str] = field(default_factory=list)  # descriptions of matching known defects

    @property
    def plot_name(self) -> str | None:
        name = self.report.artifacts.get("plot")
        return name if name and (self.directory / name).is_file() else None

    @property
    def failing(self) -> list[Row]:
        return [row for row in self.report.rows if row.verdict in ("FAIL", "ERROR")]

    @property
    def repro_commands(self) -> list[str]:
        """One command per distinct failing path."""
        return list(dict.fromkeys(row.repro_command() for row in self.failing))

    @property
    def skipped(self) -> list[tuple[Row, str]]:
        """Skipped rows with their layout label ("all": skipped on every layout for one reason)."""
        return [(row, layout) for row, layout in display_rows(self.report.rows) if row.verdict == "SKIP"]

    @property
    def plot_path(self) -> Path | None:
        name = self.plot_name
        return self.directory / name if name else None


def call_rows(rows: list[Row]) -> list[Row]:
    """The rows of single attention calls (layouts, TP shards): the results table; depth rows have theirs."""
    return [row for row in rows if row.coords.kind is not ProbeKind.DEPTH]


def tensor_names(rows: list[Row]) -> list[str]:
    """The tensors the rows measured (the four of every call when none did), in table order."""
    return [n for n in TENSORS if any(n in r.tensors for r in rows)] or list(CORE_TENSORS)


def dq_in_eps(row: Row) -> str:
    """dQ's error (against its terms' scale, see `attn_doctor.verdict.rule`) in units of the dtype's machine
    epsilon."""
    dq = row.tensors.get("dq")
    return f"{dq.err_in_eps:.2f}" if dq is not None else ""


def sort_rows(pairs):
    return sorted(pairs, key=lambda pair: FAILING_FIRST.get(pair[0].verdict, 9))




def compact_env(env: EnvReport) -> list[list[str]]:
    """The few facts a maintainer asks first, as (label, value) rows."""

    def fact(f) -> str:
        return fact_cell(f)[0]

    gpus = "; ".join(f"{g.name} ({g.sm}, {g.memory_total_mib} MiB)" for g in env.gpus) or (env.gpus_note or "none")
    flash = ", ".join(f"{k} {v.value}" for k, v in env.flash_attn.items() if v.value) or "not installed"
    nvte = " ".join(f"{k}={v}" for k, v in env.env_vars.items() if k.startswith(("NVTE_", "CUDNN_"))) or "none set"
    machine = [["CPU", fact(env.cpu)]] if env.cpu is not None else []
    return [
        ["GPU", gpus],
        *machine,
        ["driver", fact(env.driver)],
        ["torch", f"{fact(env.torch)}, CUDA {fact(env.torch_cuda)}"],
        ["cuDNN (torch)", fact(env.torch_cudnn)],
        ["cuDNN (TE)", fact(env.te_cudnn)],
        ["Transformer Engine", f"{fact(env.te)}; core {fact(env.te_core)}; torch ext {fact(env.te_torch)}"],
        ["flash-attn", flash],
        ["NVTE_* / CUDNN_*", nvte],
        ["Python", f"{fact(env.python)} on {fact(env.os) if env.os is not None else fact(env.platform)}"],
    ]

