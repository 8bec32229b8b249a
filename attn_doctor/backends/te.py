"""Transformer Engine's DotProductAttention, one backend per kernel path.

A path is forced the way TE's own tests force it: all of NVTE_FLASH_ATTN / NVTE_FUSED_ATTN /
NVTE_UNFUSED_ATTN set to 0 but the chosen one, then `_attention_backends["backend_selection_requires_update"]`
set so TE re-runs its selection in this process (it caches the last choice per AttentionParams).
What ran is read back from `_attention_backends` after the forward, never assumed from the flags, and
the reasons TE gives for disabling a path come from its "DotProductAttention" logger at DEBUG level.

TE is imported only inside the TE worker process, before anything touches torch's cuDNN: a process that
already loaded torch's cuDNN can fail to import TE (two cuDNN builds; see h200-device-facts.md).
"""

from __future__ import annotations

import importlib
import logging
import os
from importlib.metadata import PackageNotFoundError, version

import torch

from attn_doctor.backends.base import Backend, BackendSpec, Unsupported
from attn_doctor.core.case import Case

FLAGS = {"flash": "NVTE_FLASH_ATTN", "fused": "NVTE_FUSED_ATTN", "unfused": "NVTE_UNFUSED_ATTN"}
# F16_max512_seqlen (0) and F16_arbitrary_seqlen (1); NVTE_FUSED_ATTN_BACKEND chose between them up to
# TE 2.15 and only when both sequence lengths are <= 512. The max512 sub-backend was removed in 2.16 (#2949).
FUSED_SUB_BACKENDS = {"0": "F16_max512_seqlen", "1": "F16_arbitrary_seqlen", "2": "FP8"}
LAST_TE_WITH_SUB_BACKEND_CHOICE = (2, 15)
NO_BACKEND_MESSAGE = "No dot product attention backend is available"


def te_version() -> tuple[int, int] | None:
    try:
        parts = version("transformer-engine").split(".")
        return int(parts[0]), int(parts[1])
    except (PackageNotFoundError, ValueError, IndexError):
        return None


def te_paths() -> list[tuple[str, dict]]:
    """(row name, options) of every TE kernel path the installed TE lets a user choose."""
    paths = [("te.flash", {"path": "flash"}), ("te.fused", {"path": "fused"}), ("te.unfused", {"path": "unfused"})]
    installed = te_version()
    if installed is not None and installed <= LAST_TE_WITH_SUB_BACKEND_CHOICE:
        paths.insert(2, ("te.fused.max512", {"path": "fused", "sub_backend": "0"}))
    return paths


class _Capture(logging.Handler):
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
        self.capture = _Capture()
        logger = logging.getLogger("DotProductAttention")
        logger.addHandler(self.capture)
        logger.setLevel(logging.DEBUG)
        logger.propagate = False

    @property
    def state(self) -> dict:
        return self.dpa_module._attention_backends


_te: _TE | None = None


def load_te() -> _TE:
    global _te
    if _te is None:
        _te = _TE()
    return _te


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


def dpa_arguments(case: Case) -> dict:
    """DotProductAttention's constructor arguments for a case (sbhd, no dropout), before any TP/CP ones."""
    return dict(
        num_attention_heads=case.heads,
        kv_channels=case.head_dim,
        num_gqa_groups=case.num_kv_heads,
        attention_dropout=0.0,
        qkv_format="sbhd",
        attn_mask_type="causal" if case.causal else "no_mask",
        window_size=case.window,
        softmax_scale=case.softmax_scale,
    )


class TEAttention(Backend):
    qkv_format = "sbhd"

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        self.path = spec.options["path"]
        self.sub_backend = spec.options.get("sub_backend")
        self._te = load_te()
        self._modules: dict[tuple, torch.nn.Module] = {}
        self._last = ""

    def unsupported(self, case: Case, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "TE attention needs a CUDA GPU"
        return None

    def _module(self, case: Case) -> torch.nn.Module:
        # A new module per setting: TE reads some settings (e.g. determinism) only at construction.
        key = (case.heads, case.num_kv_heads, case.head_dim, case.mask, case.window)
        if key not in self._modules:
            self._modules[key] = self._te.te.DotProductAttention(**dpa_arguments(case))
        return self._modules[key]

    def _force(self) -> None:
        for path, flag in FLAGS.items():
            os.environ[flag] = "1" if path == self.path else "0"
        if self.sub_backend is not None:
            os.environ["NVTE_FUSED_ATTN_BACKEND"] = self.sub_backend
        else:
            os.environ.pop("NVTE_FUSED_ATTN_BACKEND", None)
        self._te.state["backend_selection_requires_update"] = True

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case) -> torch.Tensor:
        module = self._module(case)
        self._force()
        self._te.capture.lines.clear()
        try:
            out = module(q, k, v)
        except ValueError as exc:
            if NO_BACKEND_MESSAGE not in str(exc):
                raise
            raise Unsupported(self._disabled_reasons() or str(exc)) from None
        self._last = describe_state(self._te.state)
        seq_q, batch = q.shape[:2]
        return out.view(seq_q, batch, case.heads, case.head_dim)

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
