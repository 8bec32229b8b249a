"""Writing results: atomically (temp file in the same folder, then a rename, so an interrupted write never
leaves half a document), with the permissions the user's umask gives (like every other tool), and kept somewhere
else when the place asked for fails at the end. Where they may go was checked before any work started
(`attn_doctor.core.paths.check_output`)."""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path

from attn_doctor.core.paths import is_special


def current_umask() -> int:
    """This process's umask (read from /proc where it can be, so no other thread sees it change)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def inside(folder: Path, name: str | Path) -> bool:
    """Whether `name`, relative to `folder`, resolves (links followed) to a place inside `folder`: what a document
    names is read only there (reports made from documents are pasted into public bug reports)."""
    try:
        root = Path(folder).resolve()
        return (root / name).resolve().is_relative_to(root)
    except (OSError, ValueError, RuntimeError):
        return False


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` through a temp file in the same folder and a rename."""
    write_atomic_bytes(path, text.encode())


def write_atomic_bytes(path: Path, data: bytes) -> None:
    """`data` into `path`. A symbolic link stays a link: what it points to is written. A device node, FIFO or
    socket (`/dev/stdout`, a named pipe) is written to in place: a rename would replace it with a regular file."""
    path = Path(path)
    if is_special(path):  # links followed: /dev/stdout is a link to a pipe or a terminal
        with open(path, "wb") as handle:
            handle.write(data)
        return
    if path.is_symlink():
        path = path.resolve()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o666 & ~current_umask())  # mkstemp makes 0600; a results file is as shareable as any
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_or_keep(path: Path, text: str) -> tuple[Path, str | None]:
    """Write `text` to `path`; when that fails, to a new file in the temp folder instead. Returns where it
    went and, on a fallback, why `path` failed: results are never lost to a write error."""
    try:
        write_atomic(path, text)
        return Path(path), None
    except OSError as exc:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        fd, kept = tempfile.mkstemp(prefix=f"attn-doctor-{stamp}-", suffix=f"-{Path(path).name}")
        os.close(fd)
        write_atomic(Path(kept), text)
        return Path(kept), f"cannot write {path} ({exc.strerror or exc})"
