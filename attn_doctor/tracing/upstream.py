"""Were the two runs even the same model? What `compare` answers first, from what each capture recorded of the
model (`attn_doctor.tracing.model_facts`), before any attention call is compared.

Why first: two runs of one model that start from different weights, or see different data, or draw dropout
masks, do not compute the same thing, and every layer's q, k, v then differ for that reason alone. Megatron
without `--use-cpu-initialization` draws each TP shard on its own rank from its own seed (seed + 2718 + TP rank,
under the model-parallel RNG tracker), so TP=1 and TP=2 train different models; two independent tensors of equal
norm are √2 apart, and partially shared draws anywhere below that: the dQ "0.5 apart at 24 layers, 1.1 between
TE and local" of the report behind this tool is what such runs give. While the runs differ upstream, no
attention kernel is named: a kernel's error is measured against the other run's on the same inputs, and the
inputs are then not the same.

Each finding is one of three: the runs differ (`differs` True: `compare` exits 1 and names no kernel), they are
the same (False), or the fact was not recorded in a run (None: said, never blamed):

- **weights:** every parameter both runs recorded, by canonical name (`attn_doctor.tracing.weights`): the same
  when its fingerprints are within SAME, the same up to the coarser dtype's rounding when within its machine
  epsilon (one draw kept in two dtypes), else different; a parameter of another global shape (a vocabulary
  padded to another multiple) is listed, not compared;
- **data:** the token ids the model's first forward pass got, by SHA-256 (compared only at equal context-parallel
  sizes: a CP rank gets its chunk of the sequence);
- **dropout:** a run in training mode with attention or hidden dropout above 0, or a dropout module with p > 0,
  or an attention call with dropout > 0, is not repeatable: its numbers are not a function of its inputs;
- **settings:** a different softmax scale computes another function (differs); softmax in fp32 and query-key
  layer scaling change the rounding only, and are said (not differs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from attn_doctor.tracing.store import CapturedCall, read_model_facts
from attn_doctor.tracing.weights import INDEPENDENT, SAME, JoinedPrints, joined

ROUNDING_ONLY = (("softmax_in_fp32", "softmax in fp32"), ("query_key_layer_scaling", "query-key layer scaling"))


@dataclass(frozen=True)
class Finding:
    topic: str  # weights, data, dropout, settings
    differs: bool | None  # None: not recorded in a run
    text: str


@dataclass
class Upstream:
    findings: list[Finding] = field(default_factory=list)

    @property
    def differs(self) -> bool:
        return any(f.differs for f in self.findings)

    @property
    def differing(self) -> list[str]:
        return [f.topic for f in self.findings if f.differs]

    def lines(self) -> list[str]:
        return [f.text for f in self.findings]


@dataclass
class _RunFacts:
    label: str
    records: list[dict[str, Any]]
    call_dropout: float  # the largest dropout an attention call of the run was given

    @property
    def first(self) -> dict[str, Any] | None:
        """Rank 0's record (the first by rank)."""
        return self.records[0] if self.records else None

    @property
    def settings(self) -> dict[str, Any]:
        return (self.first or {}).get("settings") or {}

    def parallel(self, name: str) -> int:
        return int(((self.first or {}).get("parallel") or {}).get(name, 1))


def _call_dropout(calls: list[CapturedCall]) -> float:
    """The largest dropout probability any recorded attention call was given (SDPA's dropout_p, TE's and
    Megatron's module's attention_dropout), 0 when none."""
    largest = 0.0
    for call in calls:
        arguments = call.meta.get("arguments") or {}
        module = arguments.get("module") if isinstance(arguments.get("module"), dict) else {}
        for value in (arguments.get("dropout_p"), module.get("attention_dropout")):
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                largest = max(largest, float(value))
    return largest


def _eps(*dtypes: str) -> float:
    """The coarsest machine epsilon of the recorded dtypes ("bfloat16", ...); 0 for a dtype that is not floating."""
    kinds = [getattr(torch, d, None) for d in dtypes]
    return max((torch.finfo(k).eps for k in kinds if isinstance(k, torch.dtype) and k.is_floating_point), default=0.0)


def _distance_words(distance: float) -> str:
    if distance > INDEPENDENT:
        return f"fingerprints {distance:.2g} apart: independent draws, not rounding"
    return f"fingerprints {distance:.2g} apart: other values, not rounding"


def _weights(a: _RunFacts, b: _RunFacts) -> Finding:
    if not a.records or not b.records:
        missing = " and ".join(run.label for run in (a, b) if not run.records)
        return Finding("weights", None, f"weights: not recorded in {missing} (a capture made before attn-doctor "
                                        "recorded them, or no model module ran): not checked")
    prints_a, prints_b = joined(a.records), joined(b.records)
    common = [name for name in prints_a.prints if name in prints_b.prints]
    shapes = [name for name in common if prints_a.prints[name].shape != prints_b.prints[name].shape]
    compared = [name for name in common if name not in shapes]
    different: list[tuple[str, float]] = []
    rounding = 0
    for name in compared:
        pa, pb = prints_a.prints[name], prints_b.prints[name]
        distance = pa.distance(pb)
        if distance <= SAME:
            continue
        if distance <= _eps(pa.dtype, pb.dtype):
            rounding += 1
        else:
            different.append((name, distance))
    notes = _weight_notes(a, b, prints_a, prints_b, shapes)
    if not prints_a.prints and not prints_b.prints:
        return Finding("weights", None, f"weights: the models have no parameters to compare{notes}")
    if not compared:
        return Finding("weights", True, (f"the runs' weights share no parameter name of one shape "
                                         f"({len(prints_a.prints)} and {len(prints_b.prints)} tensors): not the "
                                         f"same model{notes}"))
    if different:
        name, distance = different[0]
        return Finding("weights", True, (
            f"the runs' weights differ: {len(different)} of {len(compared)} tensors, first {name} "
            f"({_distance_words(distance)}){_weight_cause(a, b)}{notes}"))
    within = f"; {rounding} only up to their dtypes' rounding" if rounding else ""
    return Finding("weights", False, f"same weights ({len(compared)} tensors{within}){notes}")


def _weight_notes(a: _RunFacts, b: _RunFacts, prints_a: JoinedPrints, prints_b: JoinedPrints,
                  shapes: list[str]) -> str:
    """What the weights' comparison left out, in words (parameters of one run only, of other shapes, split ones
    whose TP parts were not all recorded)."""
    notes = []
    for run, mine, other in ((a, prints_a, prints_b), (b, prints_b, prints_a)):
        only = [name for name in mine.prints if name not in other.prints]
        if only:
            notes.append(f"{len(only)} only in {run.label} (first {only[0]})")
        if mine.incomplete:
            notes.append(f"{len(mine.incomplete)} of {run.label} not compared: a TP rank's part was not recorded")
    if shapes:
        name = shapes[0]
        why = (", TP shards not marked as Megatron marks them?" if a.parallel("tp") != b.parallel("tp") else
               ", a vocabulary padded to another multiple?" if "embedding" in name or "output" in name else "")
        notes.append(f"{len(shapes)} of other shapes, not compared ({name}: {list(prints_a.prints[name].shape)} "
                     f"against {list(prints_b.prints[name].shape)}{why})")
    return "; " + "; ".join(notes) if notes else ""


def _weight_cause(a: _RunFacts, b: _RunFacts) -> str:
    """Why the weights most likely differ, and the fix."""
    megatron = all(run.settings.get("framework") == "megatron" for run in (a, b))
    if megatron:
        gpu = [run for run in (a, b) if run.settings.get("use_cpu_initialization") is False]
        tp = (a.parallel("tp"), b.parallel("tp"))
        if gpu or tp[0] != tp[1]:
            labels = " and ".join(run.label.split(" ")[0] for run in gpu)  # "A (/path)" -> "A"
            facts = ([f"TP={tp[0]} and TP={tp[1]}"] if tp[0] != tp[1] else []) + (
                [f"use_cpu_initialization off in {labels}"] if gpu else [])
            which = f" ({'; '.join(facts)})"
            return (f" — Megatron without --use-cpu-initialization draws each TP shard from its own seed{which}; "
                    "rerun with --use-cpu-initialization, or load one checkpoint in both runs")
    seeds = [run.settings.get("seeds") or {} for run in (a, b)]
    for key in ("megatron", "torch"):
        if seeds[0].get(key) is not None and seeds[1].get(key) is not None and seeds[0][key] != seeds[1][key]:
            return (f" — the runs were seeded differently ({seeds[0][key]} and {seeds[1][key]}); load one checkpoint "
                    "in both runs")
    return " — load one checkpoint in both runs (or initialise both from one seed, on the CPU)"


def _data(a: _RunFacts, b: _RunFacts) -> Finding:
    data = [(run.first or {}).get("data") for run in (a, b)]
    if not a.records or not b.records or None in data:
        missing = " and ".join(run.label for run, d in zip((a, b), data) if d is None)
        return Finding("data", None, f"data: the token ids not read in {missing} (the model's forward got none "
                                     "as a tensor): not checked")
    if a.parallel("cp") != b.parallel("cp"):
        return Finding("data", None, f"data: not compared (context parallel sizes {a.parallel('cp')} and "
                                     f"{b.parallel('cp')}: a CP rank gets its chunk of the sequence)")
    if data[0]["sha256"] == data[1]["sha256"]:
        return Finding("data", False, f"same data (the token ids of the first forward pass, {data[0]['shape']})")
    shapes = "" if data[0]["shape"] == data[1]["shape"] else f", shapes {data[0]['shape']} and {data[1]['shape']}"
    return Finding("data", True, f"the runs' data differ: the token ids of their first forward pass are not the "
                                 f"same{shapes} — feed both runs the same data (the same data path, seed and order, "
                                 "or --mock-data in both)")


def _dropout_of(run: _RunFacts) -> list[str]:
    """What draws dropout in a run, in words ([] for none)."""
    settings = run.settings
    found = []
    if settings.get("training", True):
        for key, words in (("attention_dropout", "attention dropout"), ("hidden_dropout", "hidden dropout")):
            value = settings.get(key)
            if isinstance(value, (int, float)) and value > 0:
                found.append(f"{words} {value:g}")
        modules = settings.get("dropout_modules")
        if modules and not found:
            found.append(f"{modules['count']} dropout module{'s' * (modules['count'] > 1)} (first {modules['first']}, "
                         f"p {modules['p']:g})")
    if run.call_dropout > 0 and not any(text.startswith("attention") for text in found):
        found.append(f"attention calls with dropout {run.call_dropout:g}")
    return found


def _dropout(a: _RunFacts, b: _RunFacts) -> Finding:
    drawn = [(run, _dropout_of(run)) for run in (a, b)]
    flagged = [(run, found) for run, found in drawn if found]
    if flagged:
        said = "; ".join(f"{run.label} trains with {', '.join(found)}" for run, found in flagged)
        return Finding("dropout", True, f"{said}: dropout draws random masks, so the run is not repeatable and no "
                                        "two runs compute the same numbers — set attention and hidden dropout to 0 "
                                        "for the comparison (--attention-dropout 0 --hidden-dropout 0)")
    if not a.records or not b.records:
        return Finding("dropout", False, "no attention call drew dropout (the models' settings not recorded)")
    return Finding("dropout", False, "no dropout in either run")


def _settings(a: _RunFacts, b: _RunFacts) -> Finding | None:
    if not a.records or not b.records:
        return None
    sa, sb = a.settings, b.settings
    scale = (sa.get("softmax_scale"), sb.get("softmax_scale"))
    if None not in scale and not math.isclose(*scale, rel_tol=1e-6):
        return Finding("settings", True, f"the runs' softmax scales differ ({scale[0]:g} and {scale[1]:g}): they "
                                         "compute different attention")
    rounding = [f"{words} {sa[key]} and {sb[key]}" for key, words in ROUNDING_ONLY
                if sa.get(key) is not None and sb.get(key) is not None and sa[key] != sb[key]]
    if rounding:
        return Finding("settings", False, f"settings that change the rounding only differ: {'; '.join(rounding)}")
    return None


def check_upstream(roots: tuple[Path, Path], calls: tuple[list[CapturedCall], list[CapturedCall]],
                   labels: tuple[str, str]) -> Upstream:
    """The runs' weights, data, dropout and settings compared (see the module docstring), from each capture's
    folder and its calls."""
    runs = [_RunFacts(label, read_model_facts(root), _call_dropout(run_calls))
            for label, root, run_calls in zip(labels, roots, calls)]
    findings = [_weights(*runs), _data(*runs), _dropout(*runs)]
    settings = _settings(*runs)
    return Upstream(findings + ([settings] if settings is not None else []))


__all__ = ["Finding", "Upstream", "check_upstream"]
