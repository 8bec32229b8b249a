"""Transformer Engine releases installed side by side for attn-doctor (`attn-doctor te add`), never into the
user's environment, and found again (`find_installs`, which never raises: a folder it cannot read is skipped).

An install is a folder `<home>/<version>/` (home: $ATTN_DOCTOR_TE_HOME, else ~/.cache/attn-doctor/te) holding
`site/`, where pip put TE's three packages (`transformer-engine`, the pure-Python part; `transformer-engine-cuNN`,
the core library for this torch's CUDA major; `transformer-engine-torch`, the torch extension, published as a source
distribution only and built here against this very torch and the release's own core, its wheel kept in `built/`),
and `install.json`: the version, and what the install
was built against and checked with (torch, its CUDA, Python), read back from a fresh interpreter that imported it.
An install is made in a hidden folder beside the others and renamed into place only once that check passed, so a
failed or interrupted one leaves nothing that `find_installs` would take for an install.

The TE installed in the environment itself is a release too (`environment_install`, read from its package
metadata, no folder): `--te 2.18.0,2.20.2` on a machine with 2.20.2 installed compares the prepared 2.18.0 with it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from attn_doctor.core.errors import BadInput

HOME_VARIABLE = "ATTN_DOCTOR_TE_HOME"
SITE_VARIABLE = "ATTN_DOCTOR_TE_SITE"  # a worker's prepared release (`--te`): its site folder, first on the path
RECORD = "install.json"
SITE = "site"
VERSION = re.compile(r"^\d+\.\d+(\.\d+)?([a-z0-9.+-]*)$")
CHECK_TIMEOUT_S = 300.0  # importing TE in a fresh interpreter (its core library is hundreds of MB)

# Run as `python -c CHECK SITE`: TE imported from SITE alone, and what it was imported with, as one JSON line.
CHECK = """\
import json, sys
sys.path.insert(0, sys.argv[1])
import torch
import transformer_engine
import transformer_engine.pytorch
where = transformer_engine.__file__ or ""
extension = getattr(sys.modules.get("transformer_engine_torch"), "__file__", "") or ""
print(json.dumps({"version": transformer_engine.__version__, "torch": torch.__version__,
                  "cuda": torch.version.cuda, "python": sys.version.split()[0],
                  "from_site": where.startswith(sys.argv[1]), "extension": extension,
                  "extension_from_site": extension.startswith(sys.argv[1])}))
"""


@dataclass(frozen=True)
class TEInstall:
    """One prepared TE: its version, its folder, and what it was built against (read back when it was made)."""

    version: str
    directory: str
    torch: str = ""
    cuda: str = ""
    python: str = ""

    def __str__(self) -> str:
        return self.version

    @property
    def prepared(self) -> bool:
        """Prepared by `attn-doctor te add` (a folder of its own), not the environment's own TE."""
        return bool(self.directory)

    @property
    def site(self) -> str:
        return str(Path(self.directory) / SITE) if self.prepared else ""

    def label(self) -> str:
        """"2.18.0 (built for torch 2.11.0+cu130, CUDA 13.0; /root/.cache/attn-doctor/te/2.18.0)", or for the
        environment's own "2.20.2 (installed in this environment)"."""
        if not self.prepared:
            return f"{self.version} (installed in this environment)"
        return f"{self.version} (built for torch {self.torch or '?'}, CUDA {self.cuda or '?'}; {self.directory})"

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> TEInstall:
        return cls(str(d["version"]), str(d["directory"]), str(d.get("torch", "")), str(d.get("cuda", "")),
                   str(d.get("python", "")))


def te_home(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    return Path(environ.get(HOME_VARIABLE) or Path.home() / ".cache" / "attn-doctor" / "te")


def version_order(version: str) -> tuple:
    return tuple(int(part) if part.isdigit() else -1 for part in re.split(r"[.+-]", version))


def find_installs(home: Path | None = None) -> list[TEInstall]:
    """The installs under `home`, oldest version first; a folder without a readable record is not one."""
    home = te_home() if home is None else home
    found = []
    try:
        folders = sorted(home.iterdir())
    except OSError:
        return []
    for folder in folders:
        if folder.name.startswith("."):
            continue  # being made, or left by one that failed
        try:
            record = json.loads((folder / RECORD).read_text())
            install = TEInstall.from_dict({**record, "directory": str(folder)})
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if (folder / SITE).is_dir():
            found.append(install)
    return sorted(found, key=lambda install: version_order(install.version))


def environment_install() -> TEInstall | None:
    """The TE installed in this environment (its package metadata: nothing imported), as a release `--te` may
    name; None when there is none or it cannot be read."""
    from importlib import metadata

    for name in ("transformer-engine", "transformer_engine"):
        try:
            return TEInstall(metadata.version(name), "")
        except Exception:  # noqa: BLE001 - not installed, or metadata unreadable: then it is not a choice
            continue
    return None


def choices(home: Path | None = None) -> list[TEInstall]:
    """The releases `--te` may name: the environment's own TE first (where one is installed), then the prepared
    ones; never raises."""
    own = environment_install()
    return ([own] if own else []) + find_installs(home)


def resolve(request: str, installs: Sequence[TEInstall]) -> TEInstall:
    """The release of version `request` among `installs` (the environment's own first: it needs no worker of its
    own); BadInput naming those there are, and how to add one."""
    for install in installs:
        if install.version == request.strip():
            return install
    own = [install.version for install in installs if not install.prepared]
    have = ", ".join(install.version for install in installs if install.prepared) or "none"
    raise BadInput(f"--te {request}: TE {request} is not prepared here (prepared: {have}"
                   + (f"; installed: {own[0]}" if own else "") + f"); prepare it with `attn-doctor te add {request}` "
                   "(or `--from DIR` with its wheels), or pick one of those")


def core_package(cuda: str | None) -> str:
    """TE's core package for this torch's CUDA major: "transformer-engine-cu13"."""
    major = (cuda or "").split(".")[0]
    if not major.isdigit():
        raise BadInput("attn-doctor te add: this torch has no CUDA (torch.version.cuda is None); TE needs a CUDA "
                       "build of torch")
    return f"transformer-engine-cu{major}"


def pip_commands(version: str, target: Path, wheels: Path | None, cuda: str | None) -> list[list[str]]:
    """pip, in three steps: TE's pure-Python package and its core library for this torch's CUDA into a build folder
    beside `target` ("build-site"); the torch extension's source distribution built into a wheel there too
    ("built"), against this torch (no build isolation) and this release's core (`build_environment` puts the build
    folder first on the path); then all three into `target` in one install. One install, because all three put
    files in the one `transformer_engine` folder (the extension in its `wheel_lib/`) and pip's `--target` skips a
    folder that is already there: installed after the others, the extension was left out, and TE then loaded the
    environment's own (the H100, TE 2.18.0 beside 2.20.2). No dependencies (torch and the rest are this
    environment's); from `wheels` only when given (a machine with no package index), else from the index."""
    source = ["--no-index", "--find-links", str(wheels)] if wheels is not None else []
    pip = [sys.executable, "-m", "pip"]
    quiet = ["--quiet", "--disable-pip-version-check", "--no-deps"]
    built = target.parent / "built"
    python_and_core = [f"transformer-engine=={version}", f"{core_package(cuda)}=={version}"]
    return [
        [*pip, "install", *quiet, "--target", str(build_site(target)), *source, *python_and_core],
        [*pip, "wheel", *quiet, "--no-build-isolation", "--no-binary", "transformer-engine-torch", "--wheel-dir",
         str(built), *source, f"transformer-engine-torch=={version}"],
        [*pip, "install", *quiet, "--target", str(target), *source, "--find-links", str(built),
         *python_and_core, f"transformer-engine-torch=={version}"],
    ]


def build_site(target: Path) -> Path:
    """Where the release's Python part and core are installed to build its extension against (removed after)."""
    return target.parent / "build-site"


def build_environment(site: Path, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment pip runs in: the release's own folder first on the path (its core is what the extension
    is built against), the extension built from source (TE's setup would otherwise try to fetch a prebuilt wheel)
    for PyTorch only, on every core, with CUDA's toolkit where it usually is, unless the user said otherwise."""
    env = dict(os.environ if environ is None else environ)
    env["PYTHONPATH"] = str(site) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("NVTE_FRAMEWORK", "pytorch")
    env.setdefault("NVTE_PYTORCH_FORCE_BUILD", "TRUE")
    env.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    if "CUDA_HOME" not in env and Path("/usr/local/cuda").is_dir():
        env["CUDA_HOME"] = "/usr/local/cuda"
    return env


def last_error_line(text: str) -> str:
    """The line of a failed build or import that says why: its last line naming an error, else its last line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    for line in reversed(lines):
        if re.search(r"error|Error|ERROR|No matching distribution|not found", line):
            return line[:300]
    return lines[-1][:300] if lines else "no output"


Runner = Callable[[list[str], dict[str, str]], subprocess.CompletedProcess]


def _run(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env, capture_output=True, text=True, check=False)


def add(version: str, wheels: Path | None = None, home: Path | None = None, runner: Runner = _run,
        on_step: Callable[[str], None] | None = None) -> tuple[TEInstall, bool]:
    """Prepare TE `version` under `home` (see the module): (the install, whether it was made now: False when it
    was already prepared). BadInput, with nothing left behind, when pip or the check fails."""
    import torch

    version = version.strip()
    if not VERSION.match(version):
        raise BadInput(f"attn-doctor te add: {version!r} is not a TE version; give one like 2.18.0")
    if wheels is not None and not wheels.is_dir():
        raise BadInput(f"attn-doctor te add --from {wheels}: not a folder; give the folder holding TE's wheels and "
                       "its transformer-engine-torch source distribution")
    home = te_home() if home is None else home
    for install in find_installs(home):
        if install.version == version:
            return install, False
    step = on_step or (lambda text: None)
    partial = home / f".partial-{version}-{os.getpid()}"
    final = home / version
    if final.exists():
        raise BadInput(f"attn-doctor te add: {final} exists but is not a finished install; remove it and run again")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        (partial / SITE).mkdir(parents=True)
        step(f"installing TE {version} into {final} (building its torch extension: minutes)")
        environment = build_environment(build_site(partial / SITE))
        for command in pip_commands(version, partial / SITE, wheels, torch.version.cuda):
            done = runner(command, environment)
            if done.returncode != 0:
                raise BadInput(f"attn-doctor te add {version}: pip could not install it for torch "
                               f"{torch.__version__}: {last_error_line(done.stderr + done.stdout)} (check that TE "
                               f"{version} exists for CUDA {torch.version.cuda}; without a package index, give --from "
                               "DIR holding its packages)")
        shutil.rmtree(build_site(partial / SITE), ignore_errors=True)
        step("checking it imports")
        checked = runner([sys.executable, "-c", CHECK, str(partial / SITE)], dict(os.environ))
        facts = _checked(checked)
        why = last_error_line(checked.stderr + checked.stdout) if facts is None else _not_its_own(facts, version)
        if why:
            raise BadInput(f"attn-doctor te add {version}: the install does not import: {why}")
        install = TEInstall(version, str(final), str(facts.get("torch", "")), str(facts.get("cuda") or ""),
                            str(facts.get("python", "")))
        record = {key: value for key, value in install.to_dict().items() if key != "directory"}
        (partial / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        partial.rename(final)
        return install, True
    finally:
        shutil.rmtree(partial, ignore_errors=True)  # gone after the rename; what a failure left otherwise


def _not_its_own(facts: dict, version: str) -> str:
    """What the import check found not to be the release's own (its TE, its torch extension); "" when both are."""
    problems = []
    if facts.get("version") != version or not facts.get("from_site"):
        where = "its folder" if facts.get("from_site") else "elsewhere"
        problems.append(f"it imported TE {facts.get('version')} from {where}, not {version} from its folder")
    if not facts.get("extension_from_site"):
        problems.append(f"its torch extension from {facts.get('extension') or 'nowhere'}, not from its folder")
    return "; ".join(problems)


def _checked(done: subprocess.CompletedProcess) -> dict | None:
    from attn_doctor.core.processes import last_json_object

    return last_json_object(done.stdout) if done.returncode == 0 else None


def use_prepared_release(environ: Mapping[str, str] | None = None) -> str | None:
    """In a worker, before TE is imported: the prepared release's folder (SITE_VARIABLE) first on the import
    path, so that `import transformer_engine` finds it before the environment's own; the folder, or None."""
    site = (os.environ if environ is None else environ).get(SITE_VARIABLE)
    if site and site not in sys.path:
        sys.path.insert(0, site)
    return site or None


def _inside(path: str | None, folder: str) -> bool:
    return bool(path) and str(Path(path).resolve()).startswith(str(Path(folder).resolve()))


def release_not_honoured(wanted: TEInstall, imported_version: str | None, imported_file: str | None,
                         extension_file: str | None = None) -> str | None:
    """Why the TE a worker imported is not the release asked for (another version, or the environment's copy
    rather than the release's folder, or a prepared release's Python with another copy's torch extension,
    `extension_file` where it is known); None when it is."""
    where = imported_file or "nowhere"
    if not wanted.prepared:  # the environment's own: its version, from no prepared release's folder
        if imported_version != wanted.version or _inside(imported_file, str(te_home())):
            return f"asked for the installed TE {wanted.version}, imported TE {imported_version or '?'} from {where}"
        return None
    if not _inside(imported_file, wanted.site):
        return f"asked for TE {wanted.version} from {wanted.site}, imported TE {imported_version or '?'} from {where}"
    if imported_version != wanted.version:
        return f"asked for TE {wanted.version}, its folder holds TE {imported_version or '?'}"
    if extension_file is not None and not _inside(extension_file, wanted.site):
        return f"TE {wanted.version} from its folder loaded the torch extension {extension_file}, not its own"
    return None


def installs_fact(installs: Iterable[TEInstall] | None = None, home: Path | None = None) -> tuple[str | None, str]:
    """(value, note) for the fingerprint: the installs' labels, or None and where none was found."""
    home = te_home() if home is None else home
    found = list(find_installs(home) if installs is None else installs)
    if not found:
        return None, f"none prepared in {home} (attn-doctor te add VERSION)"
    return "; ".join(install.label() for install in found), f"in {home}"
