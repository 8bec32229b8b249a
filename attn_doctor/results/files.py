"""Writing results: atomically (temp file in the same folder, then a rename, so an interrupted write never
leaves half a document), with the permissions the user's umask gives (like every other tool), checked for
writability before any work starts, and kept somewhere else when the place asked for fails at the end."""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path

from attn_doctor.core.errors import BadInput


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
    path = Path(path)
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


def check_writable(path: Path, option: str, directory: bool = False) -> None:
    """Refuse (BadInput) a path the results could not be written to, before any work starts, by writing a
    temp file where they will go; the folders that had to be made for it are removed again."""
    path = Path(path)
    if directory and path.exists() and not path.is_dir():
        raise BadInput(f"{option} {path} is a file; give a folder")
    if not directory and path.is_dir():
        raise BadInput(f"{option} {path} is a folder; give a file path")
    folder = path if directory else path.parent
    made: list[Path] = []
    try:
        for parent in reversed([folder, *folder.parents]):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
            elif not parent.is_dir():
                raise NotADirectoryError(f"{parent} is not a folder")
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise BadInput(f"cannot write {option} {path}: {exc.strerror or exc}; choose another path") from None
    finally:
        for made_folder in reversed(made):
            try:
                made_folder.rmdir()
            except OSError:
                pass


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
