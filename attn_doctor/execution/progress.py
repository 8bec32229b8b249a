"""What a long command reports while it works: a small sink that execution and the workflows call and a
renderer implements (`attn_doctor.render.progress` draws it on a terminal, or prints a heartbeat line every
30 s where stderr is not one; this base class draws nothing: what a workflow called without a sink gets)."""

from __future__ import annotations


class ProgressSink:
    def begin(self, total: int, what: str) -> None:
        """A new stage of `total` steps (probes, points, bisect probes) starts."""

    def advance(self, steps: int = 1, what: str | None = None) -> None:
        """`steps` more are done (more than announced stretches the total: a bisect's is an estimate); `what`
        describes the last one."""

    def note(self, text: str) -> None:
        """Progress inside a step (a depth stack's layers, the float64 replica)."""

    def end(self) -> None:
        """The stage is over."""
