"""Compiled Python for the processes a command starts, where the environment ships none.

Why: a worker's start is its imports, and an import without bytecode compiles every source it loads. The lent GPU's
image ships torch without bytecode and sets PYTHONDONTWRITEBYTECODE=1, so the TE fork server compiled 1,703 of the
2,841 sources `import transformer_engine.pytorch` loads, on one core, at each command's start, and that import is a
cold sweep's critical path: 15.6 s cold, 5.5 s with those sources compiled ahead, which took 1.9 s on 16 processes
(reports/h100/issue51/lease7, `benchmarks/import_cost.py`). The SDPA and local servers and the command itself
compiled torch's again, each on its own.

What: where torch's sources have no bytecode beside them and no prefix is set (`wanted`), the command and every
process it starts read and write bytecode under one private prefix (PYTHONPYCACHEPREFIX: $ATTN_DOCTOR_BYTECODE, or
~/.cache/attn-doctor/bytecode; `off`: never), and a compiler started at the command's first lines fills it on the
cores the imports leave idle, at a low priority (`start`): the standard library, attn_doctor, torch and the family
libraries, then what their distributions require. A source the compiler has not reached yet is compiled by the
process that imports it and written there too (compiled twice only where two processes reach it at once); the next
command finds them all (`compile_all` skips what is up to date).

Safe: Python checks a cached file against its source's modification time and size before using it, and writes
each one atomically (a temporary file renamed), so processes racing on one source leave one whole file. Nothing is
written beside the sources, which is what PYTHONDONTWRITEBYTECODE protects.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Iterator

VARIABLE = "ATTN_DOCTOR_BYTECODE"
IMPORTING_AT_START = 4  # the command and its three fork servers, each importing torch on a core of its own
_SKIPPED_FOLDERS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "ensurepip", "site-packages",
                    "dist-packages", "__pycache__"}

_prefix: str | None = None  # set by `use`: what the command's children are given
_compiler = None  # the compiler's process (subprocess.Popen), while this command owns it
_outcome: dict | None = None  # what it printed when it ended ({} where it printed nothing)


def folder(environ: dict[str, str] | os._Environ = os.environ) -> Path | None:
    """Where the private bytecode lives ($ATTN_DOCTOR_BYTECODE, else ~/.cache/attn-doctor/bytecode); None: `off`."""
    named = environ.get(VARIABLE, "").strip()
    if named.lower() == "off":
        return None
    return Path(named).expanduser() if named else Path.home() / ".cache" / "attn-doctor" / "bytecode"


def beside(source: str) -> Path:
    """Where Python's own bytecode for `source` would be (its __pycache__), whatever prefix is set."""
    path = Path(source)
    return path.parent / "__pycache__" / f"{path.stem}.{sys.implementation.cache_tag}.pyc"


def wanted(torch_init: str | None, environ: dict[str, str] | os._Environ = os.environ) -> Path | None:
    """The prefix to use, or None where it would not help: torch not found, its sources compiled beside them
    already (a usual install: a prefix would hide that bytecode), a prefix of the user's own set, or `off`."""
    if torch_init is None or beside(torch_init).exists() or environ.get("PYTHONPYCACHEPREFIX") \
            or sys.pycache_prefix is not None or sys.implementation.cache_tag is None:
        return None
    return folder(environ)


def use(prefix: Path) -> None:
    """This process reads and writes bytecode under `prefix` from its next import on, and so does every child it
    starts (`processes.for_every_child`)."""
    from attn_doctor.core import processes

    global _prefix
    prefix.mkdir(parents=True, exist_ok=True)
    _prefix = str(prefix)
    sys.pycache_prefix = _prefix
    sys.dont_write_bytecode = False
    processes.for_every_child({"PYTHONPYCACHEPREFIX": _prefix, "PYTHONDONTWRITEBYTECODE": None})


def compiler_processes(cores: int) -> int:
    """How many processes compile: the cores the imports at a command's start leave idle."""
    return max(0, cores - IMPORTING_AT_START)


def start(packages: Iterable[str]) -> None:
    """Where it helps, put this command under the private prefix and start the compiler on the idle cores for
    `packages` (import names: torch and each family's library). Never raises: bytecode is a shortcut."""
    import importlib.util

    global _compiler
    if _prefix is not None:
        return
    try:
        prefix = wanted(getattr(importlib.util.find_spec("torch"), "origin", None))
        if prefix is None:
            return
        use(prefix)
        jobs = compiler_processes(len(os.sched_getaffinity(0)))
        if jobs:
            import atexit
            import subprocess

            from attn_doctor.core import processes

            atexit.register(stop)
            _compiler = processes.start(
                [sys.executable, "-m", "attn_doctor.core.bytecode", str(prefix), str(jobs), *packages],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=processes.child_env())
    except Exception:  # noqa: BLE001 - a shortcut that fails leaves the command as it was, never stops it
        return


def outcome() -> dict | None:
    """What the compiler did, once it has ended ({"files", "compiled", "processes", "seconds"}), or None (none
    started, or still running)."""
    global _outcome
    if _outcome is None and _compiler is not None and _compiler.poll() is not None:
        from attn_doctor.core import processes

        out = _compiler.stdout.read().decode(errors="replace") if _compiler.stdout else ""
        _outcome = processes.last_json_object(out) or {}
    return _outcome or None


def stop() -> None:
    """End the compiler if it still runs (what it wrote stays: every file is whole)."""
    if _compiler is not None and _compiler.poll() is None:
        from attn_doctor.core import processes

        processes.kill_group(_compiler)


# --- the compiler's own process ---------------------------------------------------------------------------------


def _sources_under(root: Path) -> Iterator[str]:
    if root.is_file():
        yield str(root)
        return
    for here, folders, names in os.walk(root):
        folders[:] = sorted(name for name in folders if name not in _SKIPPED_FOLDERS)
        yield from (os.path.join(here, name) for name in sorted(names) if name.endswith(".py"))


def _required(distributions: list[str]) -> list:
    """The installed distributions `distributions` require, transitively (extras left out), themselves first."""
    import importlib.metadata as metadata

    found: dict[str, object] = {}
    waiting = list(distributions)
    while waiting:
        name = waiting.pop(0)
        key = re.sub(r"[-_.]+", "-", name).lower()
        if key in found:
            continue
        try:
            found[key] = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            found[key] = None
            continue
        for requirement in found[key].requires or []:
            if "extra" in requirement.partition(";")[2]:
                continue
            match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
            if match:
                waiting.append(match.group(0))
    return [distribution for distribution in found.values() if distribution is not None]


def sources(packages: list[str]) -> Iterator[str]:
    """The sources to compile, each once, in about the order a worker imports them: the standard library,
    attn_doctor, each of `packages` (import names), then the rest of what their distributions require (tests left
    out). A generator, so that compiling starts at the first folder: the first version listed every source before
    compiling any, reading every installed distribution's metadata, and its processes began 4 s after the command's
    start on the H100 (lease 7), while TE's fork server compiled torch itself."""
    import importlib.util
    import sysconfig

    seen: set[str] = set()

    def new(found: Iterable[str]) -> Iterator[str]:
        for source in found:
            if source not in seen:
                seen.add(source)
                yield source

    roots = [Path(sysconfig.get_paths()["stdlib"]), Path(__file__).resolve().parents[1]]
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec and spec.origin and spec.origin.endswith(".py"):
            roots.append(Path(spec.origin).parent if spec.submodule_search_locations else Path(spec.origin))
    for root in roots:
        yield from new(_sources_under(root))
    for distribution in _required(packages):  # a package's distribution is taken to bear its name (torch, numpy)
        yield from new(str(file.locate()) for file in distribution.files or []
                       if file.suffix == ".py" and not _SKIPPED_FOLDERS.intersection(file.parts[:-1]))


def up_to_date(source: str, cached: Path) -> bool:
    """Whether `cached` is the bytecode Python would accept for `source` (its magic number, and the source's
    modification time and size in its header: importlib's own check)."""
    import importlib.util

    try:
        with open(cached, "rb") as stream:
            header = stream.read(16)
        status = os.stat(source)
    except OSError:
        return False
    return (header[:4] == importlib.util.MAGIC_NUMBER and header[4:8] == bytes(4)
            and int.from_bytes(header[8:12], "little") == int(status.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == status.st_size & 0xFFFFFFFF)


def _compile_chunk(arguments: tuple[str, list[str]]) -> int:
    """Compile each source of the chunk whose bytecode under the prefix is not up to date; how many were."""
    import importlib.util
    import py_compile

    prefix, chunk = arguments
    sys.pycache_prefix = prefix
    compiled = 0
    for source in chunk:
        cached = Path(importlib.util.cache_from_source(source))
        if up_to_date(source, cached):
            continue
        try:
            py_compile.compile(source, cfile=str(cached), doraise=True,
                               invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
        except (py_compile.PyCompileError, OSError, ValueError):
            continue
        compiled += 1
    return compiled


def compile_all(prefix: str, jobs: int, packages: list[str]) -> dict:
    """Compile `sources(packages)` under `prefix` on `jobs` processes at a low priority."""
    import concurrent.futures

    started, files, chunk, pending = time.perf_counter(), 0, [], []
    with concurrent.futures.ProcessPoolExecutor(jobs) as pool:  # at this process's low priority
        for source in sources(packages):  # each chunk compiled as soon as it is found
            chunk.append(source)
            if len(chunk) == 64:
                pending.append(pool.submit(_compile_chunk, (prefix, chunk)))
                files, chunk = files + len(chunk), []
        pending.append(pool.submit(_compile_chunk, (prefix, chunk)))
        compiled = sum(future.result() for future in pending)
    return {"files": files + len(chunk), "compiled": compiled, "processes": jobs,
            "seconds": round(time.perf_counter() - started, 3)}


if __name__ == "__main__":
    os.nice(10)
    print(json.dumps(compile_all(sys.argv[1], int(sys.argv[2]), sys.argv[3:])), flush=True)
