"""Where a case's numbers come from: the one contract between the probes and whatever supplies them.

Every probe of a case takes from a `Source` its q, k, v and output gradient, the explicit mask of a captured
mask, the bias, the slots of a packed (thd) tensor, and the views and output gradient of the `captured`
layout. The default, `SEEDED`, supplies nothing of its own: the case's seed draws every value
(`attn_doctor.numerics.inputs`) and the case's fields give every shape. A replayed call's numbers come from
its capture (`attn_doctor.tracing.replay_source`, which implements this protocol); core, numerics and the
probes never import it: the worker process, which knows both, hands it in (`SourceOf`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from attn_doctor.core.case import Case
    from attn_doctor.numerics.views import QKV

# A packed call's slots per side (query side, key side): each sequence's length plus the padding after it.
Slots = tuple[tuple[int, ...], tuple[int, ...]]


class Source(Protocol):
    """What supplies a case's numbers. Each method answers for one case; None means "draw or derive it from
    the case" (the seeded default), so a source overrides only what it has."""

    def values(self, case: Case, device: torch.device) -> tuple[torch.Tensor, ...] | None:
        """q, k, v and the output gradient, bshd, on `device`; None: the seeded ones."""

    def allowed(self, case: Case, device: torch.device) -> torch.Tensor:
        """The explicit mask of mask source "captured", as allowed pairs [b, 1, s, s_kv] (True = attend)."""

    def bias(self, case: Case, device: torch.device) -> torch.Tensor | None:
        """The additive bias in the shape of `case.bias`, in the inputs' dtype; None: a seeded one."""

    def slots(self, case: Case) -> Slots | None:
        """A packed call's own slots; None: the case's (`attn_doctor.core.layouts.slots`)."""

    def views(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> QKV:
        """q, k, v (bshd values) as the `captured` layout's views, presented in `fmt`."""

    def dout(self, case: Case, dout: torch.Tensor) -> torch.Tensor | None:
        """The output gradient laid out as the `captured` layout's backward gets it; None: contiguous."""


SourceOf = Callable[["Case"], Source]


class MissingSource(ValueError):
    """A replayed case reached the seeded source: its numbers were never handed in (a wiring bug)."""


class SeededSource:
    """The default: nothing of its own. A replayed case refuses it, so that a replay never silently runs on
    seeded numbers where its capture should have been asked."""

    @staticmethod
    def _plain(case: Case) -> None:
        if case.replay is not None:
            raise MissingSource(f"the case replays {case.replay}: its numbers come from its capture's source "
                                "(attn_doctor.tracing.replay_source.source_of), not the seeded one")

    def values(self, case: Case, device: torch.device) -> None:
        self._plain(case)
        return None

    def allowed(self, case: Case, device: torch.device) -> torch.Tensor:
        self._plain(case)
        raise MissingSource(f"mask source {case.mask_source!r} is a replayed call's own mask")

    def bias(self, case: Case, device: torch.device) -> None:
        self._plain(case)
        return None

    def slots(self, case: Case) -> None:
        self._plain(case)
        return None

    def views(self, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fmt: str) -> QKV:
        self._plain(case)
        raise MissingSource("the captured layout is a replayed call's (attn-doctor replay)")

    def dout(self, case: Case, dout: torch.Tensor) -> None:
        self._plain(case)
        return None


SEEDED = SeededSource()


def seeded(case: Case) -> Source:
    """The `SourceOf` of a process that replays nothing."""
    return SEEDED
