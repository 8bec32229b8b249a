"""A small model with TE's DotProductAttention as core attention, for issue 17's H200 evidence: `--tp 1` runs
the whole heads in one attention per layer; `--tp 2` simulates two tensor-parallel ranks on one GPU (each layer
runs two attentions of half the heads, with the same weights cut Megatron's way, and sums their projections).
The same seed gives the same function at both TP sizes. q, k, v are head-sliced views of one [s, b, 3, h, d]
buffer, as Megatron hands them to TE.

    python3 reports/h200/capture/te_model.py --tp 1|2 [--layers 4] [--steps 2]
"""

import argparse

import transformer_engine.pytorch as te  # first: TE loads its own cuDNN before torch uses one
import torch

import attn_doctor

HIDDEN, HEADS, SEQ, BATCH = 512, 8, 256, 2


class Shard(torch.nn.Module):
    """One TP rank's heads of one layer: its columns of the qkv projection, its rows of the output one."""

    def __init__(self, qkv: torch.Tensor, proj: torch.Tensor, heads: int):
        super().__init__()
        self.heads, self.dim = heads, HIDDEN // HEADS
        self.qkv = torch.nn.Parameter(qkv)
        self.proj = torch.nn.Parameter(proj)
        self.attention = te.DotProductAttention(heads, self.dim, attn_mask_type="causal", qkv_format="sbhd",
                                                attention_dropout=0.0)

    def forward(self, x, tp_rank: int, tp: int):  # x [s, b, hidden]
        s, b, _ = x.shape
        qkv = (x @ self.qkv.t()).view(s, b, 3, self.heads, self.dim)
        attn_doctor.describe_parallel(tp=tp, tp_rank=tp_rank)
        out = self.attention(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2])  # [s, b, heads * dim]
        return out @ self.proj.t()


class Layer(torch.nn.Module):
    def __init__(self, tp: int, generator: torch.Generator):
        super().__init__()
        qkv = torch.randn(3, HEADS * (HIDDEN // HEADS), HIDDEN, generator=generator) / HIDDEN ** 0.5
        proj = torch.randn(HIDDEN, HIDDEN, generator=generator) / HIDDEN ** 0.5
        width = HIDDEN // tp
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.shards = torch.nn.ModuleList(
            Shard(qkv[:, r * width:(r + 1) * width].reshape(3 * width, HIDDEN).clone(),
                  proj[:, r * width:(r + 1) * width].clone(), HEADS // tp) for r in range(tp))

    def forward(self, x):
        y = self.norm(x)
        return x + sum(shard(y, rank, len(self.shards)) for rank, shard in enumerate(self.shards))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    generator = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(*[Layer(args.tp, generator) for _ in range(args.layers)]).cuda().to(torch.bfloat16)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=torch.Generator().manual_seed(1)).cuda().to(torch.bfloat16)
    for _ in range(args.steps):
        model.zero_grad()
        loss = model(x).float().square().mean()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.01 * p.grad
    print(f"tp {args.tp}: loss {float(loss):.6f}")


if __name__ == "__main__":
    main()
