"""What a worker keeps between jobs: the most recent case's inputs and float64 reference, and the most
recent depth stack's reference and baseline measurements (jobs arrive grouped by case). A reference is normally the
parent's, mapped from the handle the job carried (see `attn_doctor.execution.shared_reference`), else
computed here."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from attn_doctor.core.case import Case
from attn_doctor.numerics.inputs import (
    Inputs,
    make_inputs,
    release_cached_memory,
    synchronize,
)
from attn_doctor.numerics.reference import Reference, attention_reference
from attn_doctor.numerics.source import SourceOf, seeded
from attn_doctor.numerics.standalone import TORCH_DTYPES, compared_rows

# Called with a short description as a long probe advances (a depth stack's layers).
Progress = Callable[[str], None]

# The measured tensors kept per case so that a bitwise-equal one (the same kernel on another layout, most
# often) reuses their metrics instead of being compared again: at most this many bytes of them (little on a
# GPU, where comparing is cheap and memory is the case's).
MEASURED_BYTES = {"cpu": 1 << 30, "cuda": 1 << 28}


class Measured:
    """Tensors already compared with the current case's reference, and their metrics. Metrics are a function
    of the tensor's values alone (same reference, same rows), so a bitwise-equal tensor has the very same
    ones; NaN never equals itself, so a tensor holding NaN is always compared again."""

    def __init__(self, device: torch.device) -> None:
        self._kept: dict[str, list[tuple[torch.Tensor, object]]] = {}
        self._bytes = 0
        self._limit = MEASURED_BYTES.get(device.type, 0)

    def find(self, name: str, tensor: torch.Tensor):
        """The metrics of a kept tensor equal to `tensor`, or None."""
        for kept, metrics in self._kept.get(name, ()):
            if kept.shape == tensor.shape and kept.dtype == tensor.dtype and torch.equal(kept, tensor):
                return metrics
        return None

    def keep(self, name: str, tensor: torch.Tensor, metrics) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._bytes + size <= self._limit:
            self._kept.setdefault(name, []).append((tensor.clone(), metrics))
            self._bytes += size

    def clear(self) -> None:
        self._kept.clear()
        self._bytes = 0


class CaseCache:
    """Inputs and reference of the most recent case, and what a correct flash-style backward's output rounding
    makes on it (`flash_style`, computed on first request). `reference_seconds` is what getting the reference
    cost this process; `reference_source` says how ("shared" or "computed")."""

    def __init__(self, device: torch.device, source_of: SourceOf = seeded):
        self.device = device
        self.source_of = source_of
        self._key: tuple | None = None
        self._inputs: Inputs | None = None
        self._reference: Reference | None = None
        self.reference_seconds = 0.0
        self.reference_source = ""
        self.shared: tuple[torch.Tensor, ...] | None = None  # the parent's reference, mapped, if the job had one
        self.measured = Measured(device)  # the case's tensors already compared (`Measured`)
        self._flash_style: dict | None = None
        self._compared_rows: dict | None = None
        self.flash_style_seconds = 0.0

    def get(self, case: Case) -> tuple[Inputs, Reference]:
        if case.key() != self._key:
            self._inputs = self._reference = self._flash_style = self._compared_rows = None  # free the previous case
            self.measured.clear()
            inputs = make_inputs(case, self.device, self.source_of(case))
            start = time.perf_counter()
            self.reference_source = "shared" if self.shared is not None else "computed"
            if self.shared is not None:
                reference = Reference(*self.shared)
            else:
                reference = attention_reference(
                    inputs.q, inputs.k, inputs.v, inputs.dout,
                    softmax_scale=case.softmax_scale, semantics=inputs.semantics,
                )
            synchronize(self.device)
            self.reference_seconds = time.perf_counter() - start
            self._key, self._inputs, self._reference = case.key(), inputs, reference
        return self._inputs, self._reference

    def compared_rows(self, case: Case) -> dict:
        """`standalone.compared_rows` of the case, once (each test of them waits for the device)."""
        inputs, _ = self.get(case)
        if self._compared_rows is None:
            self._compared_rows = compared_rows(case.plain(), inputs.semantics.allowed, self.device)
        return self._compared_rows

    def flash_style(self, case: Case, masks: dict) -> dict:
        """`attn_doctor.numerics.rounded_output.case_figures` of the case (its compared rows `masks`), once."""
        from attn_doctor.numerics.rounded_output import case_figures

        inputs, reference = self.get(case)
        if self._flash_style is None:
            start = time.perf_counter()
            self._flash_style = case_figures(case, inputs.q, inputs.k, inputs.dout, reference, inputs.semantics, masks)
            synchronize(self.device)
            self.flash_style_seconds = time.perf_counter() - start
        return self._flash_style

    def clear(self) -> None:
        """Drop the case; a shared reference is released, so the parent can free it."""
        self._key = self._inputs = self._reference = self._flash_style = self._compared_rows = None
        self.measured.clear()


class DepthCache:
    """Per (case, layers): the float64 replica's dQ at every layer (the parent's shared copy when the job
    carries a handle, else computed here) and the local baseline's stack measured against it, computed here:
    its per-layer comparisons and its first and last layer's dQ (`attn_doctor.probes.stack.LayerErrors`)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._key: tuple | None = None
        self.reference: list[torch.Tensor] = []
        self.baseline = None  # LayerErrors of the local baseline's stack
        self.reference_seconds = 0.0
        self.reference_source = ""
        self.shared: tuple[torch.Tensor, ...] | None = None  # the parent's per-layer dQ, mapped, if any

    def get(self, case: Case, layers: int, progress: Progress | None = None):
        """(reference, baseline): the per-layer float64 dQ, and the baseline stack's `LayerErrors`."""
        from attn_doctor.backends import BASELINE, build
        from attn_doctor.probes.stack import (
            BackendAttention,
            LayerErrors,
            float64_replica_dqs,
            layer_progress,
            make_stack,
            run_stack,
        )

        key = (case.key(), layers)
        if key != self._key:
            self.clear()
            start = time.perf_counter()
            self.reference_source = "shared" if self.shared is not None else "computed"
            model_dtype = TORCH_DTYPES[case.dtype]
            if self.shared is not None:
                self.reference = list(self.shared)
            else:
                self.reference = float64_replica_dqs(case, layers, self.device, model_dtype, progress)
            synchronize(self.device)
            self.reference_seconds = time.perf_counter() - start
            baseline = LayerErrors(self.reference)
            run_stack(make_stack(case, layers, self.device, model_dtype), case, BackendAttention(build(BASELINE), case),
                      baseline, on_layer=layer_progress("baseline", layers, progress))
            self.baseline = baseline
            self._key = key
            release_cached_memory(self.device)
        return self.reference, self.baseline

    def clear(self) -> None:
        self._key = None
        self.reference = []
        self.baseline = None


class Caches:
    """Every cache of one worker process, the shared reference the current job carried, and where a case's
    numbers come from (`source_of`: seeded, or for a replayed case its capture's)."""

    def __init__(self, device: torch.device, source_of: SourceOf = seeded):
        self.device = device
        self.source_of = source_of
        self.case = CaseCache(device, source_of)
        self.depth = DepthCache(device)

    def share(self, tensors: tuple[torch.Tensor, ...] | None) -> None:
        self.case.shared = self.depth.shared = tensors

    def clear(self) -> None:
        self.case.clear()
        self.depth.clear()
