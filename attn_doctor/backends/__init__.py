"""The backend registry: every kernel path attn-doctor can check, and the one place that knows them.

Adding a backend is a module in this package (a `Backend` subclass, see `base.py`) and one line in
`REGISTRY`. Everything else reaches backends through the functions below, by spec, never by family name.
"""

from __future__ import annotations

from typing import Any, Callable

from attn_doctor.backends.base import (
    DEFAULT_PROBE_SECONDS,
    Backend,
    BackendSpec,
    ParallelGroups,
    PathMemory,
    ShortCall,
    Unsupported,
)
from attn_doctor.backends.kernel import UserKernel, parse_kernel_spec
from attn_doctor.backends.local import LocalAttention
from attn_doctor.backends.sdpa import SdpaKernel
from attn_doctor.backends.te import CUDNN_MARK, TE_MARK, TEAttention, without_build
from attn_doctor.backends.te_module import TEModule
from attn_doctor.core.case import Case
from attn_doctor.core.errors import BadInput

# Table order: TE paths, PyTorch SDPA kernels, the local baseline; then the user's --kernel ones.
REGISTRY: dict[str, type[Backend]] = {cls.family: cls for cls in (
    TEAttention,
    TEModule,
    SdpaKernel,
    LocalAttention,
    UserKernel,
)}

# What every verdict is relative to: Megatron's local core attention (see attn_doctor/verdict/rule.py).
BASELINE: BackendSpec = LocalAttention.paths()[0]


def backend_class(spec: BackendSpec) -> type[Backend]:
    try:
        return REGISTRY[spec.family]
    except KeyError:
        raise ValueError(f"unknown backend family {spec.family!r}") from None


def builtin_specs() -> list[BackendSpec]:
    """Every built-in row, in table order."""
    return [spec for cls in REGISTRY.values() for spec in cls.paths()]


def path_names() -> tuple[str, ...]:
    """Every name that picks built-in paths, in table order: each family of several paths before its paths
    ("te", "te.flash", "te.fused", ...). A known-defect rule's ``backend`` names these."""
    names: list[str] = []
    for family, cls in REGISTRY.items():
        paths = cls.paths()
        names += ([family] if len(paths) > 1 else []) + [spec.name for spec in paths]
    return tuple(names)


def select(names: list[str] | tuple[str, ...], kernels: list[str] | tuple[str, ...] = (),
           cudnn: str | None = None, te: str | None = None) -> list[BackendSpec]:
    """The specs a user asked for: --backend NAME (a row name, or a family for all its rows; all built-ins
    but the opt-in ones, TE's layers, when neither --backend nor --kernel is given), --kernel
    [NAME=]TARGET:FUNC, --te V1,V2 (TE's paths once per prepared release: `with_te`) and --cudnn B1,B2 (each path
    whose process loads cuDNN, once per build: `with_cudnn`). Unknown names, a kernel name that is taken, a TE
    release not prepared and a cuDNN build that is not here are bad input."""
    specs = _select(names, kernels)
    if te:
        specs = with_te(specs, _listed(te))
    return with_cudnn(specs, _listed(cudnn)) if cudnn else specs


def _listed(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def with_te(specs: list[BackendSpec], requests: list[str]) -> list[BackendSpec]:
    """Each of TE's paths once per requested release (prepared with `attn-doctor te add`, or the environment's own),
    named "te.fused@te-2.18.0"; the others as they are."""
    def releases() -> list:
        from attn_doctor.machine.te_installs import choices, resolve

        found = choices()
        return list({install.version: install for install in (resolve(r, found) for r in requests)}.values())

    return _once_per_choice(specs, "--te picks the TE release TE's paths run", releases, on_release)


def on_release(spec: BackendSpec, install) -> BackendSpec:
    """`spec` (one of TE's paths) on the prepared TE release `install` (a `TEInstall`), named for it."""
    path, mark, build = spec.name.partition(CUDNN_MARK)  # a cuDNN build chosen too keeps its part of the name
    return BackendSpec(f"{path.split(TE_MARK)[0]}{TE_MARK}{install.version}{mark}{build}", spec.family,
                       {**spec.options, "te": install.to_dict()})


def with_cudnn(specs: list[BackendSpec], requests: list[str]) -> list[BackendSpec]:
    """Each spec whose process loads cuDNN (TE's paths), once per requested build (a version or a path, see
    `attn_doctor.machine.cudnn_builds.resolve`), named "te.fused@cudnn-9.19.0"; the others as they are."""
    def builds() -> list:
        from attn_doctor.machine.cudnn_builds import find_builds, resolve

        found = find_builds()
        return list({build.directory: build for build in (resolve(r, found) for r in requests)}.values())

    return _once_per_choice(specs, "--cudnn picks the cuDNN build TE's paths load", builds, on_build)


def _once_per_choice(specs: list[BackendSpec], picks: str, choose: Callable[[], list],
                     on: Callable[[BackendSpec, Any], BackendSpec]) -> list[BackendSpec]:
    """Each spec whose process loads cuDNN (TE's paths) once per choice `choose` gives (`on` makes it), the others
    as they are; BadInput before choosing when no such spec is selected (`picks`: what the option picks)."""
    if not any(backend_class(spec).loads_cudnn for spec in specs):
        raise BadInput(f"{picks}, and none is selected; add --backend te")
    choices = choose()
    chosen: list[BackendSpec] = []
    for spec in specs:
        chosen += [on(spec, choice) for choice in choices] if backend_class(spec).loads_cudnn else [spec]
    return chosen


def on_build(spec: BackendSpec, build) -> BackendSpec:
    """`spec` (a path whose process loads cuDNN, maybe on a TE release of its own) on the cuDNN build `build` (a
    `CudnnBuild`), named for it."""
    name = spec.name.split(CUDNN_MARK)[0]
    label = build.version or build.directory.rstrip("/").rsplit("/", 1)[-1]
    return BackendSpec(f"{name}{CUDNN_MARK}{label}", spec.family, {**spec.options, "cudnn": build.to_dict()})


def _select(names: list[str] | tuple[str, ...], kernels: list[str] | tuple[str, ...]) -> list[BackendSpec]:
    kernel_specs = [parse_kernel_spec(text) for text in kernels]
    chosen: list[BackendSpec] = []
    known = {spec.name: spec for spec in builtin_specs()}
    if names or not kernel_specs:
        if not names:  # every built-in path but those run only when named (`Backend.opt_in`)
            chosen = [spec for spec in known.values() if not backend_class(spec).opt_in]
        for name in names:
            family = REGISTRY.get(name)
            if family is not None and family.paths():
                chosen += family.paths()
            elif name in known:
                chosen.append(known[name])
            else:
                families = ", ".join(f"'{f}'" for f, cls in REGISTRY.items() if len(cls.paths()) > 1)
                raise BadInput(f"unknown backend {name!r}; choose from {', '.join(known)} (or {families}), "
                               "or pass your own with --kernel")
    chosen = list({spec.name: spec for spec in chosen}.values())
    taken = [spec.name for spec in chosen] + [BASELINE.name]  # the baseline runs whatever was chosen
    for spec in kernel_specs:
        if spec.name in taken:
            raise BadInput(f"--kernel name {spec.name!r} is taken; give it another with NAME=TARGET:FUNC")
        taken.append(spec.name)
    return chosen + kernel_specs


def build(spec: BackendSpec) -> Backend:
    """Instantiate a backend inside a worker process (the library is loaded here, not in the parent)."""
    return backend_class(spec)(spec)


def static_skip(spec: BackendSpec, case: Case, device: str) -> str | None:
    return backend_class(spec).static_skip(spec, case, device)


def memory(spec: BackendSpec, case: Case) -> PathMemory:
    return backend_class(spec).memory(spec, case)


def selector(spec: BackendSpec) -> str:
    return backend_class(spec).selector(spec)


def repro_source(spec: BackendSpec) -> str:
    return backend_class(spec).repro_source(spec)


def short_call(spec: BackendSpec, case: Case) -> ShortCall | None:
    return backend_class(spec).short_call(spec, case)


def match_format(spec: BackendSpec, case: Case) -> str | None:
    """The qkv_format known-defect rules are matched with for this spec on this case (None: not a TE path)."""
    cls = backend_class(spec)
    return cls.format_for(case) if cls.match_format is not None else None


def match_context(spec: BackendSpec) -> dict:
    return backend_class(spec).match_context(spec)


def own_layout(spec: BackendSpec) -> str | None:
    """The one layout a layer path is planned on (`Backend.own_layout`); None: the run's layouts."""
    return backend_class(spec).own_layout(spec)


def probe_seconds(spec: BackendSpec) -> float:
    """About how long one probe of the spec takes its worker on a GPU (`Backend.probe_seconds`)."""
    return backend_class(spec).probe_seconds.get(spec.name, DEFAULT_PROBE_SECONDS)


def is_layer_path(spec: BackendSpec) -> bool:
    """Whether the spec is a whole layer around the attention (`Backend.layer_path`), judged on its own yardsticks."""
    return spec.family in REGISTRY and backend_class(spec).layer_path


def is_te_family(family: str) -> bool:
    """Whether a family's paths are Transformer Engine's (its DotProductAttention paths, and its layers)."""
    return family in (TEAttention.family, TEModule.family)


def flash_style(spec: BackendSpec) -> bool:
    """Whether the spec's backward takes D from the output it returned (`Backend.flash_style`)."""
    return backend_class(spec).flash_style(spec)


def process_of(spec: BackendSpec) -> tuple[str, dict[str, str]]:
    """The worker process a spec runs in: a key naming it ("te", or "te with TE 2.18.0 with cuDNN from DIR") and
    the variables it starts with. The environment's own TE release (`--te` naming it) starts no process of its own."""
    from attn_doctor.machine.te_installs import SITE_VARIABLE

    environment = backend_class(spec).process_environment(spec)
    cudnn, release = spec.options.get("cudnn"), spec.options.get("te")
    key = spec.family + (f" with TE {release['version']}" if SITE_VARIABLE in environment else "") + (
        f" with cuDNN from {cudnn['directory']}" if environment and cudnn else "")
    return key, environment


def prepare_process(family: str) -> dict:
    """Run a family's process preparation (first thing in a worker or rank process); facts it reports."""
    return REGISTRY[family].prepare_process()


__all__ = ["Backend", "BackendSpec", "ParallelGroups", "PathMemory", "ShortCall", "Unsupported", "BASELINE", "REGISTRY",
           "backend_class", "builtin_specs", "path_names", "select", "build", "static_skip", "memory", "selector",
           "repro_source", "short_call", "match_format", "probe_seconds", "match_context", "flash_style",
           "prepare_process", "process_of",
           "with_cudnn", "on_build", "with_te", "on_release", "without_build", "CUDNN_MARK", "TE_MARK", "own_layout",
           "is_layer_path", "is_te_family"]
