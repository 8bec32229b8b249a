"""One training step of a real Megatron-Core GPT, as the reporter's three runs make it: the TE spec
(`get_gpt_layer_with_transformer_engine_spec`), the same at TP=2 (under torchrun), or Megatron's own attention
(`get_gpt_layer_local_spec`, `--transformer-impl local`). A user's script, unchanged by attn-doctor: capture it
with `attn-doctor capture --out DIR --values -- python tests/models/megatron_gpt.py ...`.

The three runs compute the same model: every weight is drawn from a generator seeded by the parameter's place in
the model (its name, the TE spec's fused layer norms named as the local spec names them), at its full size, and
each TP rank takes its slice along Megatron's partition dimension (the fused QKV weight's rows are grouped per
query group, so a TP rank's slice is its heads' q, k and v): what Megatron's `--use-cpu-initialization` does.
`--init gpu` draws as Megatron does without it: each TP rank its own shards, from seed + 2718 + its TP rank, so
TP=1 and TP=2 are different models. Attention dropout is 0 unless `--attention-dropout` says otherwise: a
compared call must be one function. `--data-seed` picks the token ids.

On the CPU (no TE, local spec only) two CUDA-only pieces of Megatron are stood in for: its global memory buffer
(allocated on the CPU) and its CUDA RNG tracker's fork (dropout is 0, so nothing is drawn under it). Megatron's
fused softmax kernels are off (`masked_softmax_fusion=False`, Megatron-LM's `--no-masked-softmax-fusion`): they are
built from Megatron-LM's source tree, not shipped in the megatron-core wheel. Ranks that share one GPU talk over
gloo (NCCL refuses two ranks on one device); `--backend` overrides.

`--faulty-rank R --faulty-layer L` makes rank R's layer L attention wrong the way a faulty kernel is (its softmax
drops each query's own key, as a causal mask one off would), inside the core attention call the capture records.
(Dropping the last key, as it did before, is no fault at seq 1024 under a causal mask: only the last query sees
that key, with a weight near 1/1024, which moves its output less than bf16 rounds it.)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import time

import torch
import torch.distributed as dist

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# The TE spec's names of the layer norms it fuses into the next linear layer, by the local spec's names.
TE_NAMES = {"input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
            "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
            "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias"}


def _stand_in_for_cuda_only_pieces() -> None:
    import megatron.core.utils as utils
    from megatron.core.tensor_parallel import random

    utils.GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, *rest: torch.empty(shape, dtype=dtype)
    random.CudaRNGStatesTracker.fork = lambda self, name=None: contextlib.nullcontext()


def _canonical(name: str) -> str:
    for local, te in TE_NAMES.items():
        name = name.replace(te, local)
    return name


def _full_value(name: str, shape: torch.Size) -> torch.Tensor:
    """A parameter's full-size value, from its name alone (the same in every spec and TP degree)."""
    seed = int.from_bytes(hashlib.sha256(_canonical(name).encode()).digest()[:8], "little")
    generator = torch.Generator().manual_seed(seed)
    if name.endswith(("layernorm.weight", "layer_norm_weight")) or "norm.weight" in name:
        return torch.ones(shape)
    if name.endswith("bias"):
        return torch.zeros(shape)
    return torch.randn(shape, generator=generator) * 0.02


SEED = 1234


def set_weights(model: torch.nn.Module, tp: int, tp_rank: int, init: str = "cpu") -> None:
    """`init="cpu"`: every weight at its full size, each TP rank taking its slice (Megatron's
    use_cpu_initialization). `init="gpu"`: each TP rank draws its own shards of the split weights from one
    generator seeded seed + 2718 + its TP rank, in the model's order, as Megatron's GPU initialisation does
    (`_initialize_affine_weight_gpu` under the model-parallel RNG tracker); the weights every rank holds whole
    are drawn as with "cpu"."""
    per_rank = torch.Generator().manual_seed(SEED + 2718 + tp_rank)
    with torch.no_grad():
        for name, param in model.named_parameters():
            full_shape = list(param.shape)
            dim = getattr(param, "partition_dim", -1) if getattr(param, "tensor_model_parallel", False) else -1
            if init == "gpu" and dim >= 0:
                param.copy_((torch.randn(param.shape, generator=per_rank) * 0.02).to(param.dtype))
                continue
            if dim >= 0:
                full_shape[dim] *= tp
            value = _full_value(name, torch.Size(full_shape))
            if dim >= 0:
                value = value.chunk(tp, dim=dim)[tp_rank]
            param.copy_(value.to(param.dtype))


def _drop_the_own_key(softmax: torch.nn.Module) -> None:
    original = softmax.forward

    def faulty(scores, mask, *rest):
        probs = original(scores, mask, *rest).clone()
        probs.diagonal(dim1=-2, dim2=-1).zero_()
        return probs

    softmax.forward = faulty


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("te", "local"), default="local")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--query-groups", type=int, default=None)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None, help="torch.distributed backend (default: gloo on the CPU, "
                        "nccl on GPUs, gloo when ranks share one GPU)")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--faulty-rank", type=int, default=None)
    parser.add_argument("--faulty-layer", type=int, default=None, help="1-based, as Megatron numbers layers")
    parser.add_argument("--losses", default=None, help="append each step's loss here, a line each")
    parser.add_argument("--timings", default=None, help="append each step's seconds here, a line each")
    parser.add_argument("--qk-layer-scaling", action="store_true", help="apply_query_key_layer_scaling")
    parser.add_argument("--init", choices=("cpu", "gpu"), default="cpu", help="how TP shards are drawn: "
                        "cpu = sliced from one full draw (--use-cpu-initialization), gpu = each rank its own")
    parser.add_argument("--attention-dropout", type=float, default=0.0)
    parser.add_argument("--data-seed", type=int, default=1)
    args = parser.parse_args()

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    cpu = args.device == "cpu"
    if not cpu:
        gpus = torch.cuda.device_count()
        torch.cuda.set_device(rank % gpus)
        shared = world > gpus
        backend = args.backend or ("gloo" if shared else "nccl")
    else:
        backend = args.backend or "gloo"
    dist.init_process_group(backend, rank=rank, world_size=world)

    from megatron.core import parallel_state

    if cpu:
        _stand_in_for_cuda_only_pieces()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=args.tp)
    if not cpu:
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

        model_parallel_cuda_manual_seed(1234)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    dtype = DTYPES[args.dtype]
    config = TransformerConfig(
        num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
        num_query_groups=args.query_groups, tensor_model_parallel_size=args.tp, use_cpu_initialization=cpu,
        attention_softmax_in_fp32=True, apply_query_key_layer_scaling=args.qk_layer_scaling,
        attention_dropout=args.attention_dropout,
        hidden_dropout=0.0, params_dtype=dtype,
        bf16=args.dtype == "bf16", fp16=args.dtype == "fp16", masked_softmax_fusion=False,
        bias_dropout_fusion=False, gradient_accumulation_fusion=False, apply_rope_fusion=False,
        persist_layer_norm=False)
    spec = (specs.get_gpt_layer_with_transformer_engine_spec() if args.impl == "te"
            else specs.get_gpt_layer_local_spec())
    gpt = GPTModel(config, spec, vocab_size=args.vocab, max_sequence_length=args.seq)
    set_weights(gpt, args.tp, parallel_state.get_tensor_model_parallel_rank(), args.init)
    device = torch.device(args.device if cpu else "cuda")
    gpt = gpt.to(device)
    # Megatron-LM's --bf16/--fp16: the whole model in that dtype (its norms too), inputs cast, the loss in fp32
    model = gpt if dtype == torch.float32 else Float16Module(config, gpt)
    if args.faulty_rank == rank and args.faulty_layer is not None:
        attention = gpt.decoder.layers[args.faulty_layer - 1].self_attention.core_attention
        _drop_the_own_key(attention.scale_mask_softmax)

    generator = torch.Generator().manual_seed(args.data_seed)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=generator).to(device)
    positions = torch.arange(args.seq, device=device)[None].expand(args.batch, -1)
    mask = torch.ones(args.batch, 1, args.seq, args.seq, dtype=torch.bool, device=device).tril().logical_not()
    for _ in range(args.steps):
        started = time.perf_counter()
        loss = model(tokens[:, :-1], positions, mask, labels=tokens[:, 1:]).float().mean()
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param -= 0.1 * param.grad.to(param.dtype)
        if args.timings and rank == 0:
            with open(args.timings, "a") as timings:
                timings.write(f"{time.perf_counter() - started!r}\n")
        if args.losses and rank == 0:
            with open(args.losses, "a") as losses:
                losses.write(f"{loss.item()!r}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
