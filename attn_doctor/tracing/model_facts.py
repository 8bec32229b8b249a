"""What `capture` records of the model itself, once per process, when the model's first forward pass reaches
its first attention call (`Recorder._where`): the fingerprint of its weights (`attn_doctor.tracing.weights`),
the run settings that make two runs compute the same thing or not, and a hash of the data it was given.
`attn_doctor.tracing.upstream` compares two runs' facts before any attention call is.

- **Weights:** every named parameter of the model (the outermost module running at the first recorded call),
  under its canonical name, this TP rank's part (Megatron's `parallel_state`, or `describe_parallel`).
- **Settings:** dropout (Megatron's `attention_dropout`/`hidden_dropout`, a Hugging Face config's dropout
  probabilities, and every `nn.Dropout` module with p > 0) and whether the model is in training mode, where
  dropout draws; softmax in fp32, the softmax scale and query-key layer scaling; how Megatron initialised the
  weights (`use_cpu_initialization`) and the seeds (torch's, Megatron-LM's `--seed` when its arguments are set).
- **Data:** a SHA-256 of the token ids the model's forward pass got (its `input_ids`/`tokens` argument, else
  its first integer tensor), their shape and dtype: read once, at the first forward pass (one copy to the
  host, and so one synchronisation, in a GPU run).

Each fact is read so that it never raises: a fact that cannot be read is absent (`None`), never a failed run.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import time
from typing import Any

import torch

from attn_doctor.tracing.weights import canonical_name, layer_numbers, shard_prints

FORMAT_VERSION = 1
TOKEN_ARGUMENTS = ("input_ids", "tokens", "input")
# A Hugging Face config's dropout probabilities, by what they drop.
HF_ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")
HF_HIDDEN_DROPOUT = ("hidden_dropout", "hidden_dropout_prob", "resid_pdrop", "embd_pdrop", "dropout")


def _megatron_config(model: torch.nn.Module) -> Any:
    """The TransformerConfig of the first module that holds one (Megatron-Core's modules keep it as `config`)."""
    for module in model.modules():
        config = vars(module).get("config")
        if config is not None and type(config).__name__ == "TransformerConfig":
            return config
    return None


def _first(config: Any, names: tuple[str, ...]) -> float | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    return None


def _seeds() -> dict[str, int | None]:
    seeds: dict[str, int | None] = {"torch": None, "megatron": None}
    with contextlib.suppress(Exception):
        seeds["torch"] = int(torch.initial_seed())
    with contextlib.suppress(Exception):  # Megatron-LM's training arguments, when its script set them
        arguments = sys.modules["megatron.training.global_vars"]._GLOBAL_ARGS
        seeds["megatron"] = int(arguments.seed)
    return seeds


def settings_of(model: torch.nn.Module) -> dict[str, Any]:
    """The run settings (see the module docstring); a setting the model does not say is None."""
    config = _megatron_config(model)
    settings: dict[str, Any] = {"framework": "megatron" if config is not None else None, "training": model.training}
    if config is not None:
        settings.update({
            "attention_dropout": float(getattr(config, "attention_dropout", 0.0) or 0.0),
            "hidden_dropout": float(getattr(config, "hidden_dropout", 0.0) or 0.0),
            "softmax_in_fp32": getattr(config, "attention_softmax_in_fp32", None),
            "softmax_scale": getattr(config, "softmax_scale", None),
            "query_key_layer_scaling": getattr(config, "apply_query_key_layer_scaling", None),
            "use_cpu_initialization": getattr(config, "use_cpu_initialization", None),
            "tensor_model_parallel_size": getattr(config, "tensor_model_parallel_size", None)})
    else:
        hf = getattr(model, "config", None)
        if hf is not None and hasattr(hf, "to_dict"):
            settings["framework"] = "huggingface"
        settings.update({"attention_dropout": _first(hf, HF_ATTENTION_DROPOUT),
                         "hidden_dropout": _first(hf, HF_HIDDEN_DROPOUT)})
    dropouts = [(name, float(module.p)) for name, module in model.named_modules()
                if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0 and module.training]
    settings["dropout_modules"] = ({"count": len(dropouts), "first": canonical_name(dropouts[0][0]),
                                    "p": dropouts[0][1]} if dropouts else None)
    settings["seeds"] = _seeds()
    return settings


def data_of(args: tuple, kwargs: dict) -> dict[str, Any] | None:
    """The token ids of a forward call: their argument, shape, dtype and SHA-256, or None when it got none."""
    named = [(name, kwargs[name]) for name in TOKEN_ARGUMENTS if isinstance(kwargs.get(name), torch.Tensor)]
    found = named or [(f"argument {i}", a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    found = [(name, t) for name, t in found if not t.is_floating_point() and not t.is_complex()
             and t.dtype != torch.bool]
    if not found:
        return None
    name, tokens = found[0]
    host = tokens.detach().to("cpu", torch.int64).contiguous()
    digest = hashlib.sha256(str(list(host.shape)).encode() + host.numpy().tobytes()).hexdigest()
    return {"argument": name, "shape": list(host.shape), "dtype": str(tokens.dtype).removeprefix("torch."),
            "sha256": digest}


def model_facts(model: torch.nn.Module, args: tuple, kwargs: dict, rank: int,
                parallel: dict[str, int]) -> dict[str, Any]:
    """Everything this process records of the model (written to `model-<PID>.json`), with the seconds it took."""
    start = time.perf_counter()
    numbers = layer_numbers(model)
    named = [(canonical_name(name, numbers), parameter) for name, parameter in model.named_parameters()]
    weights = [p.to_dict() for p in shard_prints(named, parallel.get("tp", 1), parallel.get("tp_rank", 0))]
    facts = {"format_version": FORMAT_VERSION, "rank": rank, "parallel": parallel, "model": type(model).__name__,
             "weights": weights, "settings": settings_of(model)}
    try:
        facts["data"] = data_of(args, kwargs)
    except Exception as exc:  # noqa: BLE001 - a fact that cannot be read is absent
        facts["data"] = None
        facts["data_unreadable"] = f"{type(exc).__name__}: {exc}"[:200]
    facts["seconds"] = time.perf_counter() - start
    return facts


__all__ = ["data_of", "model_facts", "settings_of"]
