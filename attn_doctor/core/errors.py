"""Errors that reach the user as one line and exit code 2 (bad input), never a traceback; the line between
the kernel's errors and attn-doctor's own; and the one-line form every other caught exception is reported in."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


class BadInput(Exception):
    """Something the user gave us, or asked for, is wrong or cannot run here; the message says what and
    how to fix it."""


class KernelError(Exception):
    """The kernel under test raised (forward or backward, or a CUDA fault it caused): an ERROR row that
    names the kernel. Anything else raised while probing is attn-doctor's own error, and says so."""

    def __init__(self, cause: BaseException):
        super().__init__(first_line(cause))
        self.cause = cause


_CUDA_FAULTS = ("CUDA error", "AcceleratorError", "illegal memory access", "CUBLAS_STATUS", "cudaError")


def is_cuda_fault(exc: BaseException) -> bool:
    """A CUDA error: it may surface at any later synchronisation, and it leaves the process's context unusable."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in _CUDA_FAULTS)


@contextmanager
def kernel_code(passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Marks the code of the kernel under test: what it raises becomes a KernelError (except the
    `passthrough` exceptions, e.g. the backend's own refusal to run a case)."""
    try:
        yield
    except (KernelError, *passthrough):
        raise
    except Exception as exc:
        raise KernelError(exc) from exc


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (the type name alone for an empty message)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
