"""What every report format shows, gathered once: the document, its plot, the known defects it matches,
the bisects of its failing rows; and what the issue format derives from them (the fault to file, its
figures, the paths that are right on the same inputs)."""

from __future__ import annotations

import math
import re
import shlex
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from attn_doctor.core.coords import ProbeKind
from attn_doctor.machine.fingerprint import EnvReport, Fact
from attn_doctor.machine.env_rows import fact_cell
from attn_doctor.render.format import display_rows
from attn_doctor.results.bisect_record import BisectRecord
from attn_doctor.results.files import inside
from attn_doctor.results.report import RunReport
from attn_doctor.results.row import Row
from attn_doctor.verdict.diagnosis import Faulty, first_wrong
from attn_doctor.verdict.rule import (
    CORE_TENSORS,
    FAIL,
    MULTIPLE,
    NOISE_YARDSTICK,
    PASS,
    TENSORS,
    TensorVerdict,
    tensor_kind,
)

FAILING_FIRST = {"FAIL": 0, "ERROR": 1, "INCONCLUSIVE": 2, "PASS": 3, "SKIP": 4}


@dataclass
class ReportData:
    report: RunReport
    directory: Path  # where the document lives (the plot is beside it)
    known: list[str] = field(default_factory=list)  # descriptions of matching known defects
    bisects: list[BisectRecord] = field(default_factory=list)  # the bisect reported, or those of its failing rows
    source: Path | None = None  # the file the document was read from

    @property
    def plot_name(self) -> str | None:
        """The plot the document names, when it is a file inside the results folder. A document names paths, and a
        page made from it is pasted into public bug reports: a path that leads out of the folder (`../`, an
        absolute path, a symbolic link) is never read (`refused_plot`)."""
        name = self.report.artifacts.get("plot")
        return name if name and inside(self.directory, name) and (self.directory / name).is_file() else None

    @property
    def refused_plot(self) -> str | None:
        """The plot path the document names when it leads out of its results folder (the report says so)."""
        name = self.report.artifacts.get("plot")
        return str(name) if name and not inside(self.directory, name) else None

    @property
    def failing(self) -> list[Row]:
        return [row for row in self.report.rows if row.verdict in ("FAIL", "ERROR")]

    @property
    def undecided(self) -> list[Row]:
        """The rows that could not be judged (INCONCLUSIVE): each says why, and which check would decide."""
        return [row for row in self.report.rows if row.verdict == "INCONCLUSIVE"]

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

    @property
    def bisect_report(self) -> BisectRecord | None:
        """The bisect when the document reported is a bisect's (its rows are the bisect's)."""
        return self.bisects[0] if self.bisects and self.source == self.bisects[0].path else None

    @cached_property
    def filed(self) -> tuple[BisectRecord | None, Row, list[Row]] | None:
        """(the bisect, the row, every row it is seen among) of the fault an issue is about (None when nothing
        failed): a bisected one first (at its minimal case), else the worst failing row (NaN/Inf, then the largest
        ratio; a crash last)."""
        failing = self.report.failing_rows
        if not failing:
            return None
        bisected = [(b, b.minimal_row or b.start_row) for b in self.bisects]
        bisected = [(b, row) for b, row in bisected if row is not None and row.verdict in (FAIL, "ERROR")]
        if bisected:
            bisect, row = max(bisected, key=lambda pair: severity(pair[1]))
        else:
            bisect, row = None, max(failing, key=severity)
        rows = self.report.rows + (bisect.rows if bisect is not None and bisect is not self.bisect_report else [])
        return bisect, row, rows

    @cached_property
    def builds(self) -> RowBuilds | None:
        """What the filed fault's row ran on, read back (`row_builds`): every format states these."""
        if self.filed is None:
            return None
        bisect, row, rows = self.filed
        return row_builds(row, rows, bisect, self.report.env)

    @property
    def builds_sentence(self) -> str:
        """The filed row's builds in one sentence ("" where nothing failed or it read back none)."""
        return self.builds.sentence(self.filed[1].backend) if self.builds is not None else ""

    @cached_property
    def fault(self) -> Fault | None:
        """The fault an issue is about (`filed`), with its figures, the paths right on its inputs and its repro."""
        if self.filed is None:
            return None
        bisect, row, rows = self.filed
        failing = self.report.failing_rows
        found_on = bisect.start_row if bisect is not None and bisect.start_row is not row else None
        right = [r for shown in (row, found_on) if shown is not None for r in right_paths(rows, shown)]
        if bisect is not None:
            repro_name, repro = bisect.repro_name, bisect.repro
        else:
            repro_name, repro = standalone_repro(row, self.report)
        covered = [shown.coords for shown in (row, found_on) if shown is not None]
        others = self.report.faulty if any(r.coords not in covered for r in failing) else []
        return Fault(row=row, found_on=found_on, bisect=bisect, figures=tensor_figures(row), right=right,
                     bisect_command=self.bisect_command(row) if bisect is None else None, repro_name=repro_name,
                     repro_script=repro, faulty_paths=others, builds=self.builds)

    def bisect_command(self, row: Row) -> str | None:
        """The `attn-doctor bisect --from` command that starts from the document's failing `row` (None where
        bisect cannot: a row of several ranks)."""
        if self.source is None or row.coords.kind is ProbeKind.DISTRIBUTED:
            return None
        index = self.report.failing_rows.index(row)
        command = f"attn-doctor bisect --from {shlex.quote(str(self.source))}"
        return command + (f" --row {index}" if index else "")


@dataclass(frozen=True)
class RowBuilds:
    """The library builds a failing row ran on, as the row read them back (never the machine's defaults, which
    another build may have replaced for that row: `--cudnn`), and how the same path went on the run's other builds:
    what the issue's title, description and environment table, and the markdown and HTML reports, state."""

    cudnn: str | None  # the cuDNN version the row ran on ("9.14.0"); None where nothing says
    flash_attn: str | None  # the FlashAttention version TE's flash path ran ("4.0.0b36"); None elsewhere
    elsewhere: str = ""  # "fails with cuDNN 9.14.0, passes with 9.19.0: fixed by 9.19.0", or ""
    # "" where the row read `cudnn` back itself (TE's rows since per-row read-back); else whose the machine's is
    # ("TE", "PyTorch"), as its fingerprint read it: what that library loads where no build was asked for
    loaded_by: str = ""
    te: str | None = None  # the TE release a `--te` row ran, read back in its worker ("2.18.0"); None: the machine's
    te_elsewhere: str = ""  # "fails with TE 2.18.0, passes with 2.20.2: fixed by 2.20.2", or ""

    def versions(self) -> list[str]:
        """For a title, after the TE release: the other releases' and builds' outcomes where there are some, else
        the row's own builds."""
        if self.elsewhere or self.te_elsewhere:
            from attn_doctor.machine.cudnn_builds import REPRODUCED

            if self.te_elsewhere.startswith(REPRODUCED) and self.elsewhere.startswith(REPRODUCED):
                return [f"{self.te_elsewhere}, {self.elsewhere.removeprefix(REPRODUCED)}"]  # "reproduced with" once
            return [text for text in (self.te_elsewhere, self.elsewhere) if text]
        return ([f"cuDNN {self.cudnn}"] if self.cudnn else []) + (
            [f"FlashAttention {self.flash_attn}"] if self.flash_attn else [])

    def sentence(self, path: str, elsewhere: bool = True) -> str:
        """One sentence for a description ("" when the row read back no build and no release); with `elsewhere`,
        what the run's other releases and builds did too (an issue's title says that already)."""
        ran = ([f"TE {self.te}"] if self.te else []) + ([f"cuDNN {self.cudnn}"] if self.cudnn else []) + (
            [f"FlashAttention {self.flash_attn}"] if self.flash_attn else [])
        if not ran:
            return ""
        how = (f"the one {self.loaded_by} loads on this machine" if self.loaded_by else
               "read back from the library in the failing call's process")
        also = "".join(f"; on this run's other {what}: {text}" for what, text in (
            ("TE releases", self.te_elsewhere), ("builds", self.elsewhere)) if text and elsewhere)
        return f"{path} ran on {' and '.join(ran)} ({how}){also}."


_FLASH_RAN = re.compile(r"FlashAttention \(version ([^)]+)\)")


def row_builds(row: Row, rows: list[Row], bisect: BisectRecord | None = None,
               env: EnvReport | None = None) -> RowBuilds:
    """What `row` ran on, read back, and how the same path went on the other cuDNN builds of `rows` (the same case
    and layout on another build's path, `te.fused@cudnn-9.19.0` beside `te.fused@cudnn-9.14.0`), or, for a bisect,
    on the builds its cuDNN knob tried. A row that read back no cuDNN (PyTorch's cuDNN kernel; a TE row of a document
    made before rows read theirs) ran on what its library loads on the machine (`env`, its fingerprint). The one
    place every format takes these facts from."""
    from attn_doctor.backends import is_te_family, without_build
    from attn_doctor.machine.cudnn_builds import builds_sentence, version_order

    cudnn = row.extra.get("cudnn")
    cudnn = str(cudnn) if isinstance(cudnn, (str, int)) and cudnn else None
    read_back, loaded_by = cudnn is not None, ""
    if cudnn is None and env is not None:  # what the library loads where no build was asked for
        loaded_by, machine = (("TE", env.te_cudnn) if is_te_family(row.family) else
                              ("PyTorch", env.torch_cudnn) if row.coords.backend.options.get("kernel") == "cudnn" else
                              ("", None))
        cudnn = machine.value.split()[0] if machine is not None and machine.value else None
    flash = _FLASH_RAN.search(row.ran or "")
    release = row.extra.get("te") if row.coords.backend.options.get("te") else None  # read back, `--te` rows only

    def across(varying: str, fixed: str, library: str) -> str:
        """How the same path went on the same case and layout on each value of `varying` ("cudnn", "te") that
        the row's `fixed` one shares: the rows' own read-back of both."""
        path = without_build(row.backend)
        outcomes: dict[str, set[str]] = {}
        for other in rows:
            seen = other.extra.get(varying)
            if (without_build(other.backend) == path and other.case.key() == row.case.key()
                    and other.layout == row.layout and other.extra.get(fixed) == row.extra.get(fixed)
                    and seen and other.verdict in (PASS, FAIL, "ERROR")):
                outcomes.setdefault("pass" if other.verdict == PASS else "fail", set()).add(str(seen))
        failing, passing = outcomes.get("fail", set()), outcomes.get("pass", set())
        return builds_sentence(sorted(failing - passing, key=version_order),
                               sorted(passing - failing, key=version_order), library=library)

    elsewhere = bisect.cudnn_sentence() if bisect is not None else ""
    if not elsewhere and read_back:
        elsewhere = across("cudnn", "te", "cuDNN")  # one release's builds
    te_elsewhere = bisect.te_sentence() if bisect is not None else ""
    if not te_elsewhere and release:
        te_elsewhere = across("te", "cudnn", "TE")  # one build's releases
    return RowBuilds(cudnn=cudnn, flash_attn=flash.group(1) if flash else None, elsewhere=elsewhere,
                     loaded_by=loaded_by if cudnn else "", te=str(release) if release else None,
                     te_elsewhere=te_elsewhere)


def severity(row: Row) -> tuple:
    """How bad a failing row is, for picking the one to file: a FAIL before a crash, NaN/Inf first, then the
    largest ratio to the yardstick."""
    failed = [t for t in row.tensors.values() if t.verdict == FAIL]
    ratios = [t.ratio for t in failed if not math.isnan(t.ratio)]
    return (row.verdict == FAIL, any(t.nan or t.inf for t in failed), max(ratios, default=0.0))


@dataclass(frozen=True)
class Figure:
    """One tensor of a failing row, as an issue states it: measured against what a correct implementation
    in the same dtype gets on the same inputs (the yardstick)."""

    tensor: str
    measured: float  # the error: relative to float64, or against the terms' scale where the tensor cancels
    correct: float  # the yardstick: the baseline's error on the same inputs, never below rounding noise
    fail_above: float
    multiple: float  # how many times `correct` a tensor may be off before it FAILs
    ratio: float  # measured over correct
    yardstick: str  # what the yardstick is
    scale: str  # "relative" or "of its terms' scale"
    worst_head: float  # the worst (batch, head) slice's relative error
    baseline_worst_head: float
    cosine: float
    nan: int
    inf: int
    verdict: str


def tensor_figures(row: Row) -> list[Figure]:
    """The figures of every tensor the row measured, in table order."""
    return [figure(name, row.tensors[name]) for name in TENSORS if name in row.tensors]


def figure(name: str, t: TensorVerdict) -> Figure:
    multiple = MULTIPLE.get(tensor_kind(name), max(MULTIPLE.values()))
    measured = t.shown_err
    return Figure(
        tensor=name, measured=measured, correct=t.threshold / multiple, fail_above=t.threshold, multiple=multiple,
        ratio=t.ratio,
        yardstick="rounding noise: the baseline's own error is below it" if t.yardstick_kind == NOISE_YARDSTICK
        else "the local baseline's error on them", scale="of its terms' scale" if t.cancelled else "relative",
        worst_head=t.worst_head_rel_err, baseline_worst_head=t.baseline_worst_head_rel_err, cosine=t.cosine,
        nan=t.nan, inf=t.inf, verdict=t.verdict)


@dataclass(frozen=True)
class Fault:
    """The fault an issue is filed for, with what separates it from a correct implementation."""

    row: Row  # the failing row (a bisect's minimal case where one was run)
    found_on: Row | None  # the row the bisect started from, when it shrank the case
    bisect: BisectRecord | None
    figures: list[Figure]
    right: list[Row]  # rows that pass on the same inputs: other paths, and this path on other layouts
    bisect_command: str | None  # how to bisect it when no bisect was run
    repro_name: str = ""  # the standalone repro script's file name ("" where there is none)
    repro_script: str | None = None  # its text (None: a depth stack or ranks, or a bisect's script not found)
    # Every faulty path of the run, when it has failing rows besides this one and the one a bisect started from.
    faulty_paths: list[Faulty] = field(default_factory=list)
    builds: RowBuilds = RowBuilds(None, None)  # what the row ran on (`row_builds`)

    @property
    def right_elsewhere(self) -> tuple[list[str], list[str]]:
        """On the fault's own inputs: the other paths that are right, and the layouts this path is right on."""
        same = [r for r in self.right if r.case.key() == self.row.case.key()]
        others = list(dict.fromkeys(r.backend for r in same if r.backend != self.row.backend))
        return others, list(dict.fromkeys(r.layout for r in same if r.backend == self.row.backend))

    @property
    def failing_tensors(self) -> list[str]:
        return self.row.failing_tensors

    @property
    def first_wrong(self) -> str:
        """Forward or backward: what the bisect diagnosed, else what the failing tensors say."""
        if self.bisect is not None and self.bisect.diagnosis.get("first_wrong"):
            return str(self.bisect.diagnosis["first_wrong"])
        if self.failing_tensors and isinstance(self.row.extra.get("layer"), dict):  # a layer path's row
            from attn_doctor.verdict.layer import first_wrong as first_wrong_in_layer

            return first_wrong_in_layer(self.failing_tensors)
        return first_wrong(self.failing_tensors) if self.failing_tensors else "the call itself (it crashed)"

    @property
    def worst(self) -> Figure | None:
        """The failing tensor that fails worst (NaN/Inf first, then by ratio)."""
        failed = [f for f in self.figures if f.verdict == FAIL]
        return max(failed, key=lambda f: (bool(f.nan or f.inf), -math.inf if math.isnan(f.ratio) else f.ratio),
                   default=None)


def standalone_repro(row: Row, report: RunReport) -> tuple[str, str | None]:
    """(file name, text) of the standalone repro script of a failing row, as `bisect` writes one for its
    minimal case; ("", None) for a row no script reproduces alone (a depth stack, ranks)."""
    from attn_doctor.bisect.repro import repro_name, repro_text

    try:
        text = repro_text(row.coords, report.env, report.tool_version or "", report.command)
    except ValueError:
        return "", None
    return repro_name(row.coords), text


def right_paths(rows: list[Row], faulty: Row) -> list[Row]:
    """The rows that pass on the faulty row's inputs (same case, against the same reference) and tell something
    about it: the other paths on its very views (its layout), the faulty path itself on other layouts, and the
    baseline (the yardstick) — in that order."""
    from attn_doctor.backends import BASELINE, is_layer_path

    same_inputs = faulty.coords.baseline_key()
    if is_layer_path(faulty.coords.backend):
        return []  # a layer path's attention ran on its own layer's q, k, v: no other row had those inputs

    def telling(row: Row) -> int | None:
        if (row.verdict != PASS or row.coords.baseline_key() != same_inputs or row.coords == faulty.coords
                or is_layer_path(row.coords.backend)):
            return None
        if row.layout == faulty.layout:
            return 0
        if row.backend == faulty.backend:
            return 1
        return 2 if row.coords.is_baseline(BASELINE) else None

    ranked = [(rank, row) for row in rows if (rank := telling(row)) is not None]
    return [row for _, row in sorted(ranked, key=lambda pair: pair[0])]


_SOURCE_LINK = re.compile(r"https?://\S+/(?:blob|tree)/\S+?(?=[\s),;]|$)")
_SOURCE_PATH = re.compile(r"(?<![\w/.-])(?:transformer_engine|megatron|flash_attn|torch)/[\w/.-]+?\.(?:py|cpp|cu|cuh|h)"
                          r"(?:(?::|#L)\d+(?:-L?\d+)?)?(?![\w.])")


def code_locations(lines: list[str]) -> list[str]:
    """The source locations known-defect lines name (links into a repository's files, or file paths)."""
    found = [m.group(0) for line in lines for pattern in (_SOURCE_LINK, _SOURCE_PATH) for m in pattern.finditer(line)]
    return list(dict.fromkeys(found))


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




def fact(f: Fact | None) -> str:
    return fact_cell(f)[0] if f is not None else "not recorded"


def gpu_text(env: EnvReport) -> str:
    return "; ".join(f"{g.name} ({g.sm}, {g.memory_total_mib} MiB)" for g in env.gpus) or (env.gpus_note or "none")


def flash_text(env: EnvReport) -> str:
    return ", ".join(f"{k} {v.value}" for k, v in env.flash_attn.items() if v.value) or "not installed"


def nvte_text(env: EnvReport) -> str:
    return " ".join(f"{k}={v}" for k, v in env.env_vars.items() if k.startswith(("NVTE_", "CUDNN_"))) or "none set"


def compact_env(env: EnvReport) -> list[list[str]]:
    """The few facts a maintainer asks first, as (label, value) rows."""
    machine = [["CPU", fact(env.cpu)]] if env.cpu is not None else []
    return [
        ["GPU", gpu_text(env)],
        *machine,
        ["driver", fact(env.driver)],
        ["torch", f"{fact(env.torch)}, CUDA {fact(env.torch_cuda)}"],
        ["cuDNN (torch)", fact(env.torch_cudnn)],
        ["cuDNN (TE)", fact(env.te_cudnn)],
        ["Transformer Engine", f"{fact(env.te)}; core {fact(env.te_core)}; torch ext {fact(env.te_torch)}"],
        ["flash-attn", flash_text(env)],
        ["NVTE_* / CUDNN_*", nvte_text(env)],
        ["Python", f"{fact(env.python)} on {fact(env.os) if env.os is not None else fact(env.platform)}"],
    ]


def template_environment(env: EnvReport, builds: RowBuilds | None = None) -> list[tuple[str, str]]:
    """The facts TE's bug-report template asks for (.github/ISSUE_TEMPLATE/bug_report.md: OS, PyTorch,
    Python, Transformer Engine, CUDA and cuDNN versions, GPU model), and what else decides the kernel path. With a
    failing row's `builds`, the cuDNN and flash-attn versions are the ones that row read back."""
    operating_system = fact(env.os) if env.os is not None else fact(env.platform)
    cudnn = f"{fact(env.te_cudnn)} loaded by TE; {fact(env.torch_cudnn)} PyTorch's"
    if builds is not None and builds.cudnn and not builds.loaded_by:
        default = (env.te_cudnn.value or "").split(" ")[0]
        te_default = f"{fact(env.te_cudnn)} loaded by TE, " if env.te_cudnn.value else ""  # a bisect does not probe it
        cudnn = (f"{cudnn}; the failing call ran on {builds.cudnn} (read back)" if builds.cudnn == default else
                 f"{builds.cudnn}, loaded by TE for the failing call (read back); the machine's: {te_default}"
                 f"{fact(env.torch_cudnn)} PyTorch's")
        cudnn += f"; {builds.elsewhere}" if builds.elsewhere else ""
    te = f"{fact(env.te)} (core {fact(env.te_core)}; PyTorch extension {fact(env.te_torch)})"
    if builds is not None and builds.te:  # a `--te` row: the release it ran, as its worker read it back
        te = (f"{builds.te} for the failing call (read back); installed: {fact(env.te)}"
              if builds.te != env.te.value else f"{te}; the failing call ran it (read back)")
    flash = flash_text(env)
    if builds is not None and builds.flash_attn:
        flash = f"{builds.flash_attn}, run by TE for the failing call (read back); installed: {flash}"
    return [
        ("GPU model", gpu_text(env)),
        ("NVIDIA driver", fact(env.driver)),
        ("CUDA version", f"{fact(env.torch_cuda)} (PyTorch's build)"),
        ("cuDNN version", cudnn),
        ("Transformer Engine version", te),
        ("PyTorch version", fact(env.torch)),
        ("Python version", fact(env.python)),
        ("OS version", f"{operating_system} ({fact(env.platform)})" if env.os is not None else operating_system),
        ("CPU", fact(env.cpu)),
        ("flash-attn", flash),
        ("NVTE_* / CUDNN_* variables", nvte_text(env)),
    ]


def te_install(env: EnvReport, builds: RowBuilds | None = None) -> str:
    """What attn-doctor knows of how TE was installed: the distribution that provides its core; for a row on a
    prepared release (`--te`), that release too."""
    installed = f"{fact(env.te_core)} is installed" if env.te_core.value else fact(env.te_core)
    if builds is not None and builds.te and builds.te != env.te.value:
        return f"`attn-doctor te add {builds.te}` beside {installed}"
    return installed

