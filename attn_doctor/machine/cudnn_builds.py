"""The cuDNN builds on this machine, which one a process loaded, and how to make a worker load a chosen one.

Two builds often sit side by side: the system copy (what TE finds first) and the pip `nvidia-cudnn-*` copy
torch loads. A build is a folder holding a main `libcudnn.so.N` (and its sub-libraries, which the main one
opens by soname). Its version is read from the library itself where it can be (`cudnnGetVersion()` in a
subprocess of its own: loading a cuDNN into this process could poison a later TE import), else from the
`cudnn_version.h` beside it, the file name (`libcudnn.so.9.14.0`) or the pip package that installed it, and
each build says which it was. Like `attn_doctor.machine.fingerprint`, nothing here raises: a folder that
cannot be read is skipped.

Which build a process uses is read back from its own memory map (`/proc/self/maps`), never assumed from the
variables that were set: `loader_environment` gives a worker every lever the loader and TE offer (TE's
`CUDNN_HOME`/`CUDNN_PATH` search, the loader's `LD_LIBRARY_PATH`, and `LD_PRELOAD` of the build's main and
sub-libraries, so that a copy torch would otherwise load first cannot win), and `not_honoured` compares what
the process then reports with what was asked.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.metadata as md
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from attn_doctor.core.errors import BadInput

# Where system packages put libraries (Debian/Ubuntu multiarch, RHEL, the CUDA toolkit).
SYSTEM_DIRS = ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib/aarch64-linux-gnu",
               "/usr/lib/aarch64-linux-gnu", "/lib64", "/usr/lib64", "/usr/local/cuda/lib64", "/usr/local/cuda/lib")
# The variables TE searches, in its order (transformer_engine/common/__init__.py, `_load_cuda_library`).
HOME_VARIABLES = ("CUDNN_HOME", "CUDNN_PATH", "CUDA_HOME", "CUDA_PATH")
MAIN_LIBRARY = re.compile(r"^libcudnn\.so(\.\d+)*$")
SUB_LIBRARY = re.compile(r"^libcudnn_\w+\.so(\.\d+)*$")
LIBRARY_TIMEOUT_S = 20.0  # reading one library's version in a subprocess

# Run as `python -c READ_VERSION PATH`: the version the library reports, or nothing.
READ_VERSION = "import ctypes, sys; print(int(ctypes.CDLL(sys.argv[1]).cudnnGetVersion()))"


@dataclass(frozen=True)
class CudnnBuild:
    """One cuDNN build: its folder, its main library, its version and how that was read, and where it was
    found ("system", "pip nvidia-cudnn-cu13 9.19.0.56", "CUDNN_HOME", ...)."""

    directory: str
    library: str
    version: str | None
    version_from: str  # "library", "header", "file name", "package", or "" when unknown
    origins: tuple[str, ...] = ()

    def __str__(self) -> str:
        return self.version or self.directory

    def label(self) -> str:
        """"9.14.0 (/lib/x86_64-linux-gnu; system)"."""
        return f"{self.version or 'version unknown'} ({self.directory}; {', '.join(self.origins) or 'given'})"

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "origins": list(self.origins)}  # as JSON reads it back

    @classmethod
    def from_dict(cls, d: Mapping) -> CudnnBuild:
        return cls(str(d["directory"]), str(d["library"]), d.get("version"), str(d.get("version_from", "")),
                   tuple(d.get("origins") or ()))


def decode_cudnn_version(encoded: int) -> str:
    """`cudnnGetVersion()` as TE decodes it: 91400 -> "9.14.0", 8907 -> "8.9.7"."""
    magnitude = 1000 if encoded < 90000 else 10000
    major, rest = divmod(int(encoded), magnitude)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


# --- where builds are --------------------------------------------------------------------------------------

def _main_libraries(directory: Path, recursive: bool) -> list[Path]:
    pattern = "**/libcudnn.so*" if recursive else "libcudnn.so*"
    try:
        found = glob.glob(str(directory / pattern), recursive=recursive)
    except OSError:
        return []
    return [Path(p) for p in found if MAIN_LIBRARY.match(Path(p).name) and "stubs" not in Path(p).parts]


def _site_dirs() -> list[Path]:
    import site

    dirs = [*getattr(site, "getsitepackages", lambda: [])(), site.getusersitepackages(), *sys.path]
    return list(dict.fromkeys(Path(d) for d in dirs if d and Path(d).is_dir()))


def _pip_owner(library: Path, site_dirs: Iterable[Path]) -> str | None:
    """"pip nvidia-cudnn-cu13 9.19.0.56" for a library a pip `nvidia-cudnn-*` package installed."""
    try:
        for dist in md.distributions(path=[str(d) for d in site_dirs]):
            name = (dist.metadata["Name"] or "").lower()
            if not name.startswith("nvidia-cudnn"):
                continue
            for file in dist.files or ():
                try:
                    if Path(dist.locate_file(file)).resolve() == library.resolve():
                        return f"pip {name} {dist.version}"
                except OSError:
                    continue
    except Exception:  # noqa: BLE001 - broken metadata: the library is still a build
        return None
    return None


def find_builds(environ: Mapping[str, str] | None = None, system_dirs: Iterable[str] = SYSTEM_DIRS,
                site_dirs: Iterable[Path] | None = None, read_library: bool = True) -> list[CudnnBuild]:
    """Every cuDNN build found: the system folders, the folders TE's variables name (searched recursively, as
    TE does), and pip's `nvidia` packages; one per folder, sorted by version. Never raises."""
    environ = os.environ if environ is None else environ
    site_dirs = _site_dirs() if site_dirs is None else list(site_dirs)
    found: dict[Path, dict] = {}  # folder -> {"libraries": [...], "origins": [...]}

    def add(libraries: list[Path], origin: str) -> None:
        for library in libraries:
            try:
                folder = library.resolve().parent
            except OSError:
                continue
            entry = found.setdefault(folder, {"libraries": [], "origins": []})
            entry["libraries"].append(library)
            if origin not in entry["origins"]:
                entry["origins"].append(origin)

    for directory in system_dirs:
        add(_main_libraries(Path(directory), recursive=False), "system")
    for variable in HOME_VARIABLES:
        if environ.get(variable):
            add(_main_libraries(Path(environ[variable]), recursive=True), variable)
    for directory in site_dirs:
        libraries = _main_libraries(directory / "nvidia", recursive=True)
        for library in libraries:
            add([library], _pip_owner(library, site_dirs) or "pip")
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, len(found))) as pool:  # each library is read in its own process
        builds = list(pool.map(lambda item: _build(item[0], item[1]["libraries"], tuple(item[1]["origins"]),
                                                   read_library), found.items()))
    return sorted(builds, key=lambda b: (version_order(b.version), b.directory))


def _build(folder: Path, libraries: list[Path], origins: tuple[str, ...], read_library: bool) -> CudnnBuild:
    # The main library's own file: the longest name (libcudnn.so.9.14.0 over its libcudnn.so.9 link).
    names = {p.name for p in libraries} | {p.name for p in _main_libraries(folder, recursive=False)}
    library = folder / max(names, key=lambda n: (n.count("."), n))
    version, source = None, ""
    if read_library:
        version, source = library_version(library), "library"
    if version is None:
        version, source = header_version(folder), "header"
    if version is None:
        version, source = _name_version(library), "file name"
    if version is None:
        package = next((o for o in origins if o.startswith("pip ") and len(o.split()) == 3), None)
        version, source = (".".join(package.split()[2].split(".")[:3]), "package") if package else (None, "")
    return CudnnBuild(str(folder), str(library), version, source if version else "", origins)


def library_version(library: Path) -> str | None:
    """The version the library reports (`cudnnGetVersion()`), read in a subprocess; None if it cannot load."""
    try:
        done = subprocess.run([sys.executable, "-c", READ_VERSION, str(library)], capture_output=True, text=True,
                              timeout=LIBRARY_TIMEOUT_S, env={**os.environ, "LD_LIBRARY_PATH": str(library.parent)})
        return decode_cudnn_version(int(done.stdout.strip().splitlines()[-1])) if done.returncode == 0 else None
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def header_version(folder: Path) -> str | None:
    """CUDNN_MAJOR.MINOR.PATCHLEVEL from a `cudnn_version*.h` beside the library (../include, or the folder)."""
    for candidate in [*folder.parent.glob("include/cudnn_version*.h"), *folder.glob("cudnn_version*.h")]:
        try:
            text = candidate.read_text(errors="replace")
        except OSError:
            continue
        parts = [re.search(rf"#define\s+CUDNN_{name}\s+(\d+)", text) for name in ("MAJOR", "MINOR", "PATCHLEVEL")]
        if all(parts):
            return ".".join(m.group(1) for m in parts)
    return None


def _name_version(library: Path) -> str | None:
    match = re.fullmatch(r"libcudnn\.so\.(\d+\.\d+\.\d+)", library.name)
    return match.group(1) if match else None


def version_order(version: str | None) -> tuple:
    """"9.19.0" -> (9, 19, 0), to sort versions; a part that is not a number counts as 0 (a folder given instead
    of a version), and an unknown version sorts last."""
    return tuple(int(p) if p.isdigit() else 0 for p in version.split(".")) if version else (10**9,)


REPRODUCED = "reproduced with "  # how `builds_sentence` begins where every build or release seen fails


def builds_sentence(failing: list[str], passing: list[str], library: str = "cuDNN") -> str:
    """"fails with cuDNN 9.14.0, passes with 9.19.0: fixed by 9.19.0", "reproduced with cuDNN 9.14.0 and 9.19.0",
    or "" when one build alone was seen (`failing` and `passing` oldest first); `library` "TE" for releases."""
    if failing and passing:
        newer = [p for p in passing if all(version_order(p) > version_order(f) for f in failing)]
        return (f"fails with {library} {', '.join(failing)}, passes with {', '.join(passing)}"
                + (f": fixed by {newer[0]}" if newer else ""))
    if len(failing) > 1:
        return f"{REPRODUCED}{library} {', '.join(failing[:-1])} and {failing[-1]}"
    return ""


# --- which build a process loaded --------------------------------------------------------------------------

def loaded_libraries(maps: str | None = None) -> list[str]:
    """The cuDNN main libraries mapped into this process (`/proc/self/maps`, or the text given), in the order
    they appear; [] where the map cannot be read."""
    if maps is None:
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return []
    paths = []
    for line in maps.splitlines():
        path = line.split(maxsplit=5)[5].strip() if len(line.split(maxsplit=5)) == 6 else ""
        if path and MAIN_LIBRARY.match(Path(path).name) and path not in paths:
            paths.append(path)
    return paths


def build_of(library: str | None, builds: Iterable[CudnnBuild]) -> CudnnBuild | None:
    """The build a loaded library belongs to (by its folder)."""
    if not library:
        return None
    try:
        folder = str(Path(library).resolve().parent)
    except OSError:
        return None
    return next((b for b in builds if b.directory == folder), None)


# --- asking a worker to load one -------------------------------------------------------------------------

def resolve(request: str, builds: list[CudnnBuild], read_library: bool = True) -> CudnnBuild:
    """The build `--cudnn REQUEST` names: a version ("9.19.0", or "9.19" when one build matches) or a path (the
    library or its folder). BadInput naming the builds found when there is none."""
    found = "; ".join(b.label() for b in builds) or "none"
    path = Path(request).expanduser()
    if "/" in request or path.exists():
        folder = path if path.is_dir() else path.parent
        libraries = _main_libraries(folder, recursive=False)
        if not libraries:
            raise BadInput(f"--cudnn {request}: no libcudnn.so there; cuDNN builds found here: {found}")
        known = build_of(str(libraries[0]), builds)
        return known or _build(folder.resolve(), libraries, ("--cudnn",), read_library)
    matches = [b for b in builds if b.version == request] or [
        b for b in builds if b.version and b.version.startswith(request + ".")]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise BadInput(f"--cudnn {request}: no such cuDNN build here; found: {found} (give a version or a path)")
    raise BadInput(f"--cudnn {request} matches {len(matches)} builds ({'; '.join(b.label() for b in matches)}); "
                   "give the full version or the path")


def sonames(build: CudnnBuild) -> list[str]:
    """The build's main library and sub-libraries, one file per library (the soname's, where there is one)."""
    try:
        files = sorted(p for p in Path(build.directory).iterdir()
                       if MAIN_LIBRARY.match(p.name) or SUB_LIBRARY.match(p.name))
    except OSError:
        return [build.library]
    by_stem: dict[str, list[Path]] = {}
    for file in files:
        by_stem.setdefault(file.name.split(".so")[0], []).append(file)

    def preferred(names: list[Path]) -> Path:  # the soname (libcudnn_ops.so.9), else the most specific name
        return next((p for p in names if re.fullmatch(r".+\.so\.\d+", p.name)), max(names, key=lambda p: p.name))

    main = preferred(by_stem.pop("libcudnn")) if "libcudnn" in by_stem else Path(build.library)
    return [str(main), *(str(preferred(names)) for names in by_stem.values())]


def loader_environment(build: CudnnBuild, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables a worker starts with to load `build` (see the module docstring)."""
    environ = os.environ if environ is None else environ

    def prepended(name: str, values: list[str], separator: str) -> str:
        current = [v for v in environ.get(name, "").split(separator) if v]
        return separator.join(list(dict.fromkeys([*values, *current])))

    return {"CUDNN_HOME": build.directory, "CUDNN_PATH": build.directory,
            "LD_LIBRARY_PATH": prepended("LD_LIBRARY_PATH", [build.directory], ":"),
            "LD_PRELOAD": prepended("LD_PRELOAD", sonames(build), ":"), WANTED_BUILD: build.directory}


WANTED_BUILD = "ATTN_DOCTOR_CUDNN_BUILD"  # the folder of the build a worker is to load (`loader_environment`)
MAIN_PATTERN = "libcudnn.so.*[0-9]"  # what torch globs for when it preloads pip's cuDNN


@contextlib.contextmanager
def torch_preloads_wanted_build() -> Iterator[None]:
    """Around a worker's `import torch`: where a build was asked for (`WANTED_BUILD`), torch's preload of pip's
    CUDA libraries (`torch._preload_cuda_deps`, which opens the first `nvidia/cudnn/lib/libcudnn.so.*` on
    sys.path by its full path) finds the wanted build's library instead.

    Why: a full path is opened as its own file whatever LD_PRELOAD loaded under the same soname, so without this
    every worker mapped pip's cuDNN beside the wanted one (H100, torch 2.11: `--cudnn 9.14.0` got 9.19.0 mapped
    too, and its rows were SKIP, "two cuDNN builds are mapped in one process"). What loaded is still read back
    from the process's memory map (`not_honoured`), never assumed from this."""
    wanted = os.environ.get(WANTED_BUILD)
    if not wanted:
        yield
        return
    original = glob.glob

    def glob_for_torch(pattern, *args, **kwargs):
        found = original(pattern, *args, **kwargs)
        if os.path.basename(str(pattern)) == MAIN_PATTERN and "cudnn" in str(pattern):
            return sorted(original(os.path.join(wanted, MAIN_PATTERN))) if found else found
        return found

    glob.glob = glob_for_torch
    try:
        yield
    finally:
        glob.glob = original


def not_honoured(wanted: CudnnBuild, reported_version: str | None, loaded: list[str]) -> str | None:
    """Why a process did not load `wanted` (None when it did): the version its library reported and the
    folder of the cuDNN it mapped must both be the build's."""
    folders = [str(Path(p).resolve().parent) for p in loaded]
    where = ", ".join(loaded) or "no libcudnn mapped"
    if wanted.version and reported_version and reported_version != wanted.version:
        return f"cuDNN {wanted.version} was asked for, and {reported_version} was loaded ({where})"
    if wanted.directory not in folders:
        return f"cuDNN from {wanted.directory} was asked for, and the process mapped {where}"
    if len(set(folders)) > 1:
        return f"two cuDNN builds are mapped in one process ({where})"
    return None

