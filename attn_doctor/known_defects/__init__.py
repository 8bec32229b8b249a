"""Known-defect recognition: which known TE / cuDNN / FlashAttention / PyTorch attention defects match this
machine, and which match (or were not reproduced by) the probes of a run.

One concept a module: the condition table (`conditions`), the facts the conditions read and a results row
read as them (`facts`), reading and validating the data file (`loading`), matching (`matching`), and the
lines users read (`wording`).

The defects are data, in ``attn_doctor/data/known_bugs.toml`` (shipped as package data): one
``[[bug]]`` table per defect with

- ``id`` (required, unique), ``title`` (required), ``reference`` (required: the issue, PR or source line
  to read; an https URL, or for a defect attn-doctor found itself a path in this repository to the
  committed report),
- ``symptom``: one of :data:`SYMPTOMS`; ``component``: one of :data:`COMPONENTS`,
- ``fixed_in`` (free text, e.g. "cuDNN 9.15.1"; omit when unknown), ``workaround`` (what to do until
  then, e.g. "set NVTE_FUSED_ATTN=0"), ``note`` (the mechanism, and what TE does about it),
- ``found_by``: "attn-doctor" for a defect attn-doctor found itself (no upstream report yet),
- ``source`` (optional URL of the code line that encodes the rule or holds the fault), ``see_also``
  (optional list of URLs),
- ``[bug.when]``: the conditions, all of which must hold. Keys (all optional, at least one):

  environment (:data:`ENV_KEYS`)
    ``te`` PEP 440 specifier on TE's version; ``cudnn`` specifier on the cuDNN the path loaded (TE paths:
    the one TE loaded, torch's when that is unknown; SDPA paths: torch's); ``cudnn_in`` list of exact
    cuDNN versions; ``sm`` specifier on the compute capability as a number (90 for sm_90); ``sm_in``
    list of such numbers; ``flash_attn`` specifier on an installed flash-attn (v2, v3 or v4, e.g.
    ">=4.0.0a0,<5" for FlashAttention 4); ``torch`` specifier on torch's version.
  run (:data:`CONTEXT_KEYS`, read from :class:`MatchContext`)
    booleans ``training``, ``deterministic``, ``cuda_graph``, ``fp8``, ``context_parallel``,
    ``kv_cache``, ``softmax_sink``, ``bias``, ``dout_strided`` (the output gradient's strides differ
    from the output's), ``causal_with_explicit_mask`` (an attention_mask passed with a causal mask type
    that ignores it), ``varying_cu_seqlens`` (successive calls in one process with different
    cu_seqlens), ``recompute`` (full activation recompute); ``cp_comm_type`` list of TE's CP
    communication types ("p2p", "a2a", "all_gather", "a2a+p2p").
  path (:data:`PATH_KEYS`, read from :class:`MatchContext`)
    ``backend`` list of attn-doctor path names (`attn_doctor.backends.path_names`); a name matches itself
    and the paths under it ("te" every TE path, "te.fused" also "te.fused.det"); ``sub_backend`` list of
    TE's FusedAttention sub-backends (0 F16_max512_seqlen, 1 F16_arbitrary_seqlen, 2 FP8), read back from
    what TE ran; ``layout`` list of attn-doctor's memory layouts (`attn_doctor.core.layouts`).
  case (:data:`CASE_KEYS`)
    ``dtype`` list of "bf16"/"fp16"/"fp32"/"fp8"; ``qkv_format`` list of "bshd"/"sbhd"/"thd"/"bhsd"
    (from the context: the backend's format); ``mask`` list (TE's mask names; "none" is read as
    no_mask); ``window`` bool (a sliding window is set, left != -1); ``causal`` bool;
    ``cross_attention`` bool (seq != seq_kv); ``seq_kv_shorter`` bool (some sequence has fewer keys
    than queries); ``ragged`` bool (some sequence is shorter than the padded length); ``seq_kv_gt``,
    ``seq_q_gt``, ``seq_q_le`` int; ``seq_kv_not_multiple_of`` int; ``seq_kv_mod`` [m, r] (seq_kv % m
    == r); ``seqlens_not_multiple_of_2cp`` bool (some sequence's length is not a multiple of 2 x the
    CP size; needs context parallelism); ``batch_ge`` int; ``gqa`` bool (fewer kv heads than heads);
    ``kv_heads_lt`` int; ``head_dim_qk_ge`` / ``head_dim_v_ge`` int; ``head_dim_in`` list of d_qk;
    ``head_dims_differ`` bool (d_qk != d_v); ``head_dims_not_in`` list of [d_qk, d_v] pairs excluded;
    ``head_dim_v_not_in`` list of ints; ``head_dim_v_not_multiple_of`` int; ``fp8_recipe`` list of
    TE's FP8 recipes (`attn_doctor.core.case.TE_FP8_RECIPES`); ``bias_shape`` list of post_scale_bias
    shapes (`attn_doctor.core.case.BIAS_SHAPES`) or "alibi"; ``softmax_type`` list of
    "vanilla"/"off-by-one"/"learnable"; ``pad_between_seqs`` bool.

A rule is machine-level (scope "environment", printed by ``attn-doctor env``) when every condition but
``backend``/``sub_backend`` (which say what it affects) is about the environment or the run; otherwise
case-level, matched against each probe of a run.

A fact that is unknown (no TE installed, no GPU, an unreadable version, no qkv_format, a sub-backend TE
did not report) makes the condition that needs it fail: a rule never matches on a guess.

A rule whose conditions hold for a probe is reported as matching where the probe shows its symptom
(:func:`shows_symptom`), and as "not reproduced here" where none does (:func:`find_known_bugs`).
"""

from attn_doctor.known_defects.conditions import CASE_KEYS, CONDITION_KEYS, CONTEXT_KEYS, ENV_KEYS, PATH_KEYS
from attn_doctor.known_defects.facts import MatchContext, Probe, row_probe, sub_backend_from_ran
from attn_doctor.known_defects.loading import COMPONENTS, SYMPTOMS, KnownBug, known_bugs_path, load_known_bugs
from attn_doctor.known_defects.matching import (
    Finding,
    Match,
    find_known_bugs,
    match_case,
    match_environment,
    shows_symptom,
)
from attn_doctor.known_defects.wording import describe, describe_finding, describe_run

__all__ = [
    "CASE_KEYS", "COMPONENTS", "CONDITION_KEYS", "CONTEXT_KEYS", "ENV_KEYS", "PATH_KEYS", "SYMPTOMS",
    "Finding", "KnownBug", "Match", "MatchContext", "Probe",
    "describe", "describe_finding", "describe_run", "find_known_bugs", "known_bugs_path", "load_known_bugs",
    "match_case", "match_environment", "row_probe", "shows_symptom", "sub_backend_from_ran",
]
