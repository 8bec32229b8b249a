"""The machine's fingerprint as labelled lines, in a stable order, and back: what every rendering of an
:class:`~attn_doctor.machine.fingerprint.EnvReport` lists (a table, Markdown, a repro script's header), and
how an environment kept only as that text (a repro script's header) is read again."""

from __future__ import annotations

import dataclasses
from typing import Literal

from attn_doctor.machine.fingerprint import EnvReport, Fact, GpuInfo

Kind = Literal["ok", "warn", "missing"]

_MACHINE: tuple[tuple[str, str], ...] = (  # the rows before the GPUs: (label, EnvReport field)
    ("Python", "python"),
    ("platform", "platform"),
    ("OS", "os"),
    ("CPU", "cpu"),
    ("NVIDIA driver", "driver"),
)
_FACTS: tuple[tuple[str, str], ...] = (
    ("torch", "torch"),
    ("torch CUDA", "torch_cuda"),
    ("torch cuDNN", "torch_cudnn"),
    ("CUDA available", "cuda_available"),
    ("Transformer Engine", "te"),
    ("TE core", "te_core"),
    ("TE torch", "te_torch"),
    ("TE cuDNN", "te_cudnn"),
)
_FLASH_LABELS = {"v2": "flash-attn v2", "v3": "flash-attn v3", "v4": "flash-attn v4"}
NONE_SET = "none set"


def fact_cell(fact: Fact) -> tuple[str, Kind]:
    """A fact as display text ("n/a (why)", "value (note)") and how it reads: missing, warn or ok."""
    if fact.value is None:
        return (f"n/a ({fact.note})" if fact.note else "n/a"), "missing"
    if fact.note:
        return f"{fact.value} ({fact.note})", "warn"
    return fact.value, "ok"


def labelled_facts(env: EnvReport) -> list[tuple[str, str, Kind]]:
    rows: list[tuple[str, str, Kind]] = []

    def add(label: str, fact: Fact) -> None:
        rows.append((label, *fact_cell(fact)))

    for label, name in _MACHINE:
        fact = getattr(env, name)
        if fact is not None:  # documents written before OS and CPU were collected do not have them
            add(label, fact)
    for gpu in env.gpus:
        rows.append((f"GPU {gpu.index}", f"{gpu.name}, {gpu.sm}, {gpu.memory_total_mib} MiB", "ok"))
    if not env.gpus:
        rows.append(("GPUs", f"n/a ({env.gpus_note})" if env.gpus_note else "n/a", "missing"))
    elif env.gpus_note:
        rows.append(("GPU notes", env.gpus_note, "warn"))
    for label, name in _FACTS:
        add(label, getattr(env, name))
    if env.cudnn_builds is not None:  # documents written before it was collected do not have it
        add("cuDNN builds", Fact("; ".join(build.label() for build in env.cudnn_builds) or None,
                                 env.cudnn_builds_note))
    if env.te_installs is not None:  # documents written before it was collected do not have it
        add("TE releases prepared", env.te_installs)
    for key in ("v2", "v3", "v4"):
        add(_FLASH_LABELS[key], env.flash_attn.get(key, Fact(None, "not recorded")))
    for key in sorted(set(env.flash_attn) - set(_FLASH_LABELS)):
        add(f"flash-attn {key}", env.flash_attn[key])
    env_text = "\n".join(f"{k}={v}" for k, v in env.env_vars.items())
    rows.append(("env vars", env_text or NONE_SET, "ok" if env_text else "missing"))
    return rows


def env_rows(env: EnvReport) -> list[tuple[str, str]]:
    """(label, value) pairs in a stable order; a missing value reads ``n/a (note)``.

    The "env vars" value holds one ``NAME=value`` per line.
    """
    return [(label, value) for label, value, _ in labelled_facts(env)]


def env_from_rows(rows: list[tuple[str, str]]) -> EnvReport:
    """The inverse of :func:`env_rows`, for an environment kept only as its text (a repro script's header):
    each fact's text is its value (a note cannot be told from a value that holds parentheses), ``n/a (why)``
    is a missing fact."""
    by_label = dict(_MACHINE + _FACTS)
    flash_keys = {label: key for key, label in _FLASH_LABELS.items()}
    facts: dict[str, Fact] = {}
    gpus: list[GpuInfo] = []
    gpus_note: str | None = None
    flash: dict[str, Fact] = {}
    env_vars: dict[str, str] = {}

    def fact(text: str) -> Fact:
        if text == "n/a":
            return Fact(None)
        if text.startswith("n/a (") and text.endswith(")"):
            return Fact(None, text[len("n/a ("):-1])
        return Fact(text)

    for label, text in rows:
        if label in by_label:
            facts[by_label[label]] = fact(text)
        elif label.startswith("GPU ") and label[4:].isdigit():
            name, _, rest = text.rpartition(", ")
            model, _, sm = name.rpartition(", ")
            try:
                gpus.append(GpuInfo(int(label[4:]), model, sm, int(rest.removesuffix(" MiB"))))
            except ValueError:
                gpus_note = text
        elif label in ("GPUs", "GPU notes"):
            gpus_note = fact(text).note or text
        elif label in flash_keys or label.startswith("flash-attn "):
            flash[flash_keys.get(label, label.removeprefix("flash-attn "))] = fact(text)
        elif label == "env vars" and text != NONE_SET:
            env_vars.update(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return EnvReport.from_dict({**{name: {"value": f.value, "note": f.note} for name, f in facts.items()},
                                "gpus": [dataclasses.asdict(g) for g in gpus], "gpus_note": gpus_note,
                                "flash_attn": {k: {"value": f.value, "note": f.note} for k, f in flash.items()},
                                "env_vars": env_vars})
