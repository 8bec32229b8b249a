"""The paths a user gives, checked once and up front, before any work starts: an output (`check_output`) must be
writable where it is asked, an input (`check_input`) readable. What cannot work is bad input naming the option
and why (exit 2, one line), never a traceback an hour into a sweep.

The operating system is asked, not second-guessed: a name too long for the file system, a path under an existing
file, a folder that cannot be made (`/proc/...`) or a file nobody may read all fail here with the system's own
reason. An existing device node or a symbolic link (`--json /dev/stdout`) is an output like any other: it is
checked for writing, and `attn_doctor.results.files` writes to it rather than replacing it.
"""

from __future__ import annotations

import errno
import os
import stat
import tempfile
from pathlib import Path

from attn_doctor.core.errors import BadInput

SHOWN_CHARS = 60  # a path longer than this is shown cut, with its length: a 4,000-character name fills a log


def shown(path: str | Path) -> str:
    text = str(path)
    return text if len(text) <= SHOWN_CHARS else f"{text[:28]}...{text[-24:]} ({len(text)} characters)"


def _reason(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def is_special(path: Path) -> bool:
    """Whether `path` (links followed) is something other than a regular file or a folder: a device node, a FIFO,
    a socket. It is written to in place, never replaced by a regular file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def check_input(path: str | Path, option: str, kind: str = "any") -> None:
    """Bad input when `path` exists but cannot be read (or its name cannot even be looked up: too long, under a
    file, a loop of links); `kind` "file" or "folder" also refuses the other kind. A path that does not exist is
    left to the caller, whose message says what belongs there."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:  # ValueError: a NUL byte in the name
        reason = _reason(exc) if isinstance(exc, OSError) else "the name holds a NUL byte"
        raise BadInput(f"cannot read {option} {shown(path)}: {reason}; give another path") from None
    if kind == "file" and stat.S_ISDIR(mode):
        raise BadInput(f"{option} {shown(path)} is a folder; give a file")
    if kind == "folder" and not stat.S_ISDIR(mode):
        raise BadInput(f"{option} {shown(path)} is not a folder; give a folder")
    wanted = os.R_OK | (os.X_OK if stat.S_ISDIR(mode) else 0)
    if not os.access(path, wanted):
        raise BadInput(f"cannot read {option} {shown(path)}: Permission denied; give another path")


def _name_max(folder: Path) -> int:
    """The longest file name `folder`'s file system takes (255 where it does not say)."""
    try:
        return os.pathconf(folder, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_output(path: str | Path, option: str, directory: bool = False) -> None:
    """Bad input when the results could not be written to `path` (a file, or with `directory` a folder), found
    by writing a temp file where they will go; the folders that had to be made for it are removed again."""
    path = Path(path)
    made: list[Path] = []
    try:
        if directory and path.exists() and not path.is_dir():
            raise BadInput(f"{option} {shown(path)} is a file; give a folder")
        if not directory and path.is_dir():
            raise BadInput(f"{option} {shown(path)} is a folder; give a file path")
        if not directory and is_special(path):
            if not os.access(path, os.W_OK):
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
            return
        folder = path if directory else path.parent
        for parent in reversed([folder, *folder.parents]):
            if not parent.exists():
                parent.mkdir()
                made.append(parent)
            elif not parent.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, f"{parent} is not a folder")
        if not directory and len(os.fsencode(path.name)) > _name_max(folder):  # the temp file's name is short
            raise OSError(errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise BadInput(f"cannot write {option} {shown(path)}: {_reason(exc)}; choose another path") from None
    except ValueError:
        raise BadInput(f"cannot write {option} {shown(path)}: the name holds a NUL byte; choose another path") from None
    finally:
        for made_folder in reversed(made):
            try:
                made_folder.rmdir()
            except OSError:
                pass
