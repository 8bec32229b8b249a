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


class InternalError(Exception):
    """attn-doctor's own code failed where it runs inside the kernel's (`own_code`): never the kernel's."""

    def __init__(self, cause: BaseException):
        super().__init__(first_line(cause))
        self.cause = cause


_CUDA_FAULTS = ("CUDA error", "AcceleratorError", "illegal memory access", "CUBLAS_STATUS", "cudaError")


def is_cuda_fault(exc: BaseException) -> bool:
    """A CUDA error: it may surface at any later synchronisation, and it leaves the process's context unusable."""
    text = f"{type(exc).__name__}: {exc}"
    return any(s in text for s in _CUDA_FAULTS)


def is_out_of_memory(exc: BaseException) -> bool:
    """The allocator could not give what was asked (torch's OutOfMemoryError on a GPU; on the CPU, MemoryError
    or the CPU allocator's refusal): a question of room, never a kernel's fault nor attn-doctor's."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(exc)


@contextmanager
def kernel_code(passthrough: tuple[type[BaseException], ...] = ()) -> Iterator[None]:
    """Marks the code of the kernel under test: what it raises becomes a KernelError (except the
    `passthrough` exceptions, e.g. the backend's own refusal to run a case, and attn-doctor's own code called
    from it, `own_code`)."""
    try:
        yield
    except (KernelError, InternalError, *passthrough):
        raise
    except Exception as exc:
        raise KernelError(exc) from exc


@contextmanager
def own_code() -> Iterator[None]:
    """Marks attn-doctor's own code called from inside the kernel's (a comparison made as the kernel's backward
    hands on a gradient): what it raises is an InternalError, which `kernel_code` passes through unblamed."""
    try:
        yield
    except InternalError:
        raise
    except Exception as exc:
        raise InternalError(exc) from exc


def first_line(exc: BaseException) -> str:
    """``"TypeName: first line of the message"`` (the type name alone for an empty message)."""
    text = str(exc).strip()
    line = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {line}" if line else type(exc).__name__
