"""TE's MultiheadAttention (`te.mha`) and TransformerLayer (`te.layer`) as paths of their own: attention as users
who build on TE's layers call it (TE's own tests: test_transformer_layer, the custom MHA of its fp8 tests).

Each path builds the module for a case the way `attn_doctor.numerics.layer` replicates it: hidden = heads *
head_dim, fused QKV parameters (`fuse_qkv_params=True`, TE's interleaved QKV weight), num_gqa_groups = the case's
kv heads, the case's mask type and window, qkv_format (TransformerLayer: attn_input_format) from the case (sbhd or
bshd), no dropout, parameters in the case's dtype; MultiheadAttention without an input LayerNorm (its plain
fused Linear), TransformerLayer with its LayerNormLinear QKV, bias-dropout-add residuals and a ReLU LayerNormMLP
of twice the hidden size. Rotary embedding: TE's RotaryPositionEmbedding(head_dim) frequencies, passed as
`rotary_pos_emb`.

The core attention runs on TE's default choice of backend (no NVTE_* flag is set here; the selection is
invalidated before each forward so that it is made for this call), and what ran is read back from TE's
`_attention_backends` after the forward (`te.describe_state`), never assumed.

The probe (`attn_doctor.probes.module`) copies its seeded weights into the module's own parameters, reads them
back as the module holds them and judges the layer against its float64 replica. The hooks it uses are this
class's `build_layer`, `layer_parameters`, `core_attention`, `rotary_frequencies` and `call_layer`.

TE is imported only in the worker (`prepare_process`, TE's own backend's: the same loader and facts).
"""

from __future__ import annotations

from typing import Any

import torch

from attn_doctor.backends import te as te_backend
from attn_doctor.backends.base import Backend, BackendSpec, PathMemory, Unsupported
from attn_doctor.core.case import DTYPE_BYTES, Case
from attn_doctor.core.errors import first_line
from attn_doctor.core.probe_kinds import DEPTH_LAYOUT
from attn_doctor.machine.te_facts import te_installed
from attn_doctor.numerics.layer import ACTIVATION, LAYERNORM_EPS, Architecture
from attn_doctor.numerics.masks import Semantics

# What the module feeds its core attention: views of its fused QKV projection's output split per kv group
# ([.., kv_heads, (group + 2) * head_dim], attn-doctor's sbh3d_packed), q and k then rotated by RoPE.
LAYER_LAYOUT = DEPTH_LAYOUT
MODULES = {"mha": "MultiheadAttention", "layer": "TransformerLayer"}
# Each weight's role (`attn_doctor.numerics.layer.Weights`) -> its parameter's name in TE's module.
PARAMETERS = {
    "mha": {"qkv_weight": "qkv.weight", "qkv_bias": "qkv.bias", "proj_weight": "proj.weight",
            "proj_bias": "proj.bias"},
    "layer": {"ln1_weight": "self_attention.layernorm_qkv.layer_norm_weight",
              "ln1_bias": "self_attention.layernorm_qkv.layer_norm_bias",
              "qkv_weight": "self_attention.layernorm_qkv.weight", "qkv_bias": "self_attention.layernorm_qkv.bias",
              "proj_weight": "self_attention.proj.weight", "proj_bias": "self_attention.proj.bias",
              "ln2_weight": "layernorm_mlp.layer_norm_weight", "ln2_bias": "layernorm_mlp.layer_norm_bias",
              "fc1_weight": "layernorm_mlp.fc1_weight", "fc1_bias": "layernorm_mlp.fc1_bias",
              "fc2_weight": "layernorm_mlp.fc2_weight", "fc2_bias": "layernorm_mlp.fc2_bias"},
}
CORE_ATTENTION = {"mha": "core_attention", "layer": "self_attention.core_attention"}
LAYER_MASKS = ("no_mask", "causal")
LAYER_DTYPES = ("bf16", "fp16")

REPRO_SOURCE = '''

FORMAT = "sbhd"


def kernel(q, k, v, case):
    raise SystemExit("{name} is TE's {module} as a whole layer: a single attention call does not reproduce it; "
                     "re-run the row's command (attn-doctor run --backend {name} ...)")
'''


def layer_unsupported(case: Case) -> str | None:
    """Why a module path cannot model the case (a SKIP reason), or None."""
    if case.replay is not None:
        return "a replayed case is one captured attention call; the module paths build their own layer"
    if case.qkv_format not in ("sbhd", "bshd"):
        return f"the module paths take hidden states in sbhd or bshd, not {case.qkv_format}"
    if case.mask not in LAYER_MASKS or case.api_features():
        features = case.api_features() or [f"mask {case.mask}"]
        return (f"the module paths model a self-attention layer with a causal or no mask (and a window); this case "
                f"uses {', '.join(features)}")
    if case.dtype not in LAYER_DTYPES:
        return ("the module paths are checked in bf16/fp16: in fp32 TE's GEMMs may run in TF32 (cuBLAS's choice), "
                "which the fp32 plain-torch yardstick does not")
    if case.inputs != "normal":
        return (f"the layer's q, k, v come from its seeded weights and hidden states: inputs {case.inputs} applies to "
                "single calls")
    if case.heads % case.kv_heads:
        return f"heads ({case.heads}) must be a multiple of kv heads ({case.kv_heads})"
    return None


class TEModule(Backend):
    family = "te.module"
    layer_path = True
    # Opt-in: `attn-doctor run` without --backend keeps the rows (and layouts) it always had.
    opt_in = True
    fixed_paths = (("te.mha", {"module": "mha"}), ("te.layer", {"module": "layer"}))
    loads_cudnn = False  # TE loads it; --cudnn builds are TE's DotProductAttention paths' (`backends.te`)

    # -- in the parent --

    @classmethod
    def format_for(cls, case: Case) -> str:
        return case.qkv_format

    @classmethod
    def own_layout(cls, spec: BackendSpec) -> str:
        return LAYER_LAYOUT

    @classmethod
    def static_skip(cls, spec: BackendSpec, case: Case, device: str) -> str | None:
        if not device.startswith("cuda"):
            return f"TE's {MODULES[spec.options['module']]} needs a CUDA GPU; this run is on the CPU"
        if not te_installed():
            return "transformer_engine is not installed (pip install 'attn-doctor[te]')"
        return layer_unsupported(case)

    @classmethod
    def memory(cls, spec: BackendSpec, case: Case) -> PathMemory:
        """The local yardstick's attention (24 bytes a score in bf16, `backends.local`) twice (in the layer and on
        the captured q, k, v), and the layer's activations in three copies (the module, the yardstick and the
        float64 replica, 8 bytes an element), about 16 of them per token and hidden size."""
        scores, item = case.score_elements, DTYPE_BYTES[case.dtype]
        activations = 16 * case.batch * case.seq * case.heads * case.head_dim * (2 * item + 8)
        return PathMemory(saved=scores * (4 + item), transient=scores * (16 + item) + activations)

    @classmethod
    def repro_source(cls, spec: BackendSpec) -> str:
        return REPRO_SOURCE.format(name=spec.name, module=MODULES[spec.options["module"]])

    @classmethod
    def prepare_process(cls) -> dict:
        return te_backend.TEAttention.prepare_process()

    # -- in a worker --

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        if te_backend._import_error is not None:
            raise Unsupported(f"transformer_engine not importable: {te_backend._import_error}")
        self.kind = spec.options["module"]
        self._te = te_backend.load_te()
        self._last = ""
        self._state: dict[str, Any] = {}

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case,
                semantics: Semantics | None = None) -> torch.Tensor:
        raise Unsupported(f"{self.name} is TE's {MODULES[self.kind]} as a whole layer: it is checked as a layer "
                          f"(attn-doctor run --backend {self.name}), not as TP shards, depth stacks or ranks")

    def build_layer(self, arch: Architecture, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
        """TE's module for the architecture (see the module docstring), in training mode."""
        te = self._te.te
        mask = "causal" if arch.causal else "no_mask"
        common = dict(num_gqa_groups=arch.kv_heads, kv_channels=arch.head_dim, attention_dropout=0.0,
                      window_size=arch.window, params_dtype=dtype, fuse_qkv_params=True, device=device)
        try:
            if self.kind == "mha":
                module = te.MultiheadAttention(arch.hidden, arch.heads, attn_mask_type=mask, qkv_format=arch.fmt,
                                               input_layernorm=False, layernorm_epsilon=LAYERNORM_EPS, **common)
            else:
                module = te.TransformerLayer(arch.hidden, arch.ffn, arch.heads, hidden_dropout=0.0,
                                             layernorm_epsilon=LAYERNORM_EPS, self_attn_mask_type=mask,
                                             activation=ACTIVATION, attn_input_format=arch.fmt, **common)
        except (TypeError, ValueError, AssertionError) as exc:
            raise Unsupported(f"TE's {MODULES[self.kind]} refused the layer: {first_line(exc)}") from None
        return module.train()

    def layer_parameters(self, module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
        """The module's own parameters by role (`attn_doctor.numerics.layer.Weights`)."""
        found = dict(module.named_parameters())
        wanted = PARAMETERS[self.kind]
        missing = [name for name in wanted.values() if name not in found]
        if missing:
            raise Unsupported(f"this TE's {MODULES[self.kind]} has no parameter {', '.join(missing)} (it has "
                              f"{', '.join(found)}): attn-doctor does not know where its weights are")
        return {role: found[name] for role, name in wanted.items()}

    def core_attention(self, module: torch.nn.Module) -> torch.nn.Module:
        return module.get_submodule(CORE_ATTENTION[self.kind])

    def rotary_frequencies(self, arch: Architecture, seq: int, device: torch.device) -> torch.Tensor:
        """TE's own RotaryPositionEmbedding(head_dim) for `seq` positions (fp32 [seq, 1, 1, head_dim])."""
        return self._te.te.RotaryPositionEmbedding(arch.head_dim)(seq).to(device)

    def call_layer(self, module: torch.nn.Module, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        """The module's forward on TE's default attention backend, chosen afresh for this call; what ran is read back
        after it."""
        self._te.state["backend_selection_requires_update"] = True
        self._te.capture.lines.clear()
        try:
            out = module(x, rotary_pos_emb=freqs)
        except ValueError as exc:
            if te_backend.NO_BACKEND_MESSAGE not in str(exc):
                raise
            lines = [line for line in self._te.capture.lines if line.startswith("Disabling")]
            raise Unsupported("TE: " + ("; ".join(dict.fromkeys(lines)) or str(exc))) from None
        self._state = dict(self._te.state)
        self._last = (f"{MODULES[self.kind]} > DotProductAttention: " + te_backend.describe_state(self._state)
                      + te_backend.describe_layout(self._state))
        return out[0] if isinstance(out, tuple) else out

    def ran_flash_style(self) -> bool:
        """Whether the core attention that ran takes D from its rounded output (fused, flash; read back)."""
        return bool(self._state.get("use_flash_attention") or self._state.get("use_fused_attention"))

    def ran(self, out: torch.Tensor | None = None) -> str:
        return self._last
