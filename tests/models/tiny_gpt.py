"""A small GPT written with PyTorch SDPA, for the capture / replay / compare tests: a fused qkv projection whose
q, k, v are head-sliced views of one buffer (what Megatron and most models pass to attention), causal masks,
and a tensor-parallel split of the heads (`--tp N` under torchrun, gloo): the same seed gives the same model at
every TP size, so a TP=2 run and a TP=1 run compute the same function.

    python tests/models/tiny_gpt.py [--steps 2] [--layers 4] [--faulty-rank R]
    torchrun --nproc-per-node 2 tests/models/tiny_gpt.py --tp 2
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

HIDDEN, HEADS, VOCAB, SEQ, BATCH = 64, 4, 97, 16, 2


def faulty_attention(q, k, v, is_causal=False):
    """A faulty library call (tests/models/fake_flash_attn: flash_attn_func dropping the last key), on bhsd."""
    fake = Path(__file__).parent / "fake_flash_attn"
    if str(fake) not in sys.path:
        sys.path.insert(0, str(fake))
    import flash_attn

    if Path(flash_attn.__file__).parent.parent != fake:  # another flash_attn would not be the faulty one
        raise RuntimeError(f"flash_attn is already imported from {flash_attn.__file__}, not the faulty stand-in")

    out = flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=is_causal)
    return out.transpose(1, 2)


def faulty_kernel(q, k, v, *, causal, softmax_scale):
    """The same fault as an attn-doctor --kernel (bshd tensors): the last key of every sequence is dropped."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k[:, :-1].transpose(1, 2), v[:, :-1].transpose(1, 2),
                                         scale=softmax_scale)
    return out.transpose(1, 2)


def faulty_on_large_inputs_kernel(q, k, v, *, causal, softmax_scale):
    """A --kernel (bshd tensors) that drops the last key only where q holds entries far beyond a standard
    normal's (a captured call's own values can; attn-doctor's seeded inputs of the same shapes cannot)."""
    if float(q.detach().abs().amax()) <= LARGE_INPUT:
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal, scale=softmax_scale).transpose(1, 2)
    return faulty_kernel(q, k, v, causal=causal, softmax_scale=softmax_scale)


LARGE_INPUT = 10.0  # faulty_on_large_inputs_kernel's trigger: |q| beyond any standard-normal draw of a test


def dout_recording_kernel(q, k, v, *, causal, softmax_scale):
    """A correct --kernel (bshd tensors) that appends the shape and strides of the output gradient its backward
    gets to the file $TINY_GPT_DOUT_LOG, a line each."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         scale=softmax_scale)
    log = os.environ.get("TINY_GPT_DOUT_LOG")
    if log and out.requires_grad:
        def note(gradient):
            with open(log, "a") as lines:
                lines.write(f"{list(gradient.shape)} {list(gradient.stride())}\n")

        out.register_hook(note)
    return out.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, tp: int, rank: int, generator: torch.Generator, faulty: bool = False):
        super().__init__()
        self.heads, self.dim = HEADS // tp, HIDDEN // HEADS
        full_qkv = torch.randn(3 * HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5
        full_proj = torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5
        width = self.heads * self.dim  # this rank's heads: column-parallel qkv, row-parallel projection
        rows = torch.cat([full_qkv[i * HIDDEN + rank * width:i * HIDDEN + (rank + 1) * width] for i in range(3)])
        self.qkv = nn.Parameter(rows)
        self.proj = nn.Parameter(full_proj[:, rank * width:(rank + 1) * width].clone())
        self.faulty = faulty

    def forward(self, x):  # x [b, s, hidden]
        b, s, _ = x.shape
        parallel = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        if parallel:
            x = CopyToParallel.apply(x)
        qkv = (x @ self.qkv.t()).view(b, s, 3, self.heads, self.dim)
        q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))  # [b, h, s, d] views of one buffer
        attend = faulty_attention if self.faulty else F.scaled_dot_product_attention
        out = attend(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, self.heads * self.dim)
        out = out @ self.proj.t()
        return AllReduce.apply(out) if parallel else out


class CopyToParallel(torch.autograd.Function):
    """Megatron's column-parallel input: the identity forward, the gradient summed over ranks backward."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        torch.distributed.all_reduce(grad)
        return grad


class AllReduce(torch.autograd.Function):
    """The row-parallel sum; its backward passes the gradient through (every rank holds the whole output)."""

    @staticmethod
    def forward(ctx, x):
        x = x.clone()
        torch.distributed.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class Block(nn.Module):
    def __init__(self, tp, rank, generator, faulty=False):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.attention = Attention(tp, rank, generator, faulty)

    def forward(self, x):
        return x + self.attention(self.norm(x))


class TinyGPT(nn.Module):
    def __init__(self, layers: int = 4, tp: int = 1, rank: int = 0, seed: int = 0, faulty_layer: int | None = None):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator) * 0.5)
        self.layers = nn.ModuleList(Block(tp, rank, generator, faulty=(i == faulty_layer)) for i in range(layers))
        self.head = nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=generator) / HIDDEN ** 0.5)

    def forward(self, tokens):
        x = self.embed[tokens]
        for layer in self.layers:
            x = layer(x)
        return x @ self.head.t()


def train(steps: int = 2, layers: int = 4, tp: int = 1, rank: int = 0, faulty_layer: int | None = None,
          seed: int = 0) -> list[torch.Tensor]:
    """`steps` SGD steps on fixed random tokens; returns each step's loss and the last step's gradients."""
    model = TinyGPT(layers, tp, rank, seed, faulty_layer)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(seed + 1))
    results = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        model.zero_grad()
        loss.backward()
        results = [loss.detach()] + [p.grad.detach().clone() for p in model.parameters()]
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--faulty-rank", type=int, default=None,
                        help="this rank's layer 1 calls a wrong flash_attn_func (tests/models/fake_flash_attn)")
    args = parser.parse_args()
    rank = 0
    if args.tp > 1:
        torch.distributed.init_process_group("gloo")
        rank = torch.distributed.get_rank()
        import attn_doctor

        attn_doctor.describe_parallel(tp=args.tp, tp_rank=rank)
    faulty = 1 if args.faulty_rank is not None and args.faulty_rank == rank else None
    losses = train(args.steps, args.layers, args.tp, rank, faulty)
    print(f"rank {rank}: loss {float(losses[0]):.6f}")
    if args.tp > 1:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
