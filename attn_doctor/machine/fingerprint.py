"""Machine fingerprint: driver, GPUs, torch, Transformer Engine, flash-attn, env vars.

Pure collection; nothing here raises. A fact that could not be collected is a
``Fact(None, note)`` whose note says why. TE is read in a subprocess
(:data:`TE_FACTS_CMD`) because importing it can fail, hang, or load a second cuDNN
into a process that already has torch's.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from attn_doctor.machine.cudnn_builds import decode_cudnn_version
from attn_doctor.machine.te_facts import dist_version, te_package_versions

#: The command that reads TE's facts in a subprocess; tests replace it. Must print a JSON object last on stdout.
TE_FACTS_CMD: list[str] = [sys.executable, "-m", "attn_doctor.machine.te_facts"]

ENV_PREFIXES = ("NVTE_", "CUDNN_", "CUDA_", "TORCH_", "PYTORCH_", "NCCL_")
# Words that make a variable's name suggest a secret: such variables are never collected, and reports
# redact them wherever they appear (`attn_doctor.render.redact`).
ENV_DENY = ("SECRET", "TOKEN", "PASSWORD", "PASSWD", "KEY", "API", "CREDENTIAL", "AUTH", "PRIVATE", "COOKIE",
            "SESSION")


def looks_secret(name: str) -> bool:
    """Whether an environment variable's name suggests that its value is a secret."""
    return any(word in name.upper() for word in ENV_DENY)

FLASH_ATTN_DISTS: dict[str, tuple[str, ...]] = {
    "v2": ("flash-attn",),
    "v3": ("flash-attn-3", "flashattn-hopper"),  # HEAD name, TE v2.1 name
    "v4": ("flash-attn-4",),
}

NOT_INSTALLED = "not installed"
LATER_FACTS = ("cpu", "os", "cudnn_builds", "te_installs")  # facts older results documents do not have
IDENTITY_KEYS = ("hostname", "user", "home")  # who and where: recorded only so that reports can redact them
NOT_PROBED = "not probed"  # a fact nobody asked for (the words every results document has used)


@dataclass(frozen=True)
class Fact:
    """One collected fact, or why it is missing."""

    value: str | None = None  # the fact as text; None when it could not be collected
    note: str | None = None  # why it is missing, or a warning about the value

    @classmethod
    def from_dict(cls, d: Mapping | None) -> Fact:
        if not isinstance(d, Mapping):
            return cls(None, "not recorded")
        return cls(_opt_str(d.get("value")), _opt_str(d.get("note")))


@dataclass(frozen=True)
class SeenCudnnBuild:
    """One cuDNN build as `env` reports it: its version (and how that was read), its folder and main library,
    where it was found ("system", "pip nvidia-cudnn-cu13 9.19.0.56", "CUDNN_HOME", or "loaded, not found by the
    search" for a library a process mapped that no folder searched holds), and which processes load it ("TE",
    "torch"), read back from their memory maps."""

    version: str | None
    path: str
    library: str
    source: str
    version_from: str = ""
    loaded_by: tuple[str, ...] = ()

    def label(self) -> str:
        """"9.14.0 (/lib/x86_64-linux-gnu; system): TE loads it"."""
        users = ""
        if self.loaded_by:
            users = f": {' and '.join(self.loaded_by)} load{'s' * (len(self.loaded_by) == 1)} it"
        return f"{self.version or 'version unknown'} ({self.path}; {self.source}){users}"

    @classmethod
    def from_dict(cls, d: Mapping) -> SeenCudnnBuild:
        return cls(_opt_str(d.get("version")), str(d.get("path", "")), str(d.get("library", "")),
                   str(d.get("source", "")), str(d.get("version_from", "")),
                   tuple(str(who) for who in d.get("loaded_by") or ()))


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it (NVML indices ignore CUDA_VISIBLE_DEVICES)."""

    index: int
    name: str
    sm: str  # e.g. "sm_90"
    memory_total_mib: int


@dataclass(frozen=True)
class EnvReport:
    """The machine fingerprint stored with every result."""

    python: Fact
    platform: Fact
    driver: Fact
    gpus: tuple[GpuInfo, ...]
    gpus_note: str | None
    torch: Fact
    torch_cuda: Fact
    torch_cudnn: Fact
    cuda_available: Fact
    te: Fact
    te_core: Fact
    te_torch: Fact
    te_cudnn: Fact
    flash_attn: dict[str, Fact] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    # Collected since the fingerprint first had them; None in documents written before.
    cpu: Fact | None = None  # model and core count
    os: Fact | None = None  # the distribution's name and version
    cudnn_builds: tuple[SeenCudnnBuild, ...] | None = None  # every cuDNN build found, and which TE and torch load
    cudnn_builds_note: str | None = None  # why none is listed (none found, or the search failed)
    te_installs: Fact | None = None  # the TE releases prepared beside the environment (`attn-doctor te add`)
    # The machine's hostname, the user and their home folder (IDENTITY_KEYS): never shown, recorded so that
    # a report pasted elsewhere can redact them (`attn_doctor.render.redact`); {} in older documents.
    identity: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        """JSON-able view (a fact that was not collected, in a document older than it, stays out)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if not (k in LATER_FACTS and v is None) and not (k == "identity" and not v)
                and not (k == "cudnn_builds_note" and v is None)}

    @classmethod
    def from_dict(cls, d: dict) -> EnvReport:
        """Inverse of :meth:`to_dict`; tolerant of missing keys from older files."""
        fact_names = [
            f.name for f in dataclasses.fields(cls)
            if f.name not in ("gpus", "gpus_note", "flash_attn", "env_vars", "identity", "cudnn_builds_note",
                              *LATER_FACTS)
        ]
        facts = {name: Fact.from_dict(d.get(name)) for name in fact_names}
        facts.update({name: Fact.from_dict(d[name]) for name in LATER_FACTS
                      if d.get(name) is not None and name != "cudnn_builds"})
        builds, builds_note = d.get("cudnn_builds"), _opt_str(d.get("cudnn_builds_note"))
        if isinstance(builds, Mapping):  # written as one sentence (a Fact) before it was a list
            builds, builds_note = [], _opt_str(builds.get("value")) or _opt_str(builds.get("note"))
        if builds is not None:
            facts["cudnn_builds"] = tuple(SeenCudnnBuild.from_dict(b) for b in builds if isinstance(b, Mapping))
            facts["cudnn_builds_note"] = builds_note
        gpus = []
        for g in d.get("gpus") or ():
            try:
                gpus.append(
                    GpuInfo(
                        index=int(g["index"]),
                        name=str(g["name"]),
                        sm=str(g["sm"]),
                        memory_total_mib=int(g["memory_total_mib"]),
                    )
                )
            except (KeyError, TypeError, ValueError):
                continue
        flash = {str(k): Fact.from_dict(v) for k, v in (d.get("flash_attn") or {}).items()}
        env_vars = {str(k): str(v) for k, v in (d.get("env_vars") or {}).items()}
        identity = d.get("identity") if isinstance(d.get("identity"), Mapping) else {}
        return cls(
            gpus=tuple(gpus),
            gpus_note=_opt_str(d.get("gpus_note")),
            flash_attn=flash,
            env_vars=env_vars,
            identity={str(k): str(v) for k, v in identity.items() if k in IDENTITY_KEYS and v},
            **facts,
        )


def _opt_str(v: object) -> str | None:
    return None if v is None else str(v)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


# --------------------------------------------------------------------------- NVML


def _nvml_query(func, *args):
    """nvitop-style: ``(result, None)`` or ``(None, error text)``; never raises."""
    try:
        result = func(*args)
    except Exception as exc:
        return None, _first_line(exc)
    if isinstance(result, bytes):  # older pynvml returned bytes
        result = result.decode(errors="replace")
    return result, None


def _collect_nvml() -> tuple[Fact, tuple[GpuInfo, ...], str | None]:
    """Driver version and GPU list from NVML."""
    try:
        import pynvml
    except Exception as exc:
        note = f"nvidia-ml-py not usable: {_first_line(exc)}"
        return Fact(None, note), (), note

    try:
        pynvml.nvmlInit()
    except Exception as exc:
        err = _first_line(exc)
        no_driver = (
            getattr(pynvml, "NVMLError_LibraryNotFound", ()),
            getattr(pynvml, "NVMLError_DriverNotLoaded", ()),
        )
        if isinstance(exc, tuple(t for t in no_driver if isinstance(t, type))):
            return Fact(None, f"no NVIDIA driver: {err}"), (), f"no NVIDIA driver (NVML: {err})"
        return Fact(None, f"NVML init failed: {err}"), (), f"NVML init failed: {err}"

    try:
        version, err = _nvml_query(pynvml.nvmlSystemGetDriverVersion)
        driver = Fact(str(version), None) if version else Fact(None, f"NVML: {err}")

        count, err = _nvml_query(pynvml.nvmlDeviceGetCount)
        if count is None:
            return driver, (), f"NVML device count failed: {err}"
        gpus: list[GpuInfo] = []
        problems: list[str] = []
        for i in range(int(count)):
            handle, err = _nvml_query(pynvml.nvmlDeviceGetHandleByIndex, i)
            if handle is None:
                problems.append(f"GPU {i}: {err}")
                continue
            name, err_name = _nvml_query(pynvml.nvmlDeviceGetName, handle)
            cc, err_cc = _nvml_query(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
            mem, err_mem = _nvml_query(pynvml.nvmlDeviceGetMemoryInfo, handle)
            for what, e in (("name", err_name), ("compute capability", err_cc), ("memory", err_mem)):
                if e:
                    problems.append(f"GPU {i} {what}: {e}")
            sm = f"sm_{cc[0]}{cc[1]}" if cc else "sm_?"
            mib = int(mem.total) // (1024 * 1024) if mem is not None else 0
            gpus.append(GpuInfo(index=i, name=str(name) if name else "unknown", sm=sm, memory_total_mib=mib))
        if not gpus and not problems:
            problems.append("NVML reports no GPUs")
        return driver, tuple(gpus), "; ".join(problems) or None
    finally:
        _nvml_query(pynvml.nvmlShutdown)


# --------------------------------------------------------------------------- torch


def _format_cudnn(encoded: int) -> str:
    return f"{decode_cudnn_version(encoded)} ({encoded})"


def _collect_torch() -> tuple[Fact, Fact, Fact, Fact]:
    """torch version, its CUDA, its cuDNN, and whether CUDA is usable."""
    try:
        import torch
    except Exception as exc:
        note = f"torch import failed: {_first_line(exc)}"
        return Fact(None, note), Fact(None, note), Fact(None, note), Fact(None, note)

    version = Fact(str(torch.__version__))
    cuda_built = getattr(torch.version, "cuda", None)
    torch_cuda = Fact(str(cuda_built)) if cuda_built else Fact(None, "CPU-only build")

    try:
        encoded = torch.backends.cudnn.version()
    except Exception as exc:
        torch_cudnn = Fact(None, f"cuDNN query failed: {_first_line(exc)}")
    else:
        if encoded:
            torch_cudnn = Fact(_format_cudnn(int(encoded)))
        else:
            torch_cudnn = Fact(None, "CPU-only build" if not cuda_built else "cuDNN not available to torch")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            available = bool(torch.cuda.is_available())
            err = None
        except Exception as exc:
            available, err = False, _first_line(exc)
    if available:
        cuda_available = Fact("yes")
    else:
        why = err or next((_first_line(Exception(w.message)) for w in caught), None)
        if why is None and not cuda_built:
            why = "CPU-only build"
        cuda_available = Fact("no", why)
    return version, torch_cuda, torch_cudnn, cuda_available


# --------------------------------------------------------------------------- TE


def _read_te_in_subprocess(cmd: Sequence[str], timeout_s: float) -> dict:
    """Run the command that reads TE's facts; returns its JSON dict, or ``{"error": why}``."""
    from attn_doctor.core import processes

    try:
        done = processes.run_collect(cmd, timeout_s, env=processes.child_env({"PYTHONWARNINGS": "ignore"}))
    except OSError as exc:
        return {"error": f"reading TE's facts could not start: {_first_line(exc)}"}
    except Exception as exc:
        return {"error": f"reading TE's facts failed: {_first_line(exc)}"}
    if done.returncode is None:
        return {"error": f"reading TE's facts timed out after {timeout_s:g}s"}
    facts = processes.last_json_object(done.stdout)
    if facts is not None:
        return facts
    why = f"reading TE's facts exited with {processes.describe_exit(done.returncode)}"
    last_err = next((ln.strip() for ln in reversed(done.stderr.splitlines()) if ln.strip()), None)
    if last_err:
        why += f": {last_err}"
    return {"error": why}


def _version_fact(value: object) -> Fact:
    return Fact(str(value)) if value else Fact(None, NOT_INSTALLED)


def _collect_te(
    read_te: bool, te_facts: Mapping | None, timeout_s: float, te_facts_cmd: Sequence[str] | None,
    reported_into: dict | None = None,
) -> tuple[Fact, Fact, Fact, Fact]:
    """te, te_core, te_torch, te_cudnn. Versions come from metadata, refined by what TE reported in its subprocess
    (kept in `reported_into`)."""
    try:
        meta = te_package_versions()
    except Exception:
        meta = {"te": None, "te_core": None, "te_torch": None}

    if te_facts is not None:
        reported: Mapping | None = te_facts
    elif read_te:
        reported = _read_te_in_subprocess(te_facts_cmd if te_facts_cmd is not None else TE_FACTS_CMD, timeout_s)
    else:
        reported = None

    if reported_into is not None and reported is not None:
        reported_into.update(reported)
    if reported is None:
        return (
            _version_fact(meta.get("te")),
            _version_fact(meta.get("te_core")),
            _version_fact(meta.get("te_torch")),
            Fact(None, NOT_PROBED),
        )

    error = _opt_str(reported.get("error"))
    te = _version_fact(reported.get("te") or meta.get("te"))
    if te.value and error and not reported.get("te_cudnn"):
        te = Fact(te.value, "installed, but reading it failed (see TE cuDNN)")
    te_core = _version_fact(reported.get("te_core") or meta.get("te_core"))
    te_torch = _version_fact(reported.get("te_torch") or meta.get("te_torch"))

    encoded = reported.get("te_cudnn_int")
    text = reported.get("te_cudnn")
    try:
        cudnn_value = _format_cudnn(int(encoded)) if encoded not in (None, "") else _opt_str(text)
    except (TypeError, ValueError):
        cudnn_value = _opt_str(text)
    te_cudnn = Fact(cudnn_value, None) if cudnn_value else Fact(None, error or "TE reported no cuDNN version")
    return te, te_core, te_torch, te_cudnn


def _loaded_cudnn() -> list[str]:
    from attn_doctor.machine.cudnn_builds import loaded_libraries

    return loaded_libraries()


def _collect_te_installs() -> Fact:
    from attn_doctor.machine.te_installs import installs_fact

    return Fact(*installs_fact())


def _collect_cudnn_builds(te_libraries: list[str], torch_libraries: list[str], te_version: str | None = None,
                          torch_version: str | None = None) -> tuple[tuple[SeenCudnnBuild, ...], str | None]:
    """Every cuDNN build found (`attn_doctor.machine.cudnn_builds`), each with the processes (TE's, torch's) that
    load it: of the libcudnn a process mapped, the one whose build has the version that process's library
    reported (TE's process maps torch's copy too, and TE may load another), else the first. A library a process
    mapped from a folder the search does not cover is listed too. The note says why the list is empty."""
    from attn_doctor.machine.cudnn_builds import build_of, find_builds

    builds = find_builds()
    users: dict[str, list[str]] = {}
    for who, libraries, version in (("TE", te_libraries, te_version), ("torch", torch_libraries, torch_version)):
        mapped = [(library, build_of(library, builds)) for library in libraries]
        chosen = next((pair for pair in mapped if version and pair[1] and pair[1].version == version), None)
        for library, build in ([chosen] if chosen else mapped[:1]):
            users.setdefault(build.directory if build else library, []).append(who)
    seen = [SeenCudnnBuild(b.version, b.directory, b.library, ", ".join(b.origins) or "given", b.version_from,
                           tuple(users.get(b.directory, ()))) for b in builds]
    seen += [SeenCudnnBuild(None, str(Path(library).parent), library, "loaded, not found by the search", "",
                            tuple(who)) for library, who in users.items()
             if not any(b.directory == library for b in builds)]
    note = None if seen else "no libcudnn found (system folders, CUDNN_HOME/CUDNN_PATH/CUDA_HOME/CUDA_PATH, pip)"
    return tuple(seen), note


def _cudnn_triplet(fact: Fact) -> str | None:
    return fact.value.split()[0] if fact.value else None


def _flag_cudnn_mismatch(te_cudnn: Fact, torch_cudnn: Fact) -> Fact:
    te_v, torch_v = _cudnn_triplet(te_cudnn), _cudnn_triplet(torch_cudnn)
    if te_v and torch_v and te_v != torch_v:
        return Fact(
            te_cudnn.value,
            f"differs from torch's cuDNN {torch_v}: two cuDNN libraries are loaded in one process",
        )
    return te_cudnn


# --------------------------------------------------------------------------- rest


def _collect_flash_attn() -> dict[str, Fact]:
    return {key: _version_fact(dist_version(*names)) for key, names in FLASH_ATTN_DISTS.items()}


def collect_env_vars(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Variables with the relevant prefixes, minus anything that looks like a secret."""
    environ = os.environ if environ is None else environ
    return {
        k: v
        for k, v in sorted(environ.items())
        if k.upper().startswith(ENV_PREFIXES) and not looks_secret(k)
    }


def collect_identity() -> dict[str, str]:
    """This machine's hostname, the user and their home folder (what a pasted report must not show)."""
    import getpass
    import socket

    def known(collect) -> str | None:
        try:
            return collect() or None
        except (OSError, KeyError, RuntimeError, ImportError):  # no passwd entry, no HOME: nothing to record
            return None

    collected = {"hostname": known(socket.gethostname), "user": known(getpass.getuser),
                 "home": known(lambda: str(Path.home()))}
    return {key: value for key, value in collected.items() if value}


def _collect_cpu() -> Fact:
    """The CPU's model name and how many logical cores this process may use."""
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            if line.lower().startswith(("model name", "hardware", "cpu model")):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    model = model or platform.processor() or platform.machine() or None
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    cores = f"{usable} logical cores" + (f" of {os.cpu_count()}" if usable != os.cpu_count() else "")
    return Fact(f"{model}, {cores}" if model else cores)


def _collect_os() -> Fact:
    try:
        release = platform.freedesktop_os_release()
        return Fact(release.get("PRETTY_NAME") or f"{release.get('NAME', '')} {release.get('VERSION', '')}".strip())
    except (OSError, AttributeError):
        return Fact(f"{platform.system()} {platform.release()}".strip() or None, None)


def _safe(fn, fallback):
    try:
        return fn()
    except Exception as exc:  # belt and braces: collect_env must never raise
        return fallback(_first_line(exc))


def collect_env(
    *,
    read_te: bool = True,
    te_facts: dict | None = None,
    timeout_s: float = 120.0,
    te_facts_cmd: Sequence[str] | None = None,
) -> EnvReport:
    """Collect the machine fingerprint; never raises.

    ``te_facts``: a dict from :func:`attn_doctor.machine.te_facts.loaded_te_facts` produced in a
    process that already imported TE; used instead of spawning the probe.
    ``te_facts_cmd``: overrides :data:`TE_FACTS_CMD`.
    """
    python = _safe(
        lambda: Fact(f"{platform.python_version()} ({platform.python_implementation()})"),
        lambda e: Fact(None, e),
    )
    plat = _safe(lambda: Fact(platform.platform()), lambda e: Fact(None, e))
    cpu = _safe(_collect_cpu, lambda e: Fact(None, e))
    os_name = _safe(_collect_os, lambda e: Fact(None, e))
    driver, gpus, gpus_note = _safe(_collect_nvml, lambda e: (Fact(None, e), (), e))
    torch_v, torch_cuda, torch_cudnn, cuda_available = _safe(_collect_torch, lambda e: (Fact(None, e),) * 4)
    torch_libraries = _safe(_loaded_cudnn, lambda e: [])  # after torch read its cuDNN version, in this process
    reported: dict = {}
    te, te_core, te_torch, te_cudnn = _safe(
        lambda: _collect_te(read_te, te_facts, timeout_s, te_facts_cmd, reported), lambda e: (Fact(None, e),) * 4
    )
    cudnn_builds, cudnn_builds_note = _safe(
        lambda: _collect_cudnn_builds(reported.get("te_cudnn_libraries") or [], torch_libraries,
                                      _cudnn_triplet(te_cudnn), _cudnn_triplet(torch_cudnn)), lambda e: ((), e))
    te_cudnn = _flag_cudnn_mismatch(te_cudnn, torch_cudnn)
    flash = _safe(_collect_flash_attn, lambda e: {k: Fact(None, e) for k in FLASH_ATTN_DISTS})
    env_vars = _safe(collect_env_vars, lambda e: {})
    identity = _safe(collect_identity, lambda e: {})
    te_installs = _safe(_collect_te_installs, lambda e: Fact(None, e))
    return EnvReport(
        python=python,
        platform=plat,
        driver=driver,
        gpus=gpus,
        gpus_note=gpus_note,
        torch=torch_v,
        torch_cuda=torch_cuda,
        torch_cudnn=torch_cudnn,
        cuda_available=cuda_available,
        te=te,
        te_core=te_core,
        te_torch=te_torch,
        te_cudnn=te_cudnn,
        flash_attn=flash,
        env_vars=env_vars,
        cpu=cpu,
        os=os_name,
        identity=identity,
        cudnn_builds=cudnn_builds,
        cudnn_builds_note=cudnn_builds_note,
        te_installs=te_installs,
    )
