"""Results from several places as one: the shards of a sweep (`sweep --shard I/N`), the same sweep on several
machines (a CI matrix over GPU kinds and TE/cuDNN versions), or both.

Rows are grouped by the machine that produced them: a fingerprint that differs in anything that can change a
kernel's numbers (GPUs, driver, torch, CUDA, cuDNN, TE, flash-attn, the cuDNN builds, the NVTE_/CUDNN_
variables) is another machine, reported on its own; the host name and the user are not part of it. Within a
machine, a probe found in two places (overlapping shards) is kept once, from the first place given.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from attn_doctor.core.errors import BadInput
from attn_doctor.machine.fingerprint import EnvReport
from attn_doctor.results.files import write_atomic, write_atomic_bytes
from attn_doctor.results.log import HEADER_FILE, RESULTS_FILE, ResultsLog, read_header, read_records
from attn_doctor.results.report import RunReport
from attn_doctor.results.row import Row

# The fingerprint's facts that decide a machine (what can change the numbers), in the order a heading names them.
MACHINE_FACTS = ("gpus", "driver", "torch", "torch_cuda", "torch_cudnn", "te", "te_core", "te_torch", "te_cudnn",
                 "flash_attn", "cudnn_builds", "env_vars")


def machine_key(env: EnvReport | None) -> str:
    """The machine a report's rows ran on, as a comparable text ("" when the document recorded none)."""
    if env is None:
        return ""
    facts = env.to_dict()
    return json.dumps({name: facts.get(name) for name in MACHINE_FACTS}, sort_keys=True, default=str)


def machine_title(env: EnvReport | None) -> str:
    """"NVIDIA H200 (sm_90), torch 2.11.0+cu130, TE 2.20.2, cuDNN 9.14.0 (TE's)": a merged report's heading."""
    if env is None:
        return "machine not recorded"
    gpus = ", ".join(dict.fromkeys(f"{g.name} ({g.sm})" for g in env.gpus)) or "no GPU"
    parts = [gpus, f"torch {env.torch.value or 'n/a'}"]
    if env.te.value:
        parts.append(f"TE {env.te.value}")
    cudnn = env.te_cudnn.value or env.torch_cudnn.value
    if cudnn:
        parts.append(f"cuDNN {cudnn.split()[0]} ({'TE' if env.te_cudnn.value else 'torch'}'s)")
    return ", ".join(parts)


def merge(reports: list[RunReport]) -> list[RunReport]:
    """One report per machine, in the order machines first appear; each with the rows of every report from that
    machine (a probe found twice kept once, the first), the backends any of them asked for, and every command."""
    groups: dict[str, list[RunReport]] = {}
    for report in reports:
        groups.setdefault(machine_key(report.env), []).append(report)
    return [_joined(group) for group in groups.values()]


def _joined(reports: list[RunReport]) -> RunReport:
    if len(reports) == 1:
        return reports[0]
    rows: dict[str, Row] = {}
    for report in reports:
        for row in report.rows:
            rows.setdefault(json.dumps(row.coords.to_dict(), sort_keys=True), row)
    requested = None
    if all(report.requested is not None for report in reports):
        requested = list(dict.fromkeys(name for report in reports for name in report.requested))
    first = reports[0]
    return dataclasses.replace(
        first, command="; ".join(dict.fromkeys(report.command for report in reports)), rows=list(rows.values()),
        requested=requested, created=max(report.created for report in reports), seconds={},
        artifacts={}, interrupted=any(report.interrupted for report in reports))


def merge_folders(directories: list[Path], into: Path) -> int:
    """Write the finished points of several sweep folders (one machine's shards) into `into` as one sweep folder
    that `sweep --resume` continues and `report` reads; the number of points. A folder of another machine, or an
    `into` that already holds a sweep, is bad input."""
    into = Path(into)
    if (into / RESULTS_FILE).exists():
        raise BadInput(f"--merge-to {into} already holds a sweep ({RESULTS_FILE}); choose a new or empty folder")
    headers = []
    for directory in directories:
        if not (Path(directory) / RESULTS_FILE).is_file():
            raise BadInput(f"{directory} is not a sweep folder (no {RESULTS_FILE}); --merge-to merges sweep folders")
        headers.append(read_header(Path(directory)))
    machines = {machine_key(EnvReport.from_dict(h["env"]) if h.get("env") else None) for h in headers}
    if len(machines) > 1:
        raise BadInput(f"--merge-to: these sweeps ran on {len(machines)} different machines; a sweep folder holds one "
                       "machine's points (report them together without --merge-to)")
    lines: dict[str, list[bytes]] = {}
    for directory in directories:
        records, _ = read_records(Path(directory) / RESULTS_FILE, "the file may be truncated or foreign",
                                  skip_blank=True)
        by_point: dict[str, list[bytes]] = {}
        for record in records:
            by_point.setdefault(record.point, []).append(record.line)
            if record.complete and record.point not in lines:
                lines[record.point] = by_point[record.point]
    into.mkdir(parents=True, exist_ok=True)
    write_atomic_bytes(ResultsLog(into).path, b"".join(line + b"\n" for point in lines.values() for line in point))
    header = {**headers[0], "command": "; ".join(dict.fromkeys(h.get("command", "") for h in headers))}
    write_atomic(into / HEADER_FILE, json.dumps(header, indent=2) + "\n")
    return len(lines)
