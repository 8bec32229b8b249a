"""What a probe hands back to the parent: a plain record, sent as JSON from the worker process."""

from __future__ import annotations

from dataclasses import dataclass, field

from attn_doctor.numerics.metrics import TensorMetrics


@dataclass
class ProbeOutcome:
    status: str  # "ok", "skip" or "error"
    ran: str = ""
    reason: str = ""
    metrics: dict[str, TensorMetrics] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    extra: dict = field(default_factory=dict)  # probe-specific facts (per-layer errors, pairwise distances)
    # The baseline's probe only: the error a correct flash-style backward's output rounding makes on the case's
    # dQ and dK (`attn_doctor.numerics.rounded_output`), part of flash-style paths' yardstick
    flash_style: dict[str, TensorMetrics] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {
            "status": self.status,
            "ran": self.ran,
            "reason": self.reason,
            "metrics": {name: m.to_dict() for name, m in self.metrics.items()},
            "seconds": self.seconds,
            "extra": self.extra,
            "flash_style": {name: m.to_dict() for name, m in self.flash_style.items()},
        }
