"""Transformer Engine's DotProductAttention, one backend per kernel path.

A path is forced the way TE's own tests force it: all of NVTE_FLASH_ATTN / NVTE_FUSED_ATTN /
NVTE_UNFUSED_ATTN set to 0 but the chosen one, then `_attention_backends["backend_selection_requires_update"]`
set so TE re-runs its selection in this process (it caches the last choice per AttentionParams).
What ran is read back from `_attention_backends` after the forward, never assumed from the flags, and
the reasons TE gives for disabling a path come from its "DotProductAttention" logger at DEBUG level.

`te.fused.det` is the fused path in TE's deterministic mode: TE reads NVTE_ALLOW_NONDETERMINISTIC_ALGO only
in `DotProductAttention.__init__`, so that path builds its own modules with the variable at 0 (restored right
after construction) and reads back whether TE honoured it: the module's `deterministic`, the `deterministic`
of the AttentionParams TE selected the backend with, and that of the submodule that ran.

A case reaches TE as TE's API takes it: its qkv_format (q, k, v built in that format, thd packed by
`attn_doctor.core.layouts`), mask type, window, MLA head dims, attention_type and softmax_type at construction
(`dpa_arguments`); cu_seqlens (and the padded ones), the explicit mask (True = masked out), the bias or ALiBi
at the call (`forward_arguments`); the learnable sink's values copied into TE's own `softmax_offset`, whose
gradient is the one judged; FP8 through TE's autocast (the probe runs delayed scaling's warm-up step).
These calls are built by `attn_doctor.backends.te_call`, whose source the standalone repro of a TE path
holds, so the repro calls TE as attn-doctor does. `tests/test_te_wiring.py` checks this wiring on the CPU
against a stand-in for DotProductAttention.

TE is imported only inside worker and rank processes (`prepare_process`), before anything touches torch's
cuDNN: a process that already used torch's cuDNN can fail to import TE (two cuDNN builds; see
h200-device-facts.md). Under tensor and context parallelism TE does the splitting and the communication
itself (`run_parallel`): DotProductAttention with tp_group and cp_group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import os
import shlex
import sys
from collections.abc import Iterator
from importlib.metadata import PackageNotFoundError, version
from typing import Any

import torch

from attn_doctor.backends import te_call
from attn_doctor.backends.base import (
    Backend,
    BackendSpec,
    ParallelGroups,
    PathMemory,
    ShortCall,
    Unsupported,
)
from attn_doctor.core import layouts
from attn_doctor.core.case import DTYPE_BYTES, Case
from attn_doctor.core.errors import first_line
from attn_doctor.machine.te_facts import te_installed
from attn_doctor.numerics.masks import Semantics

FLAGS = {"flash": "NVTE_FLASH_ATTN", "fused": "NVTE_FUSED_ATTN", "unfused": "NVTE_UNFUSED_ATTN"}
# Read in DotProductAttention.__init__ (every TE version since 1.x): 0 asks for deterministic algorithms.
NONDETERMINISTIC_FLAG = "NVTE_ALLOW_NONDETERMINISTIC_ALGO"
# The submodule of each backend family TE passes `deterministic` to (Unfused is deterministic by itself).
KERNEL_MODULES = {"use_flash_attention": ("flash_attention", "FlashAttention"),
                  "use_fused_attention": ("fused_attention", "FusedAttention")}
# F16_max512_seqlen (0) and F16_arbitrary_seqlen (1); NVTE_FUSED_ATTN_BACKEND chose between them up to
# TE 2.15 and only when both sequence lengths are <= 512. The max512 sub-backend was removed in 2.16 (#2949).
FUSED_SUB_BACKENDS = {"0": "F16_max512_seqlen", "1": "F16_arbitrary_seqlen", "2": "FP8"}
LAST_TE_WITH_SUB_BACKEND_CHOICE = (2, 15)
CUDNN_MARK = "@cudnn-"  # a path run on a chosen cuDNN build: "te.fused@cudnn-9.19.0" (`backends.with_cudnn`)


TE_MARK = "@te-"  # a path run on a prepared TE release: "te.fused@te-2.18.0" (`backends.with_te`)


def without_build(name: str) -> str:
    """A path's name without the TE release and cuDNN build it ran on: "te.fused@te-2.18.0@cudnn-9.19.0" ->
    "te.fused"."""
    return name.split(CUDNN_MARK)[0].split(TE_MARK)[0]
NO_BACKEND_MESSAGE = "No dot product attention backend is available"
# TE's unfused path runs FP8 attention only as an emulation, behind this variable (TE 2.x).
UNFUSED_FP8_EMULATION = "NVTE_UnfusedDPA_Emulate_FP8"


def te_version() -> tuple[int, int] | None:
    try:
        parts = version("transformer-engine").split(".")
        return int(parts[0]), int(parts[1])
    except (PackageNotFoundError, ValueError, IndexError):
        return None


# The FlashAttention packages TE's flash path can run, by major version, and the variable that turns each off
# (NVTE_FLASH_ATTN_V2/_V3/_V4, read at every backend selection since TE 2.18; TE before that has no such choice).
FLASH_PACKAGES = {"2": ("flash-attn",), "3": ("flash-attn-3", "flashattn-hopper"), "4": ("flash-attn-4",)}
FIRST_TE_WITH_FLASH_CHOICE = (2, 18)


@functools.cache
def flash_versions_installed() -> tuple[str, ...]:
    """The FlashAttention major versions installed here (package metadata only: nothing is imported), read once
    per process: every forward of the flash path asks (`path_environment`)."""
    found = []
    for major, packages in FLASH_PACKAGES.items():
        for package in packages:
            try:
                version(package)
            except PackageNotFoundError:
                continue
            found.append(major)
            break
    return tuple(found)


def te_paths() -> list[tuple[str, dict]]:
    """(row name, options) of every TE kernel path the installed TE lets a user choose: with several
    FlashAttention versions installed, the flash path on each of them too ("te.flash.fa3", ...)."""
    paths = [("te.flash", {"path": "flash"}), ("te.fused", {"path": "fused"}),
             ("te.fused.det", {"path": "fused", "deterministic": True}), ("te.unfused", {"path": "unfused"})]
    installed = te_version()
    if installed is not None and installed <= LAST_TE_WITH_SUB_BACKEND_CHOICE:
        paths.insert(2, ("te.fused.max512", {"path": "fused", "sub_backend": "0"}))
    flash = flash_versions_installed()
    if len(flash) > 1 and installed is not None and installed >= FIRST_TE_WITH_FLASH_CHOICE:
        paths[1:1] = [(f"te.flash.fa{major}", {"path": "flash", "flash_version": major}) for major in flash]
    return paths


class LogLines(logging.Handler):
    """Keeps the messages of the log records it is given (TE's "DotProductAttention" logger's)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _TE:
    """TE's modules and our hooks into them, set up once per worker process."""

    def __init__(self) -> None:
        self.te = importlib.import_module("transformer_engine.pytorch")
        try:  # TE >= 2.3
            self.dpa_module = importlib.import_module(
                "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
            )
            utils = importlib.import_module("transformer_engine.pytorch.attention.dot_product_attention.utils")
        except ImportError:  # TE <= 2.2 kept everything in one module
            self.dpa_module = importlib.import_module("transformer_engine.pytorch.attention")
            utils = self.dpa_module
        # get_attention_backend re-sets the logger level from this import-time value on every call.
        logging_cls = getattr(utils, "AttentionLogging", None)
        if logging_cls is not None:
            logging_cls._log_level = logging.DEBUG
        self.flash_utils = getattr(utils, "FlashAttentionUtils", None)
        self.capture = LogLines()
        logger = logging.getLogger("DotProductAttention")
        logger.addHandler(self.capture)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False

    @property
    def state(self) -> dict:
        return self.dpa_module._attention_backends


_te: _TE | None = None
_import_error: str | None = None  # why `prepare_process` could not import TE in this process
_te_facts: dict = {}  # what `prepare_process` read of the TE it loaded (versions, cuDNN and its files)


def load_te() -> _TE:
    global _te
    if _te is None:
        _te = _TE()
    return _te


# What ran is read back: where TE's unfused path took an FP8 case asked with the F16 backward, its row is a SKIP, not a
# verdict against the F16 backward's yardstick. UnfusedDotProductAttention emulates FP8 in its backward whatever
# NVTE_FP8_DPA_BWD says (FP8EmulationFunc quantises dO and dP, TE 2.20; only FusedAttention reads the flag): judged
# as an F16 backward its correct FP8 gradients failed (the H100's te-tests, 76 of 80 such rows).
UNFUSED_FP8_BACKWARD = ("TE: UnfusedDotProductAttention computes FP8's backward whatever NVTE_FP8_DPA_BWD says (its FP8 "
                        "emulation quantises dO and dP); the F16 backward is FusedAttention's: drop --fp8-backward "
                        "f16 to judge it")


def describe_state(state: dict) -> str:
    if state.get("use_flash_attention"):
        return f"FlashAttention (version {state.get('flash_attention_backend')})"
    if state.get("use_fused_attention"):
        sub = state.get("fused_attention_backend")
        sub_value = str(int(sub)) if sub is not None else "?"
        return f"FusedAttention (sub-backend {sub_value}: {FUSED_SUB_BACKENDS.get(sub_value, 'unknown')})"
    if state.get("use_unfused_attention"):
        return "UnfusedDotProductAttention"
    return "no backend"


def describe_layout(state: dict) -> str:
    """The qkv_layout TE detected for the last call (its AttentionParams), as "; layout sbhd_sbhd_sbhd"."""
    layout = getattr(state.get("attention_params"), "qkv_layout", None)
    return f"; layout {layout}" if layout else ""


@contextlib.contextmanager
def deterministic_mode(on: bool) -> Iterator[None]:
    """NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 while a DotProductAttention is built (TE reads it in __init__ only),
    then the variable as it was, so that no other path of this process inherits it. Nothing when `on` is False."""
    if not on:
        yield
        return
    saved = os.environ.get(NONDETERMINISTIC_FLAG)
    os.environ[NONDETERMINISTIC_FLAG] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NONDETERMINISTIC_FLAG, None)
        else:
            os.environ[NONDETERMINISTIC_FLAG] = saved


def _flag(obj: object) -> bool | None:
    value = getattr(obj, "deterministic", None) if obj is not None else None
    return value if isinstance(value, bool) else None


def read_determinism(module: object, state: dict, requested: bool) -> dict[str, Any]:
    """Whether TE ran the last forward of `module` in deterministic mode, read back from TE (never assumed
    from the flag): DotProductAttention.deterministic (what __init__ read), the `deterministic` of the
    AttentionParams TE selected the backend with (its determinism filter ran on it) and that of the backend
    submodule that ran (what reaches the kernel). {} when neither asked for nor reported."""
    facts: dict[str, Any] = {"module": _flag(module), "selection": _flag(state.get("attention_params"))}
    for key, (attr, name) in KERNEL_MODULES.items():
        if state.get(key):
            facts["kernel"] = _flag(getattr(module, attr, None))
            facts["kernel_module"] = name
    if not requested and facts["module"] is not True:
        return {}
    checks = {"DotProductAttention.deterministic": facts["module"],
              "the backend selection's AttentionParams.deterministic": facts["selection"]}
    if "kernel" in facts:
        checks[f"{facts['kernel_module']}.deterministic"] = facts["kernel"]
    facts["requested"] = requested
    facts["honoured"] = all(value is True for value in checks.values())
    facts["not_honoured_by"] = [f"{name} is {'not reported' if value is None else value}"
                                for name, value in checks.items() if value is not True]
    return facts


def describe_determinism(facts: dict[str, Any]) -> str:
    """The part of a TE row's `ran` text that says whether deterministic mode was honoured."""
    if not facts:
        return ""
    if facts["honoured"]:
        return ", deterministic"
    return ", deterministic requested, not honoured (" + "; ".join(facts["not_honoured_by"]) + ")"


def dpa_arguments(case: Case) -> dict:
    """DotProductAttention's constructor arguments for a case (no dropout), before any TP/CP ones."""
    return te_call.module_arguments(case.plain())


def forward_arguments(case: Case, semantics: Semantics | None, device: torch.device) -> dict:
    """DotProductAttention.forward's keyword arguments for the case's lengths, masks, bias and num_splits."""
    if semantics is None:
        return {}
    cu_seqlens = layouts.packing(case, semantics.slots).cu_seqlens_arguments() if case.padded else {}
    return te_call.forward_arguments(case.plain(), cu_seqlens, semantics.allowed, semantics.bias, device,
                                     semantics.alibi_slopes)


def path_environment(path: str, flash_version: str | None = None) -> dict[str, str]:
    """The variables that force one TE path the way TE's own tests do: only its flag on (and of the flash path's
    FlashAttention versions, only `flash_version`'s where one is chosen); and TE's unfused path is its FP8
    emulation (otherwise disabled under FP8)."""
    flags = {flag: "1" if name == path else "0" for name, flag in FLAGS.items()}
    if flash_version is not None or path == "flash" and len(flash_versions_installed()) > 1:
        # every version's flag set, so that a path run earlier in this process (te.flash.fa3) cannot narrow a later
        # one's choice (te.flash: TE's own, all on)
        flags.update({f"NVTE_FLASH_ATTN_V{major}": "1" if flash_version in (None, major) else "0"
                      for major in FLASH_PACKAGES})
    return {**flags, UNFUSED_FP8_EMULATION: "1" if path == "unfused" else "0"}


def mxfp8_unavailable(te_module) -> str | None:
    """Why TE cannot run MXFP8 here (TE's own answer, where it has one; else the GPU's compute capability), or
    None."""
    check = getattr(te_module, "is_mxfp8_available", None)
    if callable(check):
        try:
            available, reason = check(return_reason=True)
        except TypeError:  # a TE whose check takes no argument
            available, reason = check(), ""
        return None if available else f"TE: MXFP8 is not available here: {reason or 'TE says so'}"
    major, minor = torch.cuda.get_device_capability()
    return None if major >= 10 else f"MXFP8 attention needs Blackwell (sm100+); this GPU is sm{major}{minor}"


# The TE part of the standalone repro: te_call's source, then the call attn-doctor makes with it.
REPRO_SOURCE = '''

FORMAT = CASE["qkv_format"]
# Force TE's {path} backend the way TE's own tests do: only its flag on, selection cache invalidated.{determinism}
os.environ.update({flags})
{sub_backend}
import contextlib  # noqa: E402
import importlib  # noqa: E402

import transformer_engine.pytorch as te  # noqa: E402  (after the flags: TE reads NVTE_* at import and per call)
from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa  # noqa: E402


'''
REPRO_KERNEL = '''

def kernel(q, k, v, case):
    """TE's DotProductAttention called as attn-doctor calls it (the functions above); FP8 delayed scaling first
    takes one warm-up step on the same inputs and output gradient, whose amaxes give the measured step's scales."""
    global SINK_LEAF, MAX_LOGIT
    dpa._attention_backends["backend_selection_requires_update"] = True
    module = te.DotProductAttention(**module_arguments(case))
    module.train(not case["forward_only"])
    slopes = case_alibi_slopes(case) if case["bias"] == "alibi" else None
    call = forward_arguments(case, CU_SEQLENS, EXPLICIT, BIAS, DEVICE, slopes)
    if case["softmax"] == "learnable":
        SINK_LEAF = load_sink(module, case["sink"])
    if case["fp8"] != "none":
        os.environ.update(fp8_backward_environment(case))
    if case["fp8"] == "delayed":  # TE updates the scales as its autocast exits with gradients enabled only
        with torch.enable_grad(), fp8_autocast(te, case["fp8"]):
            warm, _ = split_outputs(module(q, k, v, **call))
        if not case["forward_only"]:
            torch.autograd.grad(warm, (q, k, v), WARMUP_DOUT.reshape(warm.shape), allow_unused=True)
    with fp8_autocast(te, case["fp8"]):
        out, MAX_LOGIT = split_outputs(module(q, k, v, **call))
    state = dpa._attention_backends
    print("TE ran:", "FusedAttention sub-backend %s" % int(state["fused_attention_backend"])
          if state["use_fused_attention"] else "FlashAttention" if state["use_flash_attention"] else "Unfused",
          "| layout:", getattr(state["attention_params"], "qkv_layout", "?"),
          "| deterministic: DotProductAttention %s, backend selection %s" % (
              getattr(module, "deterministic", "?"), getattr(state["attention_params"], "deterministic", "?")))
    return out.view(*q.shape[:-2], case["heads"], case["head_dim_v"])
'''


class TEAttention(Backend):
    family = "te"
    qkv_format = "sbhd"
    match_format = "sbhd"  # the format known-defect rules about TE are matched with: the one these paths use
    own_parallelism = True
    cp_method = "TE's own CP"
    loads_cudnn = True
    # H100, TE 2.20.2, from a cold start: seconds per probe the plan counts, between te-coverage's and te-tests'
    # (reports/h100/issue51/lease5; TE's own SKIPs count, they are known only in the worker): the fused paths build
    # cuDNN kernels; the flash path was a SKIP there (no FlashAttention), its weight a guess
    probe_seconds = {"te.fused": 0.37, "te.fused.det": 0.14, "te.unfused": 0.11, "te.flash": 0.05}

    # -- in the parent --

    @classmethod
    def paths(cls) -> list[BackendSpec]:
        return [BackendSpec(name, cls.family, options) for name, options in te_paths()]

    @classmethod
    def static_skip(cls, spec: BackendSpec, case: Case, device: str) -> str | None:
        if not device.startswith("cuda"):
            return "TE attention needs a CUDA GPU; this run is on the CPU"
        if not te_installed():
            return "transformer_engine is not installed (pip install 'attn-doctor[te]')"
        return None

    @classmethod
    def format_for(cls, case: Case) -> str:
        return case.qkv_format

    @classmethod
    def memory(cls, spec: BackendSpec, case: Case) -> PathMemory:
        if spec.options["path"] != "unfused":
            return PathMemory()
        # UnfusedDotProductAttention: input-dtype scores, softmax in fp32, probabilities kept for backward.
        scores, item = case.score_elements, DTYPE_BYTES[case.dtype]
        return PathMemory(saved=scores * (4 + item), transient=scores * (4 + 4 + item))

    @classmethod
    def flash_style(cls, spec: BackendSpec) -> bool:
        """FusedAttention (cuDNN) and FlashAttention take D from the output they returned; Unfused differentiates
        its own softmax."""
        return spec.options.get("path") in ("fused", "flash")

    @classmethod
    def match_context(cls, spec: BackendSpec) -> dict[str, Any]:
        return {"deterministic": True} if spec.options.get("deterministic") else {}

    @classmethod
    def selector(cls, spec: BackendSpec) -> str:
        cudnn, release = spec.options.get("cudnn"), spec.options.get("te")
        if not cudnn and not release:
            return super().selector(spec)
        name = without_build(spec.name)
        return (f"--backend {shlex.quote(name)}" + (f" --te {shlex.quote(release['version'])}" if release else "")
                + (f" --cudnn {shlex.quote(cudnn['version'] or cudnn['directory'])}" if cudnn else ""))

    @classmethod
    def process_environment(cls, spec: BackendSpec) -> dict[str, str]:
        """A cuDNN build asked for (`--cudnn`): every lever the loader and TE offer; a prepared TE release (`--te`):
        its folder, put first on the worker's import path before TE loads. What loaded is read back."""
        from attn_doctor.machine.cudnn_builds import CudnnBuild, loader_environment
        from attn_doctor.machine.te_installs import SITE_VARIABLE, TEInstall

        cudnn, release = spec.options.get("cudnn"), spec.options.get("te")
        site = TEInstall.from_dict(release).site if release else ""  # "" for the environment's own TE
        return {**(loader_environment(CudnnBuild.from_dict(cudnn)) if cudnn else {}),
                **({SITE_VARIABLE: site} if site else {})}

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        from attn_doctor.core.source_text import module_body

        options = spec.options
        flags = path_environment(options["path"])
        determinism = ""
        if options.get("deterministic"):  # read when each DotProductAttention is built, as attn-doctor built its
            flags[NONDETERMINISTIC_FLAG] = "0"
            determinism = f"\n# Deterministic mode: {NONDETERMINISTIC_FLAG}=0 when DotProductAttention is built."
        sub = (f'os.environ["NVTE_FUSED_ATTN_BACKEND"] = "{options["sub_backend"]}"'
               if options.get("sub_backend") is not None else 'os.environ.pop("NVTE_FUSED_ATTN_BACKEND", None)')
        return (REPRO_SOURCE.format(path=options["path"], flags=repr(flags), sub_backend=sub, determinism=determinism)
                + module_body(te_call) + REPRO_KERNEL)

    @classmethod
    def short_call(cls, spec: BackendSpec, case: Case) -> ShortCall | None:
        """TE's DotProductAttention with the arguments attn-doctor gives it (`te_call`), written out; the flags and
        TE's import first (TE reads NVTE_* at import and per call)."""
        from attn_doctor.core.source_text import call_lines
        from attn_doctor.numerics.standalone import draw_side_inputs

        options, packing, case = spec.options, layouts.packing(case) if case.padded else None, case.plain()
        flags = {flag: value for flag, value in path_environment(options["path"]).items()
                 if flag != UNFUSED_FP8_EMULATION}  # read under FP8 alone, which the short repro does not cover
        if options.get("deterministic"):  # read when each DotProductAttention is built
            flags[NONDETERMINISTIC_FLAG] = "0"
        if options.get("sub_backend") is not None:
            flags["NVTE_FUSED_ATTN_BACKEND"] = str(options["sub_backend"])
        setup = (f"os.environ.update({flags!r})  # TE's {options['path']} path alone\n"
                 + ("" if options.get("sub_backend") is not None else 'os.environ.pop("NVTE_FUSED_ATTN_BACKEND", None)\n')
                 + "import transformer_engine.pytorch as te\n"
                 "import transformer_engine_torch as tex\n"
                 "from transformer_engine.pytorch.attention.dot_product_attention import dot_product_attention as dpa"
                 "\n")
        module = [f"{name}={'SCALE' if name == 'softmax_scale' else repr(value)}"
                  for name, value in te_call.module_arguments(case).items()]
        cu_seqlens = packing.cu_seqlens_arguments() if packing is not None else {}
        explicit, bias, _ = draw_side_inputs(case, "cpu")  # the arguments attn-doctor gives, named as the script does
        code = {"attention_mask": "~EXPLICIT", "core_attention_bias": "BIAS_IN"}
        forward = ["q", "k", "v"] + [
            f"{name}=" + (code[name] if name in code else f"i32({cu_seqlens[name]})" if name.startswith("cu_seqlens")
                          else repr(value))
            for name, value in te_call.forward_arguments(case, cu_seqlens, explicit, bias, "cpu").items()]
        i32 = ("    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=DEVICE)\n" if cu_seqlens
               else "")
        return ShortCall(case["qkv_format"], setup, (
            "\ndef kernel(q, k, v):  # TE's DotProductAttention, as attn-doctor builds and calls it\n"
            + i32 + call_lines("    module = te.DotProductAttention(", module) + call_lines("    out = module(", forward)
            + "    print(\"TE ran:\", {n: dpa._attention_backends[n] for n in (\"use_fused_attention\", "
            "\"fused_attention_backend\")},\n"
            "          \"on cuDNN\", tex.get_cudnn_version())\n"
            "    return out.view(*q.shape[:-2], H, DV)\n"))

    @classmethod
    def prepare_process(cls) -> dict:
        """TE before anything loads torch's cuDNN; what TE loaded (versions, its own cuDNN) for the
        fingerprint. An import failure is kept, and every TE row of this process is SKIP with it."""
        from attn_doctor.machine.te_facts import loaded_te_facts

        from attn_doctor.machine.te_installs import use_prepared_release

        global _import_error, _te_facts
        use_prepared_release()  # `--te`: that release's folder first on the import path, before TE loads
        try:
            load_te()
        except Exception as exc:  # noqa: BLE001 - any import failure becomes the rows' SKIP reason
            _import_error = first_line(exc)
        _te_facts = loaded_te_facts()
        return {"te_facts": _te_facts}

    # -- in a worker --

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        if _import_error is not None:
            raise Unsupported(f"transformer_engine not importable: {_import_error}")
        self.cudnn = {"cudnn": _te_facts.get("te_cudnn"), "cudnn_libraries": _te_facts.get("te_cudnn_libraries")}
        wanted = spec.options.get("cudnn")
        if wanted:
            from attn_doctor.machine.cudnn_builds import CudnnBuild, not_honoured

            why = not_honoured(CudnnBuild.from_dict(wanted), self.cudnn["cudnn"], self.cudnn["cudnn_libraries"] or [])
            if why:
                raise Unsupported(f"--cudnn not honoured by TE: {why}")
        release = spec.options.get("te")
        if release:  # read back: the TE this process imported, and from where
            from attn_doctor.machine.te_installs import TEInstall, release_not_honoured

            imported = getattr(sys.modules.get("transformer_engine"), "__file__", None)
            extension = getattr(sys.modules.get("transformer_engine_torch"), "__file__", None)
            why = release_not_honoured(TEInstall.from_dict(release), _te_facts.get("te"), imported, extension)
            if why:
                raise Unsupported(f"--te not honoured: {why}")
            self.cudnn["te"] = _te_facts.get("te")
        self.path = spec.options["path"]
        self.flash_version = spec.options.get("flash_version")
        self.sub_backend = spec.options.get("sub_backend")
        self.deterministic = bool(spec.options.get("deterministic", False))
        self._te = load_te()
        self._modules: dict[tuple, torch.nn.Module] = {}
        self._fp8_module: tuple[tuple, torch.nn.Module] | None = None
        self._cp_stream: torch.cuda.Stream | None = None
        self._last = ""
        self._last_module: torch.nn.Module | None = None
        self._max_logit: torch.Tensor | None = None
        self._determinism: dict[str, Any] = {}

    def _module(self, case: Case, **parallel) -> torch.nn.Module:
        # A new module per setting: TE reads some settings (e.g. determinism) only at construction.
        arguments = dpa_arguments(case)
        key = (repr(sorted(arguments.items())), tuple(sorted(parallel)))
        if case.fp8 != "none":
            # FP8 state (recipe, scales, amax history) lives in the module: one module per FP8 case, kept for
            # the case's warm-up and measured steps only, so no case quantises with another's history.
            if self._fp8_module is None or self._fp8_module[0] != (key, case):
                with deterministic_mode(self.deterministic):
                    self._fp8_module = ((key, case), self._te.te.DotProductAttention(**arguments, **parallel))
            return self._fp8_module[1]
        if key not in self._modules:
            with deterministic_mode(self.deterministic):
                self._modules[key] = self._te.te.DotProductAttention(**arguments, **parallel)
        return self._modules[key]

    def _force(self) -> None:
        os.environ.update(path_environment(self.path, self.flash_version))
        if self.sub_backend is not None:
            os.environ["NVTE_FUSED_ATTN_BACKEND"] = self.sub_backend
        else:
            os.environ.pop("NVTE_FUSED_ATTN_BACKEND", None)
        self._te.state["backend_selection_requires_update"] = True
        cache = getattr(getattr(self._te, "dpa_module", None), "_alibi_cache", None)
        if isinstance(cache, dict):  # TE refreshes its ALiBi bias on new max lengths only, not on new lengths
            cache["_alibi_slopes_require_update"] = cache["_alibi_bias_require_update"] = True

    def _call(self, module: torch.nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              fp8: str = "none", **arguments: Any) -> torch.Tensor:
        """The forced path's forward, with TE's own reason when it refuses the case."""
        self._force()
        self._te.capture.lines.clear()
        try:
            with te_call.fp8_autocast(self._te.te, fp8):
                out = module(q, k, v, **arguments)
        except ValueError as exc:
            if NO_BACKEND_MESSAGE not in str(exc):
                raise
            raise Unsupported(self._disabled_reasons() or str(exc)) from None
        except AssertionError as exc:  # TE checks its arguments with asserts before any kernel runs
            raise Unsupported(f"TE refused the call: {first_line(exc) or 'an assertion in its argument checks'}") from None
        self._determinism = read_determinism(module, self._te.state, self.deterministic)
        self._last = describe_state(self._te.state) + describe_layout(self._te.state) + describe_determinism(
            self._determinism)
        return out

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor:
        if case.fp8 == "mxfp8" and (why := mxfp8_unavailable(self._te.te)):
            raise Unsupported(why)
        module = self._module(case)
        module.train(not case.forward_only)  # TE selects backends for inference apart (e.g. FA3's forward-only)
        arguments = forward_arguments(case, semantics, q.device)
        if case.softmax == "learnable" and semantics is not None:
            te_call.load_sink(module, semantics.sink)
        if case.fp8 != "none":
            os.environ.update(te_call.fp8_backward_environment(case.plain()))
        out, self._max_logit = te_call.split_outputs(self._call(module, q, k, v, case.fp8, **arguments))
        if case.fp8_backward == "f16" and describe_state(self._te.state) == "UnfusedDotProductAttention":
            raise Unsupported(UNFUSED_FP8_BACKWARD)
        self._last_module = module
        return out.view(*q.shape[:-2], case.heads, case.head_dim_v)

    def max_logit(self) -> torch.Tensor | None:
        """The max logit per head TE returned with the last output (return_max_logit), or None."""
        return self._max_logit

    def sink_leaf(self, semantics: Semantics) -> torch.Tensor | None:
        """TE's own learnable sink parameter of the module that ran (TE uses it, not the semantics' copy)."""
        return getattr(self._last_module, "softmax_offset", None)

    def run_parallel(self, groups: ParallelGroups, case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     dout: torch.Tensor) -> tuple[list[torch.Tensor], str]:
        """TE's own TP (tp_group; it divides the full head counts by tp_size itself) and CP (cp_group, the
        load-balanced chunks it expects, its own communication)."""
        parallel = dict(tp_size=groups.tp, tp_group=groups.tp_group)
        if groups.cp > 1:
            if self._cp_stream is None:
                self._cp_stream = torch.cuda.Stream()
            parallel.update(cp_group=groups.cp_group, cp_global_ranks=groups.cp_ranks, cp_stream=self._cp_stream,
                            cp_comm_type=groups.cp_comm_type)
        module = self._module(dataclasses.replace(case, qkv_format="sbhd"), **parallel)
        leaves = [t.transpose(0, 1).contiguous().requires_grad_() for t in (q, k, v)]  # sbhd
        out = self._call(module, *leaves)
        out = out.view(leaves[0].shape[0], leaves[0].shape[1], case.heads // groups.tp, case.head_dim)
        grads = torch.autograd.grad(out, leaves, dout.transpose(0, 1).contiguous())
        return [t.detach().transpose(0, 1).contiguous() for t in (out, *grads)], self._last

    def _disabled_reasons(self) -> str:
        """TE's own 'Disabling X ...' lines for this path, minus the ones our forcing flags caused.

        TE disables FlashAttention silently when flash-attn is not installed, so that case is read from
        TE's FlashAttentionUtils instead.
        """
        flash = self._te.flash_utils
        if self.path == "flash" and flash is not None and not any(
            getattr(flash, attr, False) for attr in ("is_installed", "v3_is_installed", "v4_is_installed")
        ):
            return "TE: FlashAttention needs the flash-attn package (v2, v3 or v4); none is installed"
        family = {"flash": "FlashAttention", "fused": "FusedAttention", "unfused": "UnfusedDotProductAttention"}[
            self.path
        ]
        lines = [
            line.strip()
            for line in self._te.capture.lines
            if line.startswith("Disabling") and family in line and "due to NVTE_" not in line
        ]
        return "TE: " + "; ".join(dict.fromkeys(lines)) if lines else ""

    def ran(self, out: torch.Tensor) -> str:
        return self._last

    def facts(self) -> dict[str, Any]:
        """The cuDNN TE loaded (version and files, read back), and determinism where it was asked for."""
        return {**self.cudnn, **({"deterministic": dict(self._determinism)} if self._determinism else {})}
