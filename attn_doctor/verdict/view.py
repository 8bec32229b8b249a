"""What the verdict reads and writes of a results row (`attn_doctor.results.row.Row` is one): the verdict
judges rows without depending on how the results are stored."""

from __future__ import annotations

from typing import Any, Protocol

from attn_doctor.core.case import Case
from attn_doctor.core.coords import Coords
from attn_doctor.numerics.metrics import TensorMetrics
from attn_doctor.verdict.rule import TensorVerdict


class RowView(Protocol):
    coords: Coords
    verdict: str
    reason: str
    ran: str
    metrics: dict[str, TensorMetrics]
    flash_style: dict[str, TensorMetrics]  # the baseline's row: a correct flash-style backward's own part
    tensors: dict[str, TensorVerdict]
    extra: dict[str, Any]
    internal: bool

    @property
    def backend(self) -> str: ...

    @property
    def layout(self) -> str: ...

    @property
    def case(self) -> Case: ...

    @property
    def failing_tensors(self) -> list[str]: ...
